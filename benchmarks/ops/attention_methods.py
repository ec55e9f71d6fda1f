"""The cases and methods of ``benchmarks/ops/attention.py``: what is timed.

Cases: (N, P, R) batches of one prompt, groups of prompts with responses of
random lengths, and a system prompt over groups (a tree of two levels), with
their attention pairs before and after packing and their ``Segments``.
Methods: each ``setup_*`` builds one way of computing the attention of a case
(duplicated-batch SDPA, split SDPA, flex on the packed stream with dualkv's block
mask, plain flex with a user's mask function, the dualkv op with a backend) and returns ``(fn, leaves, douts, note)``; ``methods_for``
picks those a device runs.
"""

from __future__ import annotations

import dataclasses
import math
import random
import sys
from pathlib import Path
from typing import Callable, Optional

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


from dualkv_compile.ops import attention as dk_op  # noqa: E402
from dualkv_compile.layout.segments import Segments, tree_segments  # noqa: E402

try:  # written by another helper; the benchmark runs with or without it
    from dualkv_compile.kernels.triton import attention as triton_attention
except Exception as e:  # noqa: BLE001
    triton_attention = None
    _TRITON_IMPORT_ERROR = f"{type(e).__name__}: {e}"
else:
    _TRITON_IMPORT_ERROR = None

from benchmarks.ops.attention_timing import _free, _null  # noqa: E402


# --------------------------------------------------------------------------- cases


@dataclasses.dataclass
class Case:
    name: str
    groups: list  # [(P, [R_0, R_1, ...]), ...]
    system: int = 0  # a system prompt shared by every group: a tree of two levels above the responses

    @property
    def num_tokens(self) -> int:
        return self.system + sum(P + sum(Rs) for P, Rs in self.groups)

    @property
    def rows(self) -> list[int]:
        return [self.system + P + R for P, Rs in self.groups for R in Rs]

    @property
    def pairs_before(self) -> int:
        return sum(n * (n + 1) // 2 for n in self.rows)

    @property
    def pairs_after(self) -> int:
        Y = self.system
        return Y * (Y + 1) // 2 + sum(
            Y * P + P * (P + 1) // 2 + sum((Y + P) * R + R * (R + 1) // 2 for R in Rs) for P, Rs in self.groups
        )

    @property
    def ideal_ratio(self) -> float:
        return self.pairs_before / self.pairs_after

    def summary(self) -> dict:
        Ps = sorted({P for P, _ in self.groups})
        Rs = [R for _, rs in self.groups for R in rs]
        return dict(
            case=self.name,
            system=self.system,
            groups=len(self.groups),
            N=len(Rs),
            P=Ps[0] if len(Ps) == 1 else Ps,
            R=Rs[0] if len(set(Rs)) == 1 else f"{min(Rs)}..{max(Rs)}",
            T=self.num_tokens,
            pairs_before=self.pairs_before,
            pairs_after=self.pairs_after,
            ideal_ratio=round(self.ideal_ratio, 3),
        )


def uniform_case(N: int, P: int, R: int) -> Case:
    return Case(f"N{N}_P{P}_R{R}", [(P, [R] * N)])


def groups_case(num_groups=4, N=8, P=4096, lo=128, hi=2048, seed=0) -> Case:
    rng = random.Random(seed)
    return Case(f"groups{num_groups}_N{N}_P{P}_R{lo}-{hi}", [(P, [rng.randint(lo, hi) for _ in range(N)]) for _ in range(num_groups)])


def tree_case(system=4096, num_groups=4, N=8, P=2048, R=1024) -> Case:
    """A system prompt shared by ``num_groups`` groups of a ``P``-token prompt and ``N`` responses of ``R``."""
    return Case(f"tree_sys{system}_{num_groups}x(P{P}_N{N}_R{R})", [(P, [R] * N) for _ in range(num_groups)], system)


def forest(case: Case) -> tuple[list[int], list[int]]:
    """The case's segment lengths and parents, in pre-order: the system prompt (if any) a root, each group's
    prompt its child (or a root), the responses the prompt's children."""
    lens, parents = [], []
    root = -1
    if case.system:
        lens.append(case.system)
        parents.append(-1)
        root = 0
    for P, Rs in case.groups:
        prompt = len(lens)
        lens.append(P)
        parents.append(root)
        lens.extend(Rs)
        parents.extend([prompt] * len(Rs))
    return lens, parents


def segments(case: Case, device) -> Segments:
    return tree_segments(*forest(case), device)


# --------------------------------------------------------------------------- methods
# Each setup returns (fn, leaves, douts, note): fn() -> list of outputs; leaves
# are the tensors the backward differentiates; douts match fn's outputs.


@dataclasses.dataclass
class Cfg:
    hq: int
    hkv: int
    d: int
    dtype: torch.dtype
    device: torch.device

    @property
    def scale(self) -> float:
        return 1.0 / math.sqrt(self.d)


