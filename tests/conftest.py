"""Test-session setup.

Without CUDA the Triton kernels run under the Triton interpreter. ``triton.jit``
reads ``TRITON_INTERPRET`` when a kernel module is imported, so it must be set
before any test module imports one (directly or through the op or backend).
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
