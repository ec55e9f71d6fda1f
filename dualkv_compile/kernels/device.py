"""The compute capability of a CUDA device, asked once per device.

    capability(device) -> (major, minor)

Why: the kernels' backends check it on every call (``supports``, the tuning
tables, the tensor-descriptor switch), and ``torch.cuda.get_device_capability``
reads the device's properties each time, host time spent before every launch.
A device's capability never changes within a process, so one answer per
device index is kept.
"""

from __future__ import annotations

import functools

import torch

__all__ = ["capability"]


def capability(device: torch.device) -> tuple[int, int]:
    """``(major, minor)`` of a CUDA ``device`` (index None: the current device)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    return _capability(index)


@functools.lru_cache(maxsize=None)
def _capability(index: int) -> tuple[int, int]:
    return tuple(torch.cuda.get_device_capability(index))