def _randn(cfg: Cfg, *shape) -> torch.Tensor:
    return torch.randn(*shape, device=cfg.device, dtype=cfg.dtype)


def _packed(case: Case, cfg: Cfg):
    T = case.num_tokens
    return [_randn(cfg, 1, h, T, cfg.d).requires_grad_() for h in (cfg.hq, cfg.hkv, cfg.hkv)]


def _dup_inputs(case: Case, cfg: Cfg, kv_heads: int):
    """The duplicated batch: one row per response, right-padded to the longest row."""
    B, S = len(case.rows), max(case.rows)
    q = _randn(cfg, B, cfg.hq, S, cfg.d).requires_grad_()
    k = _randn(cfg, B, kv_heads, S, cfg.d).requires_grad_()
    v = _randn(cfg, B, kv_heads, S, cfg.d).requires_grad_()
    return q, k, v


def setup_sdpa_dup(case: Case, cfg: Cfg, backend: Optional[str]):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    kinds = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION}
    note = ""
    for expand in (False, True):
        q, k, v = _dup_inputs(case, cfg, cfg.hq if expand else cfg.hkv)

        def fn(q=q, k=k, v=v, expand=expand):
            ctx = sdpa_kernel(kinds[backend]) if backend else _null()
            with ctx:
                return [F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=cfg.scale, enable_gqa=not expand)]

        try:
            with torch.no_grad():
                fn()
            break
        except RuntimeError as e:
            if expand or "out of memory" in str(e):
                raise
            note = f"GQA refused ({str(e).splitlines()[0][:80]}); K/V materialised with Hq heads"
            q = k = v = fn = None  # fn's defaults hold the tensors too
            _free()
    return fn, [q, k, v], None, note


def setup_varlen_dup(case: Case, cfg: Cfg):
    """The duplicated batch as the strongest baseline runs it: every row's tokens back to back in one varlen call
    (tokens first, ``[T_dup, H, D]``), causal within each row, no padding computed; the kernel is
    ``varlen_attention``'s (torch's ``varlen_attn`` or FlashAttention-4, ``varlen_attention.kernel()``)."""
    from benchmarks.ops import varlen_attention

    rows = case.rows
    q, k, v = (_randn(cfg, sum(rows), h, cfg.d).requires_grad_() for h in (cfg.hq, cfg.hkv, cfg.hkv))
    cu = torch.tensor([0] + rows, dtype=torch.int32, device=cfg.device).cumsum(0, dtype=torch.int32)

    def fn():
        return [varlen_attention._varlen_cuda(q, k, v, cu, max(rows), cfg.scale)]

    return fn, [q, k, v], None, f"kernel: {varlen_attention.kernel_name()}"


def setup_split_sdpa(case: Case, cfg: Cfg):
    """Prompt causal, then each group's responses (right-padded) over [prompt K/V, own K/V], lower-right causal."""
    from torch.nn.attention.bias import causal_lower_right

    if case.system:
        raise NotImplementedError("split_sdpa (PrefixGrouper's two regions) has no tree: one prompt per group only")

    leaves, parts = [], []
    for P, Rs in case.groups:
        Rmax = max(Rs)
        qp, kp, vp = (_randn(cfg, 1, h, P, cfg.d).requires_grad_() for h in (cfg.hq, cfg.hkv, cfg.hkv))
        qr = _randn(cfg, len(Rs), cfg.hq, Rmax, cfg.d).requires_grad_()
        kr, vr = (_randn(cfg, len(Rs), cfg.hkv, Rmax, cfg.d).requires_grad_() for _ in range(2))
        leaves += [qp, kp, vp, qr, kr, vr]
        parts.append((P, Rmax, qp, kp, vp, qr, kr, vr))
    state = {"expand": False}

    def fn():
        outs = []
        for P, Rmax, qp, kp, vp, qr, kr, vr in parts:
            outs.append(F.scaled_dot_product_attention(qp, kp, vp, is_causal=True, scale=cfg.scale, enable_gqa=True))
            n = qr.shape[0]
            k = torch.cat([kp.expand(n, -1, -1, -1), kr], dim=2)
            v = torch.cat([vp.expand(n, -1, -1, -1), vr], dim=2)
            if state["expand"]:
                g = cfg.hq // cfg.hkv
                k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
            bias = causal_lower_right(Rmax, P + Rmax)
            outs.append(F.scaled_dot_product_attention(qr, k, v, attn_mask=bias, scale=cfg.scale, enable_gqa=not state["expand"]))
        return outs

    note = ""
    try:
        with torch.no_grad():
            fn()
    except RuntimeError as e:
        if "out of memory" in str(e):
            raise
        state["expand"] = True
        note = f"GQA refused with the lower-right bias ({str(e).splitlines()[0][:80]}); K/V expanded per call"
    return fn, leaves, None, note


