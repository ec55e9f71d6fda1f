"""Random prefix forests through detect, pack and every attention backend that runs on a CPU (docs/design.md, semantics 10-11).

A random forest of depth 1 to 3 (one-token nodes likely) is turned into
sequences: every leaf's root path, plus some internal nodes' paths (a
sequence that ends where others go on: an empty leaf) and some duplicates.
The sequences are shuffled and laid out either as padded rows (random left
and right padding; position ids count from each sequence's start, so copies
in different columns may share) or packed several to a row (position ids
restarting; the mask marks the rows' padded ends). Every node's tokens are distinct, so the forest
detection must find is exactly the generated one:

* the packed token count equals the forest's token total;
* attention on the packed stream, unpacked, equals causal attention over each
  sequence on its own (an oracle written here), forward and the gradient of
  the token values q, k and v are read from (a shared token's copy gets the
  sum over its sequences, semantics 4), in
  float64 for the reference, cpu_flash and the Triton kernels (interpreted
  on CPU), exact to 1e-12; and in float32 for cpu_flash and Triton (on the
  GPU where there is one: its compiled kernels take no float64), to 1e-5
  (gradients 1e-4).

Slow (``make test-slow``): the same forests through tiny Hugging Face Llama
and Qwen3 models, compiled once each, called alternately on padded rows and
on one packed row (a trainer's mixed micro-batches, issue 35): logits or a
next-token loss and every parameter gradient equal the unmodified model's
(float32, 1e-5), and every call whose forest shares a node runs packed.
"""

from __future__ import annotations

import copy
import functools
import math
import random

import pytest
import torch

import dualkv_compile
from dualkv_compile.backend import dualkv_backend
from dualkv_compile.layout import detect, pack, unpack
from dualkv_compile.ops.attention import shared_prompt_attention, unsupported_reason

pytestmark = pytest.mark.usefixtures("one_thread")


def random_sequences(rng: random.Random):
    """Sequences (lists of token ids) of a random forest of depth 1-3, and the forest's token total."""
    counter = iter(range(1, 1 << 30))
    paths, total = [], 0

    def grow(prefix, depth):
        nonlocal total
        n = 1 if rng.random() < 0.3 else rng.randint(1, 9)
        node = [next(counter) for _ in range(n)]
        total += n
        path = prefix + node
        children = rng.randint(0, 3) if depth < 3 else 0
        for _ in range(children):
            grow(path, depth + 1)
        if children == 0 or rng.random() < 0.3:  # a leaf, or an internal node some sequence ends at
            paths.append(path)
            if rng.random() < 0.2:
                paths.append(list(path))  # a duplicate: an empty leaf of its twin's node
        elif children == 1:
            paths.append(path + [next(counter)])  # keep the node a branch point: a one-token leaf below it
            total += 1

    for _ in range(rng.randint(1, 3)):
        grow([], 1)
    rng.shuffle(paths)
    return paths, total


def as_padded_rows(rng, paths):
    S = max(len(p) for p in paths) + 3
    ids = torch.zeros(len(paths), S, dtype=torch.long)
    mask = torch.zeros_like(ids)
    pos = torch.zeros_like(ids)
    places = []
    for b, p in enumerate(paths):
        c = rng.randint(0, S - len(p))
        ids[b, c : c + len(p)] = torch.tensor(p)
        mask[b, c : c + len(p)] = 1
        pos[b, c : c + len(p)] = torch.arange(len(p))
        places.append((b, c))
    return ids, mask, pos, places


