"""``DualKVConfig``: the backend's options, validated where they are given.

``torch.compile(..., backend="dualkv", options={...})`` and ``@policy_loss(**options)`` both build one
with ``DualKVConfig.from_options``, which names the option and what was expected on bad input.
"""

from __future__ import annotations

import dataclasses
import numbers
from typing import Optional

__all__ = ["DualKVConfig"]


@dataclasses.dataclass
class DualKVConfig:
    """Options, given as ``torch.compile(..., backend="dualkv", options={...})``.

    min_rho           rewrite a call only if its token reduction is at least this
    group_size        rows per group, if the caller knows it (verified, not searched)
    min_shared        shortest shared prefix (tokens) that makes rows a group
    inner             "inductor" or "aot_eager": compiles both the fallback and the packed graph
    packed_compile    "direct" (the packed graph straight to AOTAutograd and the inner compiler, with symbolic
                      sizes and guards of its own: runtime.direct_compile) or "nested" (traced again by a nested
                      torch.compile, as before "direct"; what "direct" falls back to where it does not apply)
    verify            check the graph's attention masks against the layout on the first rewritten call
    attention_backend "auto", "reference", "cpu_flash", "flex", "triton" or "gluon" (see ops.attention); one that
                      cannot run a graph's attention (device, dtype, head dim) refuses the graph
    verify_max_elements  skip the mask check when a mask would hold more elements than this
    chunked_log_probs    fuse a loss's lm_head -> log_softmax -> next-token gather into
                         ``dualkv::linear_log_prob`` (rewrite.fuse_linear_log_prob): logits and
                         log-probs exist a chunk of tokens at a time and none are kept for the
                         backward, which recomputes them (one extra lm_head matmul); False keeps
                         the unfused graph
    check_exact          None (off), "first" or an int N: on the first packed call of each graph (and, for N,
                         every Nth), run the original program beside the packed one and compare outputs and
                         parameter gradients within a tolerance that follows the dtype; a mismatch raises
                         ``ExactnessError`` naming the first diverging output or input (runtime.exactness_check)
    sequence_parallel    None, or the sequence-parallel group (a ProcessGroup or a 1-D DeviceMesh): Ulysses over
                         the packed stream (rewrite.sequence_parallel). Every rank of the group calls with the
                         same batch and holds 1/world of the packed tokens; the mean of a parameter's
                         gradients over the group (what FSDP2 and DDP reduce) is the single-process gradient.
                         Normalised to an ``SPGroup`` (None for a group of one)
    log_prob_chunk_bytes that op's chunk: as many tokens as one [C, V] float32 buffer (float64 for a
                         float64 model) holds in this many bytes, at least one; its working set is a
                         few such buffers
    """

    min_rho: float = 1.1
    group_size: Optional[int] = None
    min_shared: int = 1
    inner: str = "inductor"
    packed_compile: str = "direct"
    verify: bool = True
    attention_backend: str = "auto"
    verify_max_elements: int = 1 << 26
    chunked_log_probs: bool = True
    log_prob_chunk_bytes: int = 1 << 30
    sequence_parallel: Optional[object] = None
    check_exact: Optional[object] = None

    @classmethod
    def from_options(cls, options: Optional[dict]) -> "DualKVConfig":
        options = dict(options or {})
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(options) - names)
        if unknown:
            raise ValueError(f"options: unknown dualkv option(s) {unknown}; expected some of {sorted(names)}")
        cfg = cls(**options)

        def bad(name: str, expected: str):
            return ValueError(f"options[{name!r}] must be {expected}, got {getattr(cfg, name)!r}")

        def is_int(x) -> bool:
            return isinstance(x, int) and not isinstance(x, bool)

        # rho is valid tokens per packed token, never below 1: a min_rho below 1 means nothing.
        rho = cfg.min_rho
        if not isinstance(rho, numbers.Real) or isinstance(rho, bool) or not rho >= 1.0:
            raise bad("min_rho", "a number >= 1.0 (rho, the token reduction, is always >= 1)")
        if cfg.group_size is not None and not (is_int(cfg.group_size) and cfg.group_size >= 1):
            raise bad("group_size", "None or a positive int")
        if not (is_int(cfg.min_shared) and cfg.min_shared >= 1):
            raise bad("min_shared", "an int >= 1")
        if not isinstance(cfg.inner, str) or cfg.inner not in ("inductor", "aot_eager", "eager"):
            raise bad("inner", "'inductor', 'aot_eager' or 'eager'")
        if cfg.packed_compile not in ("direct", "nested"):
            raise bad("packed_compile", "'direct' or 'nested'")
        for name in ("verify", "chunked_log_probs"):
            if not isinstance(getattr(cfg, name), bool):
                raise bad(name, "a bool")
        from .ops.attention import BACKENDS

        if not isinstance(cfg.attention_backend, str) or cfg.attention_backend not in BACKENDS:
            raise bad("attention_backend", f"one of {', '.join(map(repr, BACKENDS))}")
        if not (is_int(cfg.verify_max_elements) and cfg.verify_max_elements >= 0):
            raise bad("verify_max_elements", "a non-negative int")
        if not (is_int(cfg.log_prob_chunk_bytes) and cfg.log_prob_chunk_bytes > 0):
            raise bad("log_prob_chunk_bytes", "a positive int")
        ce = cfg.check_exact
        if not (ce is None or ce == "first" or (is_int(ce) and ce >= 1)):
            raise bad("check_exact", "None, 'first' or a positive int N (the first packed call, then every Nth)")
        if cfg.sequence_parallel is not None:
            from .ops.sp_collectives import SPGroup

            if not isinstance(cfg.sequence_parallel, SPGroup):
                try:
                    cfg.sequence_parallel = SPGroup.of(cfg.sequence_parallel)
                except ValueError as e:
                    raise ValueError(f"options['sequence_parallel']: {e}") from None
            if cfg.sequence_parallel.world == 1:
                cfg.sequence_parallel = None
        return cfg
