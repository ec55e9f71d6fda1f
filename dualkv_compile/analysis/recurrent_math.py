"""Analysis: whether a recurrent layer's ``impl`` still computes what its forest form computes.

``analysis.recurrent_rules`` packs a recurrent op only for an ``impl`` it names (transformers' torch fallbacks);
a later transformers release could keep a name and change the math (another gate, a scale, a clamp), and the
forest form would then be silently wrong. ``math_agrees(impl)`` runs ``impl`` once per process on a small random
forest, each root-to-leaf sequence alone on the host from a zero state, and compares it with the forest
reference (``kernels.recurrent``) on the packed stream (a kernel library's function on CUDA, where it runs).
Guarantees: True only where every token's output agrees within float32 rounding (the tolerances below); an ``impl`` that raises, returns another shape, or that no
probe here knows is False (logged), so its layer stays unpacked. The probe never runs on the user's tensors.
"""

from __future__ import annotations

import functools
import logging

import torch
import torch.nn.functional as F

from ..layout.segments import tree_segments

log = logging.getLogger("dualkv_compile")

__all__ = ["math_agrees"]

_LENS, _PARENTS = [5, 3, 6, 2], [-1, 0, 0, 2]  # a root, two children, a grandchild: 3 sequences, chunks of 4 cross them
_RTOL = 1e-4
# A kernel library's on CUDA: its tiles multiply in TF32 (float32 inputs, 10-bit mantissas): fla 0.6 on Hopper
# is 4.1e-4 off at most on the probe, outputs up to 0.33 (docs/benchmarks.md, "flash-linear-attention"). The
# probe still separates a changed gate, scale or normalisation, which move outputs by O(0.1).
_KERNEL_TOL = 5e-3


def _paths() -> list[list[int]]:
    """Each root-to-leaf sequence as the packed positions it runs through."""
    starts = [sum(_LENS[:i]) for i in range(len(_LENS))]
    leaves = [i for i in range(len(_LENS)) if i not in _PARENTS]
    paths = []
    for leaf in leaves:
        chain, s = [], leaf
        while s >= 0:
            chain.insert(0, s)
            s = _PARENTS[s]
        paths.append([t for s in chain for t in range(starts[s], starts[s] + _LENS[s])])
    return paths


def _gated_delta_probe(impl_fn, grouped: bool, per_channel: bool = False, kernel: bool = False):
    """A kernel library's (``kernel``) runs on CUDA where there is one, heads of 16 (its tiles' least), called
    without ``chunk_size`` as transformers' hub wrapper calls it."""
    from ..kernels.recurrent import forest_gated_delta_rule

    g = torch.Generator().manual_seed(0)
    T, Hk, Hv, D = sum(_LENS), (1 if grouped else 2), 2, (16 if kernel else 4)
    q, k = (torch.randn(1, T, Hk, D, generator=g) for _ in range(2))
    v = torch.randn(1, T, Hv, D, generator=g)
    decay = -F.softplus(torch.randn(1, T, Hv, *((D,) if per_channel else ()), generator=g))
    beta = torch.rand(1, T, Hv, generator=g)
    segs = tree_segments(_LENS, _PARENTS)
    packed = forest_gated_delta_rule(q, k, v, decay, beta, segs, use_qk_l2norm=True, chunk_size=4)
    device = "cuda" if kernel and torch.cuda.is_available() else "cpu"
    chunk = {} if kernel else {"chunk_size": 4}

    def alone(path):
        xs = [t[:, path].to(device) for t in (q, k, v, decay, beta)]
        out = impl_fn(*xs, initial_state=None, output_final_state=False, use_qk_l2norm_in_kernel=True, **chunk)[0]
        return out.cpu()

    return packed, alone


