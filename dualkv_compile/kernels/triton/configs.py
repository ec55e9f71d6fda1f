"""The Triton kernels' tuning tables: tiles and pipelining per kernel, per head dim, per device.

    KernelConfig, Config, DQ_MODES    the launch parameters of the three kernels
    HOPPER_CONFIGS                    Hopper (sm_90), bf16/fp16, measured (docs/benchmarks.md, "Behind the code")
    config_for(q)                     the entry for q's device, dtype and head dim

Assumes the head dim is the kernels' (MLA already padded to the common one:
``head_dims``). Guarantees: a ``Config`` is valid by construction
(``Config.__post_init__``); ``config_for`` reads only q's device, dtype and
shape. ``attention.py`` re-exports all of it, where the tables lived first.
"""

from __future__ import annotations

import dataclasses

import torch

from ..device import capability
from ..common.launch import block_d

__all__ = ["DQ_MODES", "KernelConfig", "Config", "HOPPER_CONFIGS", "config_for"]

DQ_MODES = ("recompute", "atomic")


@dataclasses.dataclass(frozen=True)
class KernelConfig:
    """Tiles and pipelining of one kernel.

    ``tma``: load the full blocks of the streamed operands through tensor
    descriptors (Hopper's copy engine) where the device and the operands'
    strides allow it, else through pointers. ``stats_tma`` (dK/dV kernel, with
    ``tma``): its per-row lse and Delta too, from a packed copy the backward's
    preprocess kernel writes.
    """

    block_m: int
    block_n: int
    num_warps: int
    num_stages: int
    tma: bool = False
    stats_tma: bool = False


@dataclasses.dataclass(frozen=True)
class Config:
    """Launch parameters of the three kernels for one head dim.

    ``fwd`` and ``dq`` tile query rows by ``block_m`` and walk keys by
    ``block_n``; ``dkdv`` tiles keys by ``block_n`` and walks query rows by
    ``block_m``. ``head_split`` and ``dq_mode`` apply to the default
    (non-deterministic) backward only. ``dq_mode``: "recompute" (the Q-major
    dQ kernel recomputes S and dP) or "atomic" (the dK/dV kernel adds dS K
    into a float32 buffer with atomics; measured slower, and TMA bulk
    reductions instead of per-element atomics did not fit its tiles:
    docs/benchmarks.md, "Behind the code").
    """

    fwd: KernelConfig
    dkdv: KernelConfig
    dq: KernelConfig
    head_split: int = 1
    dq_mode: str = "recompute"

    def __post_init__(self):
        if self.dq_mode not in DQ_MODES:
            raise ValueError(f"Config.dq_mode: expected one of {DQ_MODES}, got {self.dq_mode!r}")
        if self.head_split < 1:
            raise ValueError(f"Config.head_split: expected a positive int, got {self.head_split}")


# Hopper (sm_90), bf16/fp16, measured with benchmarks/tuning/triton_tune.py
# (docs/benchmarks.md, "Behind the code"). Keyed by the padded head dim.
# D=128 and D=64 are measured: tensor-descriptor loads; the dK/dV kernel
# in one warpgroup on 64 keys (two programs per SM; 32 query rows at D=128, where 64
# rows spill registers, 64 at D=64) with all query heads of a kv head in one program
# and the row statistics packed for the copy engine. D=256 is untuned beyond the
# correctness checks and keeps pointer loads.
HOPPER_CONFIGS: dict[int, Config] = {
    64: Config(
        fwd=KernelConfig(128, 64, 8, 3, tma=True),
        dkdv=KernelConfig(64, 64, 4, 3, tma=True, stats_tma=True),
        dq=KernelConfig(128, 64, 8, 3),
    ),
    128: Config(
        fwd=KernelConfig(128, 128, 8, 3, tma=True),
        dkdv=KernelConfig(32, 64, 4, 3, tma=True, stats_tma=True),
        dq=KernelConfig(128, 64, 8, 3),
    ),
    256: Config(
        fwd=KernelConfig(64, 64, 4, 2),
        dkdv=KernelConfig(32, 64, 8, 1),
        dq=KernelConfig(64, 32, 8, 1),
    ),
}
# Other CUDA GPUs: conservative tiles that fit 100 KB of shared memory (untuned).
_GENERIC_CONFIGS: dict[int, Config] = {
    64: Config(KernelConfig(128, 64, 4, 2), KernelConfig(64, 64, 4, 2), KernelConfig(64, 64, 4, 2)),
    128: Config(KernelConfig(64, 64, 4, 2), KernelConfig(64, 64, 8, 1), KernelConfig(64, 64, 8, 1)),
    256: Config(KernelConfig(64, 32, 4, 1), KernelConfig(32, 32, 4, 1), KernelConfig(32, 32, 4, 1)),
}
# float32 inputs on GPU (a correctness path, not a fast one): "tf32x3" products, whose
# split operands need small tiles to fit shared memory.
_FP32_CUDA_CONFIG = Config(KernelConfig(32, 32, 4, 1), KernelConfig(32, 32, 4, 1), KernelConfig(32, 32, 4, 1))
# The interpreter runs programs one by one in numpy: small tiles keep tests quick
# and still exercise many blocks, ragged edges and diagonals.
_INTERPRET_CONFIG = Config(KernelConfig(16, 16, 4, 1), KernelConfig(16, 16, 4, 1), KernelConfig(16, 16, 4, 1))


def config_for(q: torch.Tensor) -> Config:
    """The tuning-table entry for q's device and head dim (the padded common one for MLA)."""
    if q.device.type != "cuda":
        return _INTERPRET_CONFIG
    if q.dtype == torch.float32:
        return _FP32_CUDA_CONFIG
    bd = max(64, block_d(q.shape[-1]))
    table = HOPPER_CONFIGS if capability(q.device)[0] == 9 else _GENERIC_CONFIGS
    return table[bd]
