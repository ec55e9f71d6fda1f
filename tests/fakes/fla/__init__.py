"""A CPU stand-in for flash-linear-attention (tests/fakes/README.md): ``fla.ops.gated_delta_rule`` only."""
