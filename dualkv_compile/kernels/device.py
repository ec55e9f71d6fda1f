"""The compute capability and SM count of a CUDA device, asked once per device.

    capability(device) -> (major, minor)
    capability_of(index) -> (major, minor), cached (``capability_of.cache_clear()`` forgets)
    sm_count(device) -> the number of streaming multiprocessors, cached per index the same way

Why: the kernels' backends check it on every call (``supports``, the tuning
tables, the tensor-descriptor switch), and ``torch.cuda.get_device_capability``
reads the device's properties each time, host time spent before every launch.
A device's capability never changes within a process, so one answer per
device index is kept. The SM count (a launch heuristic's input) likewise.
"""

from __future__ import annotations

import functools

import torch

__all__ = ["capability", "capability_of", "sm_count", "sm_count_of"]


def _index(device: torch.device) -> int:
    """The index of a CUDA ``device`` (None: the current device's)."""
    return device.index if device.index is not None else torch.cuda.current_device()


def capability(device: torch.device) -> tuple[int, int]:
    """``(major, minor)`` of a CUDA ``device`` (index None: the current device)."""
    return capability_of(_index(device))


@functools.lru_cache(maxsize=None)
def capability_of(index: int) -> tuple[int, int]:
    """``(major, minor)`` of CUDA device ``index``: queried on the first call only."""
    return tuple(torch.cuda.get_device_capability(index))


def sm_count(device: torch.device) -> int:
    """The number of streaming multiprocessors of a CUDA ``device`` (index None: the current device)."""
    return sm_count_of(_index(device))


@functools.lru_cache(maxsize=None)
def sm_count_of(index: int) -> int:
    """The SM count of CUDA device ``index``: queried on the first call only."""
    return int(torch.cuda.get_device_properties(index).multi_processor_count)
