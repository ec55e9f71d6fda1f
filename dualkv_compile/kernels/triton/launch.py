"""The compile options every launch of the project's Triton and Gluon kernels passes.

    LAUNCH_OPTIONS   keyword arguments for ``kernel[grid](...)``

Why: Triton 3.9 warns that its default for floating-point contraction (``a * b + c`` as one FMA) will
change to off in Triton 3.10. The kernels were tuned and checked with FMAs (the softmax's
``exp2(s * scale - lse)`` is one per score; docs/benchmarks.md, "Behind the code"), so they ask for
them: they keep the FMAs whatever Triton's default, and no launch warns. From Triton 3.9 on, a user's
``TRITON_FORCE_DISABLE_FP_FUSION=1`` still turns them off (3.6-3.8 have no such switch). Under the CPU
interpreter the option is dropped (it is no argument of the kernels).
"""

from __future__ import annotations

__all__ = ["LAUNCH_OPTIONS"]

LAUNCH_OPTIONS = {"enable_fp_fusion": True}
