"""The per-sequence oracle of windowed attention with sinks, shared by the kernel tests of every backend.

Every root-to-leaf path of a prefix forest is one sequence, attended on its own in float64 under autograd,
written from the definitions (docs/design.md, semantics 15) and nothing of the package: query i of a path sees key
j <= i with i - j < window (0: any) and i // chunk == j // chunk (0: any); a sink is one more logit per head
concatenated to every row's scores, its column dropped after the softmax (gpt-oss's eager attention). A
token shared by several paths takes its output from the first and its dO once (the packed loss).
"""

from __future__ import annotations

import math
import random

import torch

from segments import random_forest  # tests/kernels is on sys.path

__all__ = ["paths", "oracle", "inputs", "windowed_forest", "rel", "VARIANTS"]

# (window, chunk): sliding windows that bind (2, 5), chunks that bind (4), both, and none.
VARIANTS = [(0, 0), (2, 0), (5, 0), (0, 4), (3, 4)]


def paths(lens, parents):
    starts = [sum(lens[:i]) for i in range(len(lens))]
    leaves = set(range(len(lens))) - {p for p in parents if p >= 0}
    out = []
    for leaf in sorted(leaves):
        chain, i = [], leaf
        while i != -1:
            chain.append(i)
            i = parents[i]
        out.append([t for j in reversed(chain) for t in range(starts[j], starts[j] + lens[j])])
    return [p for p in out if p]


def _allowed(n: int, window: int, chunk: int) -> torch.Tensor:
    i = torch.arange(n)
    ok = i[None, :] <= i[:, None]
    if window:
        ok &= (i[:, None] - i[None, :]) < window
    if chunk:
        ok &= (i[:, None] // chunk) == (i[None, :] // chunk)
    return ok


def oracle(q, k, v, dout, lens, parents, scale, window=0, chunk=0, sinks=None, softcap=0.0):
    """``(out, dq, dk, dv, dsinks or None)`` of the packed stream (float64, autograd)."""
    qg, kg, vg = (t.detach().double().requires_grad_() for t in (q, k, v))
    sg = None if sinks is None else sinks.detach().double().requires_grad_()
    T, groups = q.shape[2], q.shape[1] // k.shape[1]
    out = torch.zeros(1, q.shape[1], T, v.shape[-1], dtype=torch.float64)
    owner = torch.full((T,), -1)
    loss = 0.0
    for n, path in enumerate(paths(lens, parents)):
        idx = torch.tensor(path)
        owner[idx[owner[idx] < 0]] = n
        kk = kg[0][:, idx].repeat_interleave(groups, 0)
        s = (qg[0][:, idx] @ kk.transpose(-1, -2)) * scale
        if softcap:
            s = softcap * torch.tanh(s / softcap)
        s = s.masked_fill(~_allowed(len(path), window, chunk), -math.inf)
        if sg is not None:
            s = torch.cat([s, sg[:, None, None].expand(-1, len(path), 1)], dim=-1)
        p = torch.softmax(s, -1)
        if sg is not None:
            p = p[..., :-1]
        o = p @ vg[0][:, idx].repeat_interleave(groups, 0)
        out[0][:, idx] = o.detach()
        loss = loss + (o * dout[0][:, idx].double() * (owner[idx] == n)[None, :, None]).sum()
    wrt = (qg, kg, vg) + ((sg,) if sg is not None else ())
    grads = torch.autograd.grad(loss, wrt)
    return (out, *grads[:3], grads[3] if sg is not None else None)


def inputs(T, D, Dv, seed, hq=4, hkv=2, dtype=torch.float64):
    """q, k, v, dO and sinks (float64 on the CPU; cast by the caller): scores of a few units."""
    g = torch.Generator().manual_seed(seed)
    q, k = (torch.randn(1, h, T, D, generator=g, dtype=torch.float64) for h in (hq, hkv))
    v = torch.randn(1, hkv, T, Dv, generator=g, dtype=torch.float64)
    dout = torch.randn(1, hq, T, Dv, generator=g, dtype=torch.float64)
    sinks = torch.randn(hq, generator=g, dtype=torch.float64)
    return [t.to(dtype) for t in (2 * q, k, v, dout, sinks)]


def windowed_forest(seed: int, max_len: int = 12):
    """A random forest of depth 1-3 whose nodes are long enough for the VARIANTS' windows to bind across them."""
    return random_forest(random.Random(seed), max_depth=1 + seed % 3, max_len=max_len, max_children=3)


def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()