def setup_flex_packed(case: Case, cfg: Cfg):
    from dualkv_compile.ops import flex

    q, k, v = _packed(case, cfg)
    segs = segments(case, cfg.device)
    bm = flex.block_mask(segs, case.num_tokens)
    compiled = flex.compiled_flex()

    def fn():
        return [compiled(q, k, v, block_mask=bm, scale=cfg.scale, enable_gqa=cfg.hq != cfg.hkv)]

    return fn, [q, k, v], None, "BlockMask prebuilt (outside timing)"


def user_forest_mask_mod(case: Case, device):
    """The mask a user would write for the case's prefix forest, as FlexAttention's docs teach: a document id
    per packed token and an ancestor table; a key is visible when it is at or before the query and in the
    query's segment or one of its ancestors. No dualkv code: only the case's tree (``forest``)."""
    seg_len, parent = forest(case)
    n = len(seg_len)
    doc = torch.repeat_interleave(torch.arange(n), torch.tensor(seg_len)).to(device)
    ancestor = torch.zeros(n, n, dtype=torch.bool)
    for i in range(n):
        a = parent[i]
        while a >= 0:
            ancestor[i, a] = True
            a = parent[a]
    ancestor = ancestor.to(device)

    def mask_mod(b, h, q_idx, kv_idx):
        same = doc[q_idx] == doc[kv_idx]
        return (kv_idx <= q_idx) & (same | ancestor[doc[q_idx], doc[kv_idx]])

    return mask_mod


def setup_flex_user(case: Case, cfg: Cfg):
    """Plain FlexAttention as a user writes it: ``create_block_mask`` of ``user_forest_mask_mod`` with its
    defaults and ``torch.compile(flex_attention)`` with no kernel options."""
    import time

    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    q, k, v = _packed(case, cfg)
    T = case.num_tokens
    t0 = time.perf_counter()
    bm = create_block_mask(user_forest_mask_mod(case, cfg.device), None, None, T, T, device=cfg.device)
    if cfg.device.type == "cuda":
        torch.cuda.synchronize()
    build_ms = (time.perf_counter() - t0) * 1e3
    compiled = torch.compile(flex_attention)

    def fn():
        return [compiled(q, k, v, block_mask=bm, scale=cfg.scale, enable_gqa=cfg.hq != cfg.hkv)]

    return fn, [q, k, v], None, f"user mask_mod, create_block_mask defaults ({build_ms:.0f} ms first build, outside timing)"


def setup_dualkv(case: Case, cfg: Cfg, backend: str):
    q, k, v = _packed(case, cfg)
    segs = segments(case, cfg.device)

    def fn():
        return [dk_op.shared_prompt_attention(q, k, v, segs, scale=cfg.scale, backend=backend)]

    return fn, [q, k, v], None, ""


def setup_dualkv_flex_op(case: Case, cfg: Cfg):
    q, k, v = _packed(case, cfg)
    segs = segments(case, cfg.device)

    def fn():
        return [dk_op.attention_fwd(q, k, v, *segs, cfg.scale, 0.0, "flex")[0]]

    return fn, [q, k, v], None, "opaque custom op; backward recomputes the forward"


def methods_for(cfg: Cfg) -> dict[str, Callable]:
    if cfg.device.type == "cpu":
        return {
            "sdpa_dup": lambda c, g: setup_sdpa_dup(c, g, None),
            "split_sdpa": setup_split_sdpa,
            "dualkv_reference": lambda c, g: setup_dualkv(c, g, "reference"),
        }
    m = {
        "sdpa_flash_dup": lambda c, g: setup_sdpa_dup(c, g, "flash"),
        "sdpa_cudnn_dup": lambda c, g: setup_sdpa_dup(c, g, "cudnn"),
        "varlen_dup": setup_varlen_dup,
        "flex_packed": setup_flex_packed,
        "flex_user": setup_flex_user,
        "split_sdpa": setup_split_sdpa,
        "dualkv_flex": lambda c, g: setup_dualkv(c, g, "flex"),
        "dualkv_flex_op": setup_dualkv_flex_op,
    }
    if triton_attention is not None:
        m["dualkv_triton"] = lambda c, g: setup_dualkv(c, g, "triton")
        m["dualkv_gluon"] = lambda c, g: setup_dualkv(c, g, "gluon")
    return m


def triton_skip_reason(cfg: Cfg, backend: str = "triton") -> Optional[str]:
    if triton_attention is None:
        return f"dualkv_compile.kernels.triton.attention not importable ({_TRITON_IMPORT_ERROR})"
    probe = torch.empty(1, cfg.hq, 256, cfg.d, device=cfg.device, dtype=cfg.dtype)
    return dk_op.unsupported_reason(backend, probe)
