"""Prefix-forest attention on CPU through PyTorch's flash-attention kernels for CPU.

Exact (the reference's single softmax over ancestor and own tokens) in memory O(T) per batch instead of the
reference's dense ``[T, T]`` mask, with one kernel call per root and per sibling set:

    roots      causal self-attention over the root's tokens
    children   the children of one parent (siblings: the same ancestor chain) padded to R_max, each query row
               attending to [ancestor chain K/V | its own K/V] under an additive mask (chain visible, own causal)

Assumes ``Segments`` in pre-order (``layout.segments``); the chain's keys are gathered in root-to-parent order
(any order gives the same softmax). The backward sums each ancestor token's dK/dV over every sibling batch that
reads it, and for GQA over the query heads sharing a KV head, in float32, float64 for float64 inputs
(docs/design.md, semantics 4); the lse is float32 too (float64 for float64 inputs, which the CPU flash kernels
take and compute in). A logit softcap (the flash kernels take no score modifier) runs the same batches through
explicit scores (``reference``'s masked attention and backward): exact, memory O(R * (L + R)) per batch. MLA head
dims are zero-padded to one (``head_dims``; exact), except on the softcap path. Windows (``window``, ``chunk``:
token depth) give a root's call the windowed causal mask and narrow a sibling batch's mask by depth (the chain's
keys are depths ``0 .. L-1``, a child's own token ``i`` is depth ``L + i``). The backward reads the saved
``out`` and ``lse``, so sinks compose (``kernels.sinks``).
"""

from __future__ import annotations

from typing import Optional

import torch

from ..layout.segments import Segments, check_window, window_allows
from .head_dims import common_head_dim, pad_head_dim
from .reference import attention_with_mask, backward_with_mask

__all__ = ["supports", "forward", "backward"]

_fwd = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
_bwd = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward
_DTYPES = (torch.float64, torch.float32, torch.bfloat16, torch.float16)


def _acc(dtype: torch.dtype) -> torch.dtype:
    """The dtype of the log-sum-exp and the gradient sums: float64 for float64, else float32."""
    return torch.promote_types(dtype, torch.float32)


def supports(q: torch.Tensor, v: Optional[torch.Tensor] = None, *, window: int = 0, chunk: int = 0,
             sinks: bool = False, softcap: float = 0.0) -> Optional[str]:
    if q.device.type != "cpu":
        return f"cpu_flash runs on CPU tensors, got {q.device.type}"
    if q.dtype not in _DTYPES:
        return f"cpu_flash supports {[str(d) for d in _DTYPES]}, got {q.dtype}"
    return None


def _batches(segs: Segments) -> tuple[list[tuple[int, int]], list[tuple[torch.Tensor, list[tuple[int, int]]]]]:
    """The roots ``[(start, len)]`` and the sibling batches ``[(chain token indices, [(start, len), ...])]``.

    Empty segments have no queries and are left out of both (their children
    still get a batch; their empty run adds nothing to the chain). Chains are
    kept as runs (one per ancestor) until a batch needs its index tensor.
    """
    start, length, parent = segs.seg_start.tolist(), segs.seg_len.tolist(), segs.parent.tolist()
    runs: list[list[tuple[int, int]]] = []  # per segment: the (start, len) runs of its ancestors and itself
    children: dict[int, list[tuple[int, int]]] = {}
    roots = []
    for i, (s, n, p) in enumerate(zip(start, length, parent)):
        if p >= i or p < -1:
            raise ValueError(f"cpu_flash: segments must be in pre-order with parent < index, got parent[{i}] = {p}")
        runs.append((runs[p] if p >= 0 else []) + [(s, n)])
        if n == 0:
            continue
        if p < 0:
            roots.append((s, n))
        else:
            children.setdefault(p, []).append((s, n))

    def chain(p: int) -> torch.Tensor:
        return torch.cat([torch.arange(s, s + n) for s, n in runs[p]])

    return roots, [(chain(p), kids) for p, kids in children.items()]


def _repeat_heads(x: torch.Tensor, rep: int) -> torch.Tensor:
    return x if rep == 1 else x.repeat_interleave(rep, dim=1)


