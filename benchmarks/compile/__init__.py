"""Compile time of a GRPO step: @policy_loss against plain Inductor, cold and warm-started."""
