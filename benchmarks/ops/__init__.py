"""One op alone against its baselines: the attention op (cases, methods, timing, report), windowed attention, the
varlen baseline attention registered with transformers, the host share of a call, the fused lm_head log-prob."""