class _Siblings:
    """The children of one parent as a padded batch: gather/scatter between it and the packed stream."""

    def __init__(self, chain: torch.Tensor, kids: list[tuple[int, int]], dtype, window: int = 0, chunk: int = 0):
        self.chain, self.kids = chain, kids
        self.L = chain.numel()
        self.N = len(kids)
        self.R = max(r for _, r in kids)
        lens = torch.tensor([r for _, r in kids])
        i = torch.arange(self.R)
        own = (i[None, None, :] <= i[None, :, None]) & (i[None, None, :] < lens[:, None, None])  # [N, Rq, Rk]
        allowed = torch.cat([torch.ones(self.N, self.R, self.L, dtype=torch.bool), own], dim=2)
        if window or chunk:  # depths: the chain's keys 0 .. L-1, a child's own token i at L + i
            depth = torch.arange(self.L + self.R)
            allowed = allowed & window_allows(depth[self.L:, None], depth[None, :], window, chunk)
        self.allowed = allowed[:, None]  # [N, 1, R, L + R]
        self.mask = _additive(self.allowed, dtype)

    def rows(self, x: torch.Tensor, fill: float = 0.0) -> torch.Tensor:
        """``[1, H, T, ...]`` -> ``[N, H, R_max, ...]``: each child's rows, padded with ``fill``."""
        out = x.new_full((self.N, x.shape[1], self.R, *x.shape[3:]), fill)
        for n, (start, r) in enumerate(self.kids):
            out[n, :, :r] = x[0, :, start : start + r]
        return out

    def keys(self, k: torch.Tensor) -> torch.Tensor:
        """``[N, H, L + R_max, D]``: the ancestor chain's keys (or values) then each child's own."""
        chain = k[:, :, self.chain].expand(self.N, -1, -1, -1)
        return torch.cat([chain, self.rows(k)], dim=2)

    def scatter_rows(self, dst: torch.Tensor, rows: torch.Tensor) -> None:
        for n, (start, r) in enumerate(self.kids):
            dst[0, :, start : start + r] = rows[n, :, :r]

    def add_keys(self, dst: torch.Tensor, grads: torch.Tensor) -> None:
        """Accumulate ``[N, H, L + R_max, D]`` key gradients into ``dst`` (the chain's part summed over N)."""
        dst[0].index_add_(1, self.chain, grads[:, :, : self.L].sum(0))
        for n, (start, r) in enumerate(self.kids):
            dst[0, :, start : start + r] += grads[n, :, self.L : self.L + r]


def _causal(n: int, window: int = 0, chunk: int = 0) -> torch.Tensor:
    """A root's mask: causal, narrowed by the windows (a root token's depth is its index)."""
    i = torch.arange(n)
    mask = i[None, :] <= i[:, None]
    return mask & window_allows(i[:, None], i[None, :], window, chunk) if window or chunk else mask


def _additive(allowed: torch.Tensor, dtype) -> torch.Tensor:
    return torch.zeros(allowed.shape, dtype=dtype).masked_fill(~allowed, float("-inf"))


def forward(q, k, v, segs: Segments, scale: float, softcap: float = 0.0, window: int = 0, chunk: int = 0):
    check_window(window, chunk)
    Dv, D = v.shape[-1], common_head_dim(q, v)
    if not softcap:
        q, k, v = (pad_head_dim(t, D) for t in (q, k, v))
    rep = q.shape[1] // k.shape[1]
    kr, vr = _repeat_heads(k, rep), _repeat_heads(v, rep)
    out = q.new_empty((*q.shape[:3], v.shape[-1]))
    lse = torch.empty(q.shape[:3], dtype=_acc(q.dtype))
    if softcap:  # explicit capped scores, the same batches

        def root(sl, n):
            return attention_with_mask(q[:, :, sl], kr[:, :, sl], vr[:, :, sl], _causal(n, window, chunk), scale, softcap)

        def siblings(g):
            return attention_with_mask(g.rows(q), g.keys(kr), g.keys(vr), g.allowed, scale, softcap)
    elif window or chunk:

        def root(sl, n):
            mask = _additive(_causal(n, window, chunk), q.dtype)
            return _fwd(q[:, :, sl], kr[:, :, sl], vr[:, :, sl], 0.0, False, attn_mask=mask, scale=scale)

        def siblings(g):
            return _fwd(g.rows(q), g.keys(kr), g.keys(vr), 0.0, False, attn_mask=g.mask, scale=scale)
    else:

        def root(sl, n):
            return _fwd(q[:, :, sl], kr[:, :, sl], vr[:, :, sl], 0.0, True, scale=scale)

        def siblings(g):
            return _fwd(g.rows(q), g.keys(kr), g.keys(vr), 0.0, False, attn_mask=g.mask, scale=scale)

    roots, batches = _batches(segs)
    for s, n in roots:
        sl = slice(s, s + n)
        out[:, :, sl], lse[:, :, sl] = root(sl, n)
    for chain, kids in batches:
        g = _Siblings(chain, kids, q.dtype, window, chunk)
        o, l = siblings(g)
        g.scatter_rows(out, o)
        g.scatter_rows(lse, l)
    return out[..., :Dv], lse


