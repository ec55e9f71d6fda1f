"""dualkv_compile: compute each shared prompt once in GRPO-style policy updates."""
from .kernels.op import shared_prompt_attention
from .layout import SharedPromptLayout, Segments, detect, pack, unpack

__all__ = ["SharedPromptLayout", "Segments", "detect", "pack", "unpack", "shared_prompt_attention"]
