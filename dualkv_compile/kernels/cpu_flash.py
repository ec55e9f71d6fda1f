"""Shared-prompt attention on CPU through PyTorch's flash-attention kernels for CPU.

Exact (the same single softmax over prompt and own tokens as the reference),
but memory O(T) per group instead of the reference's dense ``[T, T]`` mask,
and one batched kernel call per group:

    prompt     causal self-attention over its P tokens
    responses  the group's N responses padded to R_max, each query row
               attending to [prompt K/V | its own K/V] under an additive mask
               (prompt fully visible, own tokens causal)

Assumes the layout's structure (``SharedPromptLayout`` builds it): a segment
with a prefix reads exactly one earlier prefix-free segment, its group's
prompt. The backward sums each prompt token's dK/dV over the prompt's own
queries and all N responses in float32 (DESIGN.md, semantics 4); for GQA,
over the query heads sharing a KV head.
"""

from __future__ import annotations

from typing import Optional

import torch

from ..layout.segments import Segments

__all__ = ["supports", "forward", "backward"]

_fwd = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
_bwd = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward
_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def supports(q: torch.Tensor) -> Optional[str]:
    if q.device.type != "cpu":
        return f"cpu_flash runs on CPU tensors, got {q.device.type}"
    if q.dtype not in _DTYPES:
        return f"cpu_flash supports {[str(d) for d in _DTYPES]}, got {q.dtype}"
    return None


def _groups(segs: Segments) -> list[tuple[int, int, list[tuple[int, int]]]]:
    """``(prompt_start, prompt_len, [(response_start, response_len), ...])`` per group."""
    rows = zip(segs.seg_start.tolist(), segs.seg_len.tolist(), segs.prefix_start.tolist(), segs.prefix_len.tolist())
    groups: dict[int, tuple[int, int, list]] = {}
    for start, length, pstart, plen in rows:
        if plen == 0:
            groups[start] = (start, length, [])
        else:
            if pstart not in groups or groups[pstart][1] != plen:
                raise ValueError("cpu_flash: a segment's prefix must be an earlier prefix-free segment")
            groups[pstart][2].append((start, length))
    return list(groups.values())


def _repeat_heads(x: torch.Tensor, rep: int) -> torch.Tensor:
    return x if rep == 1 else x.repeat_interleave(rep, dim=1)


class _Responses:
    """The N responses of one group as a padded batch: gather/scatter between it and the packed stream."""

    def __init__(self, prompt_start: int, prompt_len: int, responses, dtype):
        self.ps, self.L, self.resp = prompt_start, prompt_len, responses
        self.N = len(responses)
        self.R = max(r for _, r in responses)
        lens = torch.tensor([r for _, r in responses])
        i = torch.arange(self.R)
        own = (i[None, None, :] <= i[None, :, None]) & (i[None, None, :] < lens[:, None, None])  # [N, Rq, Rk]
        allowed = torch.cat([torch.ones(self.N, self.R, self.L, dtype=torch.bool), own], dim=2)
        self.mask = torch.zeros(self.N, 1, self.R, self.L + self.R, dtype=dtype).masked_fill(~allowed[:, None], float("-inf"))

    def rows(self, x: torch.Tensor, fill: float = 0.0) -> torch.Tensor:
        """``[1, H, T, ...]`` -> ``[N, H, R_max, ...]``: each response's rows, padded with ``fill``."""
        out = x.new_full((self.N, x.shape[1], self.R, *x.shape[3:]), fill)
        for n, (start, r) in enumerate(self.resp):
            out[n, :, :r] = x[0, :, start : start + r]
        return out

    def keys(self, k: torch.Tensor) -> torch.Tensor:
        """``[N, H, L + R_max, D]``: the prompt's keys (or values) then each response's own."""
        prompt = k[:, :, self.ps : self.ps + self.L].expand(self.N, -1, -1, -1)
        return torch.cat([prompt, self.rows(k)], dim=2)

    def scatter_rows(self, dst: torch.Tensor, rows: torch.Tensor) -> None:
        for n, (start, r) in enumerate(self.resp):
            dst[0, :, start : start + r] = rows[n, :, :r]

    def add_keys(self, dst: torch.Tensor, grads: torch.Tensor) -> None:
        """Accumulate ``[N, H, L + R_max, D]`` key gradients into ``dst`` (prompt part summed over N)."""
        dst[0, :, self.ps : self.ps + self.L] += grads[:, :, : self.L].sum(0)
        for n, (start, r) in enumerate(self.resp):
            dst[0, :, start : start + r] += grads[n, :, self.L : self.L + r]


def forward(q, k, v, segs: Segments, scale: float):
    rep = q.shape[1] // k.shape[1]
    kr, vr = _repeat_heads(k, rep), _repeat_heads(v, rep)
    out = torch.empty_like(q)
    lse = torch.empty(q.shape[:3], dtype=torch.float32)
    for ps, L, responses in _groups(segs):
        sl = slice(ps, ps + L)
        o, l = _fwd(q[:, :, sl], kr[:, :, sl], vr[:, :, sl], 0.0, True, scale=scale)
        out[:, :, sl], lse[:, :, sl] = o, l
        if responses:
            g = _Responses(ps, L, responses, q.dtype)
            o, l = _fwd(g.rows(q), g.keys(kr), g.keys(vr), 0.0, False, attn_mask=g.mask, scale=scale)
            g.scatter_rows(out, o)
            g.scatter_rows(lse, l)
    return out, lse


def backward(dout, q, k, v, out, lse, segs: Segments, scale: float, deterministic: bool = False):
    rep = q.shape[1] // k.shape[1]
    kr, vr = _repeat_heads(k, rep), _repeat_heads(v, rep)
    dq = torch.zeros_like(q, dtype=torch.float32)
    dk = torch.zeros_like(kr, dtype=torch.float32)
    dv = torch.zeros_like(vr, dtype=torch.float32)
    lse = lse.float()
    for ps, L, responses in _groups(segs):
        sl = slice(ps, ps + L)
        gq, gk, gv = _bwd(
            dout[:, :, sl], q[:, :, sl], kr[:, :, sl], vr[:, :, sl], out[:, :, sl], lse[:, :, sl], 0.0, True, scale=scale
        )
        dq[:, :, sl] += gq.float()
        dk[:, :, sl] += gk.float()
        dv[:, :, sl] += gv.float()
        if responses:
            g = _Responses(ps, L, responses, q.dtype)
            # Padded query rows carry dO = 0 and lse = +inf (probabilities 0): they add nothing.
            gq, gk, gv = _bwd(
                g.rows(dout), g.rows(q), g.keys(kr), g.keys(vr), g.rows(out), g.rows(lse, float("inf")),
                0.0, False, attn_mask=g.mask, scale=scale,
            )
            g.scatter_rows(dq, gq.float())
            g.add_keys(dk, gk.float())
            g.add_keys(dv, gv.float())

    def per_kv_head(t):
        return t.unflatten(1, (k.shape[1], rep)).sum(2)

    return dq.to(q.dtype), per_kv_head(dk).to(k.dtype), per_kv_head(dv).to(v.dtype)
