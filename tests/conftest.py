"""Test-session setup.

Without CUDA the Triton kernels run under the Triton interpreter. ``triton.jit``
reads ``TRITON_INTERPRET`` when a kernel module is imported, so it must be set
before any test module imports one (directly or through the op or backend).
"""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(scope="module")
def one_thread():
    """Tiny tensors: intra-op threads only add wake-up stalls (severe on a shared 2-core machine)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