def as_packed_rows(rng, paths):
    rows = max(1, len(paths) // 3)
    assign = [[] for _ in range(rows)]
    for i in range(len(paths)):
        assign[rng.randrange(rows)].append(i)
    S = max(sum(len(paths[i]) for i in a) for a in assign) + 1
    ids = torch.zeros(rows, S, dtype=torch.long)
    mask = torch.zeros_like(ids)
    pos = torch.zeros_like(ids)
    places = [None] * len(paths)
    for b, a in enumerate(assign):
        c = 0
        for i in a:
            n = len(paths[i])
            ids[b, c : c + n] = torch.tensor(paths[i])
            mask[b, c : c + n] = 1
            pos[b, c : c + n] = torch.arange(n)
            places[i] = (b, c)
            c += n
    return ids, mask, pos, places


def per_sequence_attention(q, k, v, paths, places, scale):
    """Oracle: each sequence attends causally to itself alone; [B, S, H, D] in and out, zeros elsewhere."""
    out = torch.zeros_like(q)
    for p, (b, c) in zip(paths, places):
        sl = slice(c, c + len(p))
        qs, ks, vs = (t[b, sl].transpose(0, 1) for t in (q, k, v))  # [H, n, D]
        s = (qs @ ks.transpose(-1, -2)) * scale
        causal = torch.ones(len(p), len(p), dtype=torch.bool, device=q.device).tril()
        out[b, sl] = (s.masked_fill(~causal, float("-inf")).softmax(-1) @ vs).transpose(0, 1)
    return out


CASES = [("reference", torch.float64), ("cpu_flash", torch.float64), ("triton", torch.float64),
         ("cpu_flash", torch.float32), ("triton", torch.float32)]


@pytest.mark.parametrize("backend, dtype", CASES, ids=[f"{b}-{str(d)[6:]}" for b, d in CASES])
@pytest.mark.parametrize("seed", range(12))
def test_random_forest_exact(backend, dtype, seed):
    rng = random.Random(seed)
    paths, total = random_sequences(rng)
    packed_rows = seed % 2 == 1
    ids, mask, pos, places = (as_packed_rows if packed_rows else as_padded_rows)(rng, paths)
    # Without CUDA the Triton kernels run interpreted on CPU tensors (conftest); with CUDA, on the GPU.
    device = "cuda" if backend == "triton" and torch.cuda.is_available() else "cpu"
    ids, mask, pos = ids.to(device), mask.to(device), pos.to(device)
    layout = detect(ids, mask, pos, same_columns=False)
    assert layout.num_tokens == total
    assert layout.stats().num_sequences == len(paths)

    H, D = 2, 16  # 16: the smallest head dim the Triton kernels take
    g = torch.Generator().manual_seed(seed)
    # Values of the token only (every token id is one position of one node): copies agree exactly.
    table = torch.randn(3, int(ids.max()) + 1, H, D, generator=g, dtype=torch.float64).to(device)
    table.requires_grad_()
    q, k, v = (table[i][ids] for i in range(3))
    why = unsupported_reason(backend, torch.empty(1, H, 1, D, dtype=dtype, device=device))
    if why is not None and device == "cuda" and dtype == torch.float64:
        pytest.skip(why)  # only the Triton interpreter runs the kernels in float64
    assert why is None, why
    scale = 1 / math.sqrt(D)

    def to_stream(t):
        return pack(t, layout).transpose(0, 1).unsqueeze(0).to(dtype)  # [1, H, T, D]

    o = shared_prompt_attention(to_stream(q), to_stream(k), to_stream(v), layout, scale=scale, backend=backend)
    out = unpack(o[0].transpose(0, 1).double(), layout)
    expected = per_sequence_attention(q, k, v, paths, places, scale)
    tol = 1e-12 if dtype == torch.float64 else 1e-5
    valid = mask.bool()
    assert (out[valid] - expected[valid]).abs().max() <= tol * max(1.0, expected.abs().max().item())

    # The gradient of the token values: a shared token's packed copy gets the sum over its sequences.
    w = torch.randn(out.shape, generator=g, dtype=torch.float64).to(device) * valid[..., None, None]
    (got,) = torch.autograd.grad((out * w).sum(), table, retain_graph=True)
    (want,) = torch.autograd.grad((expected * w).sum(), table)
    err = (got - want).abs().max().item()
    grad_tol = tol if dtype == torch.float64 else 10 * tol  # float32: a shared token sums many rounded terms
    assert err <= grad_tol * max(1.0, want.abs().max().item()), err


# ---------------------------------------------------------------- alternating layouts through Hugging Face models
#
# Issue 35: one compiled forward or loss called on padded rows, then on one packed row, then on padded rows
# again (a trainer's mixed micro-batches). Dynamo recompiles as sizes change, and some recompiled graphs read
# their sizes off model values; each call must still pack wherever it shares, and equal the unmodified model.
# The examples run in blocks of four calls of one compiled function (family x forward or loss), padded and
# packed alternating, each block from a fresh Dynamo: what Dynamo has seen decides which sizes it makes
# dynamic, and a block from scratch meets both changes of layout (padded -> packed, packed -> padded).

ALTERNATING = 48  # examples: 12 blocks, 3 per compiled function
_COMPILED = [("llama", "model"), ("qwen3", "loss"), ("qwen3", "model"), ("llama", "loss")]
VOCAB = 101
_hf: dict = {}


def _in_vocab(paths):
    """The forest's token ids folded into the tiny models' vocabulary (equal ids only add sharing)."""
    return [[1 + (t - 1) % (VOCAB - 1) for t in p] for p in paths]


def _one_packed_row(paths):
    """Every sequence in one row, position ids restarting at each, no mask (veRL's remove-padding row)."""
    return {
        "input_ids": torch.tensor([t for p in paths for t in p])[None],
        "position_ids": torch.cat([torch.arange(len(p)) for p in paths])[None],
    }


def _right_padded(rng, paths):
    """One sequence a row from column 0, 1-3 padding columns, ids and mask only (no position ids: the model
    counts positions from column 0), as a trainer passes padded rows."""
    S = max(len(p) for p in paths) + rng.randint(1, 3)
    ids = torch.zeros(len(paths), S, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for b, p in enumerate(paths):
        ids[b, : len(p)] = torch.tensor(p)
        mask[b, : len(p)] = 1
    return {"input_ids": ids, "attention_mask": mask}


def _next_token_loss(model, batch):
    """Summed log-probs of every next token of the same sequence, in any of the layouts above."""
    logits = model(**batch).logits
    logp = torch.log_softmax(logits[:, :-1], dim=-1).gather(-1, batch["input_ids"][:, 1:, None]).squeeze(-1)
    if "position_ids" in batch:  # positions consecutive: the same sequence
        pos = batch["position_ids"]
        keep = pos[:, 1:] == pos[:, :-1] + 1
    else:  # one sequence a row: both tokens valid
        mask = batch["attention_mask"]
        keep = (mask[:, 1:] * mask[:, :-1]).bool()
    return (logp * keep).sum()


def _hf_case(family: str, path: str):
    """The model, its unmodified twin, and the compiled forward (path "model") or loss (path "loss"), made once."""
    if (family, path) not in _hf:
        from tests.helpers import hf_model  # here: tests.helpers skips the module importing it without transformers

        model = hf_model(family, "sdpa", layers=1)
        options = {"inner": "aot_eager", "min_rho": 1.0}
        if path == "model":
            fn = torch.compile(model, backend=functools.partial(dualkv_backend, options=options))
        else:
            fn = dualkv_compile.policy_loss(_next_token_loss, **options)
        _hf[(family, path)] = (model, copy.deepcopy(model), fn)
    return _hf[(family, path)]


@pytest.fixture(scope="module")
def alternating_dynamo():
    torch._dynamo.reset()
    with torch._dynamo.config.patch(cache_size_limit=64, accumulated_cache_size_limit=512):
        yield
    _hf.clear()
    torch._dynamo.reset()


def _rel(a, b):
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


@pytest.mark.slow
@pytest.mark.usefixtures("alternating_dynamo")
@pytest.mark.parametrize("example", range(ALTERNATING))
def test_alternating_layouts_pack_and_are_exact(example):
    pytest.importorskip("transformers")
    rng = random.Random(1000 + example)
    paths, total = random_sequences(rng)
    shares = total < sum(len(p) for p in paths)  # by construction: some node is read by two sequences
    paths = _in_vocab(paths)
    family, path = _COMPILED[example // 4 % len(_COMPILED)]
    if example % 4 == 0:
        torch._dynamo.reset()  # a block starts from a fresh Dynamo (see above)
    if example % 2 == 0:
        if rng.random() < 0.5:  # shuffled rows from column 0, without position ids
            batch = _right_padded(rng, paths)
        else:  # rows at random columns, position ids from each sequence's start
            ids, mask, pos, _ = as_padded_rows(rng, paths)
            batch = {"input_ids": ids, "attention_mask": mask, "position_ids": pos}
        valid = batch["attention_mask"].bool()
    else:
        batch = _one_packed_row(paths)
        valid = torch.ones(batch["input_ids"].shape, dtype=torch.bool)
    model, ref, fn = _hf_case(family, path)
    before = [(r.calls, r.packed_calls) for r in dualkv_compile.reports()]
    if path == "model":
        got, want = fn(**batch).logits, ref(**batch).logits
        assert _rel(got[valid], want[valid]) <= 1e-5
        proj = torch.randn(VOCAB, generator=torch.Generator().manual_seed(example))
        got, want = got[valid] @ proj, want[valid] @ proj
    else:
        got, want = fn(model, batch), _next_token_loss(ref, batch)
        assert _rel(got.detach(), want.detach()) <= 1e-5
    got.sum().backward()
    want.sum().backward()
    # A gradient that is zero in exact arithmetic (q_proj's when every query sees one key: a lone one-token
    # sequence) is float32 rounding noise on either side: it is compared with the largest gradient too.
    floor = 1e-6 * max(q.grad.norm().item() for q in ref.parameters())
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        err = (p.grad - q.grad).norm().item()
        assert err <= 1e-5 * q.grad.norm().item() or err <= floor, (name, _rel(p.grad, q.grad), err, floor)
    model.zero_grad(set_to_none=True)
    ref.zero_grad(set_to_none=True)
    if shares:
        after = dualkv_compile.reports()
        new = after[len(before):]
        assert all(r.rewritten for r in new), [str(r) for r in new]  # a refused graph counts no calls
        calls = sum(r.calls for r in after) - sum(c for c, _ in before)
        packed = sum(r.packed_calls for r in after) - sum(p for _, p in before)
        assert calls >= 1 and packed == calls, [str(r) for r in after]
