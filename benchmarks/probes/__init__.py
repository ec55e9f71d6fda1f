"""One question each: what Gluon offers, where a step's time goes (profiles, idle gaps, per-op CPU time), and whether
bf16 and float32 precision hold (logits, gradients, a prompt shared by thousands of rows)."""
