"""Random prefix forests through detect, pack and every attention backend that runs on a CPU (DESIGN.md, semantics 10-11).

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
"""

from __future__ import annotations

import math
import random

import pytest
import torch

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
