from .chunk import chunk_gated_delta_rule

__all__ = ["chunk_gated_delta_rule"]