def _mamba2_probe(impl_fn, grouped: bool):
    from ..kernels.recurrent import forest_mamba2_scan

    g = torch.Generator().manual_seed(0)
    T, H, P, G, N = sum(_LENS), 2, 3, 1, 4
    x = torch.randn(1, T, H, P, generator=g)
    dt = torch.randn(1, T, H, generator=g)
    A = -torch.rand(H, generator=g) - 0.5
    B, C = (torch.randn(1, T, G, N, generator=g) for _ in range(2))
    D, dt_bias = torch.randn(H, generator=g), torch.randn(H, generator=g)
    limit = (0.0, float("inf"))
    segs = tree_segments(_LENS, _PARENTS)
    packed = forest_mamba2_scan(x, dt, A, B, C, segs, D=D, dt_bias=dt_bias, dt_softplus=True, dt_limit=limit,
                                chunk_size=4)

    def alone(path):
        return impl_fn(x[:, path], dt[:, path], A, B[:, path], C[:, path], chunk_size=4, D=D, dt_bias=dt_bias,
                       dt_softplus=True, dt_limit=limit)

    return packed, alone


def _mamba1_probe(impl_fn, grouped: bool):
    from ..kernels.recurrent import forest_selective_scan

    g = torch.Generator().manual_seed(0)
    T, Dc, N = sum(_LENS), 3, 4
    x, dt, z = (torch.randn(1, Dc, T, generator=g) for _ in range(3))
    A = -torch.rand(Dc, N, generator=g) - 0.5
    B, C = (torch.randn(1, N, T, generator=g) for _ in range(2))
    D, bias = torch.randn(Dc, generator=g), torch.randn(Dc, generator=g)
    segs = tree_segments(_LENS, _PARENTS)
    packed = forest_selective_scan(x, dt, A, B, C, segs, D=D, z=z, delta_bias=bias, delta_softplus=True)

    def alone(path):
        return impl_fn(x[..., path], dt[..., path], A, B[..., path], C[..., path], D=D, z=z[..., path],
                       delta_bias=bias, delta_softplus=True)

    return packed.transpose(1, 2), lambda path: alone(path).transpose(1, 2)  # token axis second, as the others


_PROBES = {"torch_chunk_gated_delta_rule": _gated_delta_probe, "mamba2_chunk_scan": _mamba2_probe,
           "chunk_gated_delta_rule": functools.partial(_gated_delta_probe, kernel=True),
           "chunk_kda": functools.partial(_gated_delta_probe, per_channel=True, kernel=True),
           "chunk_kimi_delta_attention": functools.partial(_gated_delta_probe, per_channel=True),
           "mamba_selective_scan": _mamba1_probe}


@functools.lru_cache(maxsize=None)
def math_agrees(impl: str, grouped: bool = False) -> bool:
    """Whether ``impl`` (``"module.function"``) agrees with its forest form on the probe forest (module docstring).

    ``grouped``: a gated delta rule's q and k with fewer heads than v (transformers 5.24's fallback repeats them;
    5.17's takes equal heads only, its layer repeating them first): probed on its own, so that an impl without
    grouped heads still packs its layers' equal-head calls."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    from ..ops.recurrent import resolve_impl

    probe = _PROBES.get(impl.rpartition(".")[2])
    if probe is None:
        log.warning("dualkv: no forest probe for %s: its layers stay unpacked", impl)
        return False
    try:
        with unset_fake_temporarily(), torch.no_grad():
            packed, alone = probe(resolve_impl(impl), grouped)
            tol = _RTOL if impl.startswith("transformers.") else _KERNEL_TOL
            for path in _paths():
                out = alone(path)
                want = packed[:, path].to(out.dtype)
                if out.shape != want.shape or not torch.allclose(out, want, rtol=tol, atol=tol):
                    log.warning("dualkv: %s no longer computes its forest form's math: its layers stay unpacked", impl)
                    return False
    except Exception as e:  # a changed signature or contract: unpacked, never guessed
        log.warning("dualkv: the forest probe of %s failed (%s): its layers stay unpacked", impl, e)
        return False
    return True