def backward(dout, q, k, v, out, lse, segs: Segments, scale: float, deterministic: bool = False, softcap: float = 0.0,
             window: int = 0, chunk: int = 0):
    check_window(window, chunk)
    Dqk, Dv, D = q.shape[-1], v.shape[-1], common_head_dim(q, v)
    if not softcap:
        q, k, v, dout, out = (pad_head_dim(t, D) for t in (q, k, v, dout, out))
    rep = q.shape[1] // k.shape[1]
    kr, vr = _repeat_heads(k, rep), _repeat_heads(v, rep)
    acc = _acc(q.dtype)
    dq = torch.zeros_like(q, dtype=acc)
    dk = torch.zeros_like(kr, dtype=acc)
    dv = torch.zeros_like(vr, dtype=acc)
    lse = lse.to(acc)
    if softcap:  # explicit capped scores, recomputed; padded query rows carry dO = 0: they add nothing

        def root(sl, n):
            return backward_with_mask(dout[:, :, sl], q[:, :, sl], kr[:, :, sl], vr[:, :, sl], _causal(n, window, chunk),
                                      scale, softcap, lse=lse[:, :, sl])

        def siblings(g):
            return backward_with_mask(g.rows(dout), g.rows(q), g.keys(kr), g.keys(vr), g.allowed, scale, softcap,
                                      lse=g.rows(lse, float("inf")))
    elif window or chunk:

        def root(sl, n):
            mask = _additive(_causal(n, window, chunk), q.dtype)
            return _bwd(dout[:, :, sl], q[:, :, sl], kr[:, :, sl], vr[:, :, sl], out[:, :, sl], lse[:, :, sl], 0.0, False,
                        attn_mask=mask, scale=scale)

        def siblings(g):
            return _bwd(g.rows(dout), g.rows(q), g.keys(kr), g.keys(vr), g.rows(out), g.rows(lse, float("inf")),
                        0.0, False, attn_mask=g.mask, scale=scale)
    else:

        def root(sl, n):
            return _bwd(dout[:, :, sl], q[:, :, sl], kr[:, :, sl], vr[:, :, sl], out[:, :, sl], lse[:, :, sl], 0.0, True,
                        scale=scale)

        def siblings(g):
            # Padded query rows carry dO = 0 and lse = +inf (probabilities 0): they add nothing.
            return _bwd(g.rows(dout), g.rows(q), g.keys(kr), g.keys(vr), g.rows(out), g.rows(lse, float("inf")),
                        0.0, False, attn_mask=g.mask, scale=scale)

    roots, batches = _batches(segs)
    for s, n in roots:
        sl = slice(s, s + n)
        gq, gk, gv = root(sl, n)
        dq[:, :, sl] += gq.to(acc)
        dk[:, :, sl] += gk.to(acc)
        dv[:, :, sl] += gv.to(acc)
    for chain, kids in batches:
        g = _Siblings(chain, kids, q.dtype, window, chunk)
        gq, gk, gv = siblings(g)
        g.scatter_rows(dq, gq.to(acc))
        g.add_keys(dk, gk.to(acc))
        g.add_keys(dv, gv.to(acc))

    def per_kv_head(t):
        return t.unflatten(1, (k.shape[1], rep)).sum(2)

    return dq[..., :Dqk].to(q.dtype), per_kv_head(dk)[..., :Dqk].to(k.dtype), per_kv_head(dv)[..., :Dv].to(v.dtype)
