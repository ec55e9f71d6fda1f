"""Randomized tests of dualkv_compile.layout.detect, pack and unpack against independent oracles.

Hypothesis draws nested sequences in the layouts trainers use (right/left
padded, veRL prompt/response, packed rows), shuffled; the layout is checked
against oracles written here: a per-sequence python loop over tokens for the
sequences, a dict-of-dicts trie over the sequences' keys for the forest, and
python loops for the mask, stats, pack/unpack and unpack's backward.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dualkv_compile.layout import detect, pack, unpack

from .layout_cases import T


pytestmark = pytest.mark.usefixtures("one_thread")


@st.composite
def sequence_sets(draw, max_seqs=7, vocab=3):
    """Token sequences that nest: each new one is either fresh or a prefix of an
    earlier one (possibly all of it, possibly none) extended by a few tokens, so
    system prompts, group prompts, responses, identical sequences and sequences
    that end inside another all occur. A small vocabulary adds chance sharing."""
    seqs = []
    for _ in range(draw(st.integers(1, max_seqs))):
        if seqs and draw(st.booleans()):
            base = draw(st.sampled_from(seqs))
            base = base[: draw(st.integers(0, len(base)))]
        else:
            base = []
        seq = base + draw(st.lists(st.integers(1, vocab), max_size=3))
        seqs.append(seq or [draw(st.integers(1, vocab))])
    return seqs


@st.composite
def forest_batches(draw, vocab=3):
    """A batch of nested sequences in one of the layouts trainers use, rows shuffled.

    right  one sequence per row, right-padded (a row may be all padding)
    left   one sequence per row, left-padded
    verl   prompt (the first P tokens) left-padded to P, the rest right-padded
    packed several sequences per row, positions restarting at each (veRL remove-padding,
           TRL padding-free); one row without a mask, or right-padded rows
    Returns (input_ids, attention_mask or None, position_ids or None, same_columns).
    """
    seqs = draw(sequence_sets(vocab=vocab))
    kind = draw(st.sampled_from(["right", "left", "verl", "packed"]))
    rows, masks, poss = [], [], []  # per row: ids, mask, restarting positions
    if kind == "packed":
        n_rows = draw(st.integers(1, min(3, len(seqs))))
        cuts = sorted(draw(st.lists(st.integers(1, len(seqs) - 1), max_size=n_rows - 1, unique=True))) if len(seqs) > 1 else []
        bounds = [0] + cuts + [len(seqs)]
        for lo, hi in zip(bounds, bounds[1:]):
            row = [t for s in seqs[lo:hi] for t in s]
            rows.append(row)
            masks.append([1] * len(row))
            poss.append([p for s in seqs[lo:hi] for p in range(len(s))])
        S = max(len(r) for r in rows) + draw(st.integers(0, 1))
        for r, m, p in zip(rows, masks, poss):
            n = S - len(r)
            r += [0] * n
            m += [0] * n
            p += [0] * n
    else:
        if kind != "left" and draw(st.booleans()):
            seqs = seqs + [[]]  # a row of padding only
        P = draw(st.integers(0, 3)) if kind == "verl" else 0
        S0 = max(len(s) for s in seqs) + draw(st.integers(0, 1))
        R = max(max(len(s) - P, 0) for s in seqs) + draw(st.integers(0, 1))
        S = P + R if kind == "verl" else S0
        S = max(S, 1)
        for s in seqs:
            if kind == "right":
                lp = 0
            elif kind == "left":
                lp = S - len(s)
            else:
                lp = P - min(P, len(s))
            rp = S - lp - len(s)
            rows.append([0] * lp + s + [0] * rp)
            masks.append([0] * lp + [1] * len(s) + [0] * rp)
            poss.append([0] * lp + list(range(len(s))) + [0] * rp)
    ids, mask, hf_pos = T(rows), T(masks), T(poss)
    perm = draw(st.permutations(range(ids.shape[0])))
    ids, mask, hf_pos = ids[perm], mask[perm], hf_pos[perm]
    if draw(st.booleans()):  # pad ids are arbitrary, even real tokens
        g = torch.Generator().manual_seed(draw(st.integers(0, 2**16)))
        ids = torch.where(mask.bool(), ids, torch.randint(0, vocab + 1, ids.shape, generator=g))
    if kind == "packed":
        pos_kind = draw(st.sampled_from(["restart", "perturbed"]))
    else:
        pos_kind = draw(st.sampled_from(["none", "arange", "restart", "perturbed"]))
    if pos_kind == "none":
        pos = None
    elif pos_kind == "arange":
        pos = torch.arange(ids.shape[1]).view(1, -1)
    else:
        pos = hf_pos
        if pos_kind == "perturbed":  # some row's positions jump somewhere
            b = draw(st.integers(0, ids.shape[0] - 1))
            c = draw(st.integers(0, ids.shape[1] - 1))
            pos = pos.clone()
            pos[b, c:] += 1
    if kind == "packed" and ids.shape[0] == 1 and bool(mask.all()) and draw(st.booleans()):
        mask = None  # veRL remove-padding: one [1, total] row, no mask
    same_columns = draw(st.booleans())
    return ids, mask, pos, same_columns


def oracle_sequences(ids, mask, pos):
    """(row, start, end) of each sequence: valid runs split where the positions do not continue."""
    B, S = ids.shape
    m = torch.ones(B, S, dtype=torch.long) if mask is None else mask
    p = None if pos is None else pos.expand(B, S)
    out = []
    for b in range(B):
        start = None
        for c in range(S + 1):
            on = c < S and bool(m[b, c])
            new = on and (start is None or (p is not None and int(p[b, c]) != int(p[b, c - 1]) + 1))
            if start is not None and (not on or new):
                out.append((b, start, c))
                start = None
            if new:
                start = c
    return out


def oracle_keys(ids, pos, same_columns, b, c):
    key = [int(ids[b, c])]
    if pos is not None:
        key.append(int(pos.expand(ids.shape)[b, c]))
    if same_columns:
        key.append(c)
    return tuple(key)


class _Trie:
    """A plain trie over key tuples: one node per token, counting the sequences through it and ending at it."""

    def __init__(self):
        self.children: dict[tuple, _Trie] = {}
        self.count = 0
        self.end = 0

    def insert(self, keys):
        n = self
        for k in keys:
            n = n.children.setdefault(k, _Trie())
            n.count += 1
        n.end += 1


def trie_nodes(root: _Trie, min_shared: int) -> list[tuple[int, int]]:
    """(length, count) of each node of the packed forest, from the trie.

    Chains of trie nodes that no sequence leaves or ends in compact into one
    node; a compacted node shared by several sequences but shorter (with what
    it inherits) than ``min_shared`` is dissolved: each sequence ending there
    gets its own copy, and its children inherit its tokens."""
    out = []

    def walk(n, length, carry):
        while n.end == 0 and len(n.children) == 1:
            (n,) = n.children.values()
            length += 1
        size = carry + length
        if n.count >= 2 and size < min_shared:
            out.extend([(size, 1)] * n.end)
            for c in n.children.values():
                walk(c, 1, size)
        else:
            out.append((size, n.count))
            for c in n.children.values():
                walk(c, 1, 0)

    for c in root.children.values():
        walk(c, 1, 0)
    return out


@settings(max_examples=150, deadline=None)
@given(batch=forest_batches(), min_shared=st.integers(1, 3), data=st.data())
def test_detect_properties_against_trie_oracle(batch, min_shared, data):
    ids, mask, pos, same_columns = batch
    B, S = ids.shape
    L = detect(ids, mask, pos, min_shared=min_shared, same_columns=same_columns)
    valid = torch.ones(B, S, dtype=torch.bool) if mask is None else mask.bool()

    # Sequences: valid runs split where positions restart, in row and column order.
    seqs = oracle_sequences(ids, mask, pos)
    assert [(s.row, s.start, s.end) for s in L.sequences] == seqs
    keys = [[oracle_keys(ids, pos, same_columns, b, c) for c in range(s, e)] for b, s, e in seqs]

    # The forest: as many packed tokens (and the same nodes) as the compacted trie.
    trie = _Trie()
    for k in keys:
        trie.insert(k)
    expected = trie_nodes(trie, min_shared)
    if min_shared == 1:
        distinct = {tuple(k[:j]) for k in keys for j in range(1, len(k) + 1)}
        assert L.num_tokens == len(distinct)
    assert L.num_tokens == sum(n for n, _ in expected)
    assert sorted((n.length, n.count) for n in L.nodes) == sorted(expected)
    assert all(n.length >= min_shared for n in L.nodes if n.count > 1)

    # Paths: pre-order, offsets add up, every copy of a node holds the same keys,
    # each node read from its first sequence, children in order of first sequence.
    holders = [[] for _ in L.nodes]
    for i, (b, s, e) in enumerate(seqs):
        path = L.path(i)
        off = 0
        for n in path:
            node = L.nodes[n]
            assert node.offset == off and node.length > 0
            holders[n].append(i)
            src_b, src_c = divmod(node.source, S)
            src = [oracle_keys(ids, pos, same_columns, src_b, c) for c in range(src_c, src_c + node.length)]
            assert keys[i][off : off + node.length] == src
            off += node.length
        assert off == e - s
    packed = 0
    for n, node in enumerate(L.nodes):
        assert node.packed_start == packed
        packed += node.length
        assert node.parent < n and node.count == len(holders[n]) >= 1
        first = holders[n][0]
        assert node.source == seqs[first][0] * S + seqs[first][1] + node.offset
        assert L.pack_index[node.packed_start : node.packed_start + node.length].tolist() == list(
            range(node.source, node.source + node.length)
        )
    assert packed == L.num_tokens
    for p in {-1, *range(len(L.nodes))}:
        kids = [n for n, node in enumerate(L.nodes) if node.parent == p]
        assert [holders[n][0] for n in kids] == sorted(holders[n][0] for n in kids)

    # Segments: one per node; prefix = offset; subtree end = the end of the last descendant.
    ends = [node.packed_start + node.length for node in L.nodes]
    for n in reversed(range(len(L.nodes))):
        if L.nodes[n].parent >= 0:
            ends[L.nodes[n].parent] = max(ends[L.nodes[n].parent], ends[n])
    assert L.segments() == [(nd.packed_start, nd.length, nd.parent, nd.offset, ends[n]) for n, nd in enumerate(L.nodes)]

    # The mask, restricted to a sequence's packed tokens, is exactly causal over it;
    # and its tokens see nothing else.
    M = L.dense_mask()
    packed_of = []
    for i in range(len(seqs)):
        idx = [t for n in L.path(i) for t in range(L.nodes[n].packed_start, L.nodes[n].packed_start + L.nodes[n].length)]
        idx = torch.tensor(idx, dtype=torch.long)
        packed_of.append(idx)
        n = idx.numel()
        assert torch.equal(M[idx][:, idx], torch.ones(n, n, dtype=torch.bool).tril())
        assert M[idx].sum(1).tolist() == list(range(1, n + 1))

    # Stats, multiplicities, sequence ids and copy runs.
    s = L.stats()
    lens = [e - s_ for _, s_, e in seqs]
    assert s.tokens_before == sum(lens) == int(valid.sum())
    assert s.tokens_after == L.num_tokens and s.num_sequences == len(seqs)
    assert s.attention_pairs_before == sum(n * (n + 1) // 2 for n in lens)
    assert s.attention_pairs_after == int(M.sum())
    assert s.num_groups == sum(1 for n in L.nodes if n.parent < 0)
    assert s.depth == max((len(L.path(i)) for i in range(len(seqs))), default=0)
    mult = torch.zeros(L.num_tokens, dtype=torch.long)
    for idx in packed_of:
        mult[idx] += 1
    assert torch.equal(L.token_multiplicity(), mult)
    sid = torch.full((B * S,), -1, dtype=torch.long)
    for i, (b, s_, e) in enumerate(seqs):
        sid[b * S + s_ : b * S + e] = i
    assert torch.equal(L.sequence_ids(), sid)
    runs = L.copy_runs()
    assert sum(n for _, _, n in runs) == s.tokens_before - s.tokens_after
    for dst, src, n in runs:
        assert dst != src
        assert [oracle_keys(ids, pos, same_columns, *divmod(dst + j, S)) for j in range(n)] == [
            oracle_keys(ids, pos, same_columns, *divmod(src + j, S)) for j in range(n)
        ]

    # pack/unpack: a value that depends only on the keys comes back at valid
    # positions, zero at padding.
    g = torch.Generator().manual_seed(data.draw(st.integers(0, 2**16)))
    x = torch.randn(8, 2, generator=g, dtype=torch.float64)[ids]
    if pos is not None:
        x = x + pos.expand(B, S).unsqueeze(-1).double() * 0.125
    if same_columns:
        x = x + torch.randn(S, 2, generator=g, dtype=torch.float64)
    u = unpack(pack(x, L), L)
    assert torch.equal(u, torch.where(valid.unsqueeze(-1), x, 0.0))
    assert torch.equal(L.valid.view(B, S), valid)

    # unpack's backward: each packed token gets the sum of the gradients at
    # every position that reads it (oracle: a python loop over the paths).
    y = torch.randn(L.num_tokens, 2, generator=g, dtype=torch.float64, requires_grad=True)
    dout = torch.randn(B, S, 2, generator=g, dtype=torch.float64)
    unpack(y, L).backward(dout)
    ts, bs, cs = [], [], []
    for i, (b, s_, e) in enumerate(seqs):
        for j, t in enumerate(packed_of[i].tolist()):
            ts.append(t)
            bs.append(b)
            cs.append(s_ + j)
    expected_grad = torch.zeros_like(y).index_add_(0, torch.tensor(ts, dtype=torch.long), dout[bs, cs])
    torch.testing.assert_close(y.grad, expected_grad, rtol=1e-12, atol=1e-12)
