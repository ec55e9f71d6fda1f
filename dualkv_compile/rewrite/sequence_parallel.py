"""Rewrite: the packed graph split over a sequence-parallel group (Ulysses; docs/design.md, semantics 13).

Contract
    Input: a packed ``GraphModule`` (``pack_graph``, then ``fuse_linear_log_prob``) and an ``SPGroup``.
    Output: a new ``GraphModule`` with the same placeholders and outputs. Run on every rank of the group with the
    same original inputs and ``runtime.sequence_parallel.shard_packed_inputs`` of the same layout, it returns on
    every rank the values the packed graph returns. Gradients follow ``ops.sp_collectives``' convention: a
    parameter's gradient on a rank is ``world`` times its share, so their mean over the group (what FSDP2 and DDP
    take) is the packed graph's; a gradient returned for an input that is not a parameter is the packed graph's.
    ``Refusal`` names what cannot be split (heads the degree does not divide; a token sum read again per token).

How
    Every per-token op already runs on whatever tokens its operands hold: the inputs enter the packed stream as
    this rank's chunk, and ``T`` (the size of ``pack_index``) becomes the chunk's length ``Tl``. What reads other
    tokens is rewritten:
    - attention -> the steps of ``ops.ulysses_attention`` (heads exchanged for tokens, the kernel over the whole
      forest), one node each, in the attention's checkpoint region (recomputed in the backward, not saved);
    - a read of each token's predecessor (``previous_tokens``, ``gather_previous``, the fused ``linear_log_prob``'s
      hidden rows) reads the gathered stream (``sp_all_gather``, backward "sum") at this rank's ``prev_index``;
    - ``unpack`` (and ``gather_unpacked``, the fused op's rows by ``unpack_index``) reads the gathered stream
      (``sp_all_gather``, backward "slice"): its result is replicated, the same on every rank;
    - a sum over tokens (marked by ``graph.meta.set_token_sum``) is this rank's partial sum, then ``sp_all_reduce``;
    - an input that is not a parameter and has a gradient (hidden states from an earlier graph) enters through
      ``sp_shard``, whose backward gives it its whole gradient on every rank, as its producer expects.
"""

from __future__ import annotations

import operator
from typing import Optional

import torch
import torch.fx as fx

from ..layout.packed_ops import (
    gather_columns, gather_previous, gather_unpacked, pack_tokens, previous_tokens, token_weights, unpack_merged, unpack_tokens,
)
from ..normalize.functionalize import eliminate_dead_code
from ..graph import Refusal, copy_graph_module
from ..graph.meta import ev, heads as _heads, recompute_tags as _recompute_tags, set_recompute_tags, token_sum
from ..ops import linear_log_prob as _linear_log_prob  # noqa: F401  (registers torch.ops.dualkv.linear_log_prob*)
from ..ops import sp_collectives as _collectives  # noqa: F401  (registers torch.ops.dualkv.sp_*)
from ..ops.sp_collectives import SPGroup
from ..ops.ulysses_attention import check_heads, ulysses_steps

__all__ = ["shard_packed_graph", "local_token_weights"]

# Per-token index inputs the runner gives as this rank's chunk (pack_index is the whole padded stream's).
SHARDED_INPUTS = ("col_index", "prev_index")

# Per token chunk; gathered or reduced over the group; of parameters (and other inputs); of non-parameter inputs alone.
_S, _R, _P, _C = "sharded", "replicated", "of parameters", "constant"


def local_token_weights(num_local: int, unpack_index, valid, input_ids, shift: int, truncate: bool, world: int, rank: int):
    """This rank's chunk of ``token_weights`` over the whole padded stream (``world * num_local`` tokens)."""
    w = token_weights(num_local * world, unpack_index, valid, input_ids, shift, truncate)
    return w.narrow(0, rank * num_local, num_local)


def _predecessor_read(n: fx.Node):
    """For an op reading packed values at each token's predecessor: (argument index, token dim), else None."""
    if n.op != "call_function":
        return None
    if n.target is previous_tokens:
        return 0, n.args[2]
    if n.target is gather_previous:
        return 0, 1
    if n.target is torch.ops.dualkv.linear_log_prob.default:
        return 0, 0
    return None


def _unpack_dim(n: fx.Node):
    if n.op == "call_function" and n.target is unpack_tokens:
        return n.args[5]
    if n.op == "call_function" and n.target is unpack_merged:
        return n.args[4]
    if n.op == "call_function" and n.target is gather_unpacked:
        return 0 if ev(n.args[3]).dim() == 2 else 1  # [T, V] for a [B * S, K] index, else [1, T, V]
    return None


def _is_placeholder(n, name: str) -> bool:
    return isinstance(n, fx.Node) and n.op == "placeholder" and n.name == name


def _is_parameter(n: fx.Node) -> bool:
    return isinstance(ev(n), torch.nn.Parameter)


def _requires_grad(n) -> bool:
    return isinstance(ev(n), torch.Tensor) and ev(n).requires_grad


class _Sharder:
    def __init__(self, gm: fx.GraphModule, sp: SPGroup):
        self.gm, self.sp, self.g = gm, sp, gm.graph
        self.kind: dict[fx.Node, str] = {}
        self.n_local: Optional[fx.Node] = None
        self.dropped: list[fx.Node] = []  # replaced nodes, erased after the walk (the walk reads a list of the nodes)

    def emit(self, where: fx.Node, target, args, name: str) -> fx.Node:
        """A call inserted before ``where``, in ``where``'s checkpoint region if it has one."""
        with self.g.inserting_before(where):
            new = self.g.call_function(target, args, name=name)
        set_recompute_tags(new, _recompute_tags(where))
        return new

    def ulysses(self, n: fx.Node, num_kv_heads: int) -> None:
        """``n`` (``attention_fwd``) -> the Ulysses steps (``ops.ulysses_attention.ulysses_steps``), each a node
        emitted before ``n`` with ``n``'s checkpoint tags; ``n`` and its ``getitem``s are dropped at the end."""
        users = list(n.users)
        if any(u.target is not operator.getitem or u.args[1] != 0 for u in users):
            raise Refusal(f"sequence_parallel: {n.name}'s log-sum-exp is read; it is not split over the group")
        q, k, v, *rest = n.args
        emit = lambda f, *a: self.emit(n, f, a, f"{n.name}_ulysses")  # noqa: E731  (FX makes the names unique)
        if len(rest) > 12 and rest[12] is not None:
            # Learnable sinks, one per query head: after the exchange this rank holds query heads
            # [rank * Hl, (rank + 1) * Hl), so it takes their sinks. Their gradient here is ``world`` times that
            # chunk's (its dout is), zero elsewhere: the group's mean is the whole gradient, as for any parameter.
            local = _heads(n)[0] // self.sp.world
            rest[12] = emit(torch.narrow, rest[12], 0, self.sp.rank * local, local)
        out = ulysses_steps(emit, q, k, v, num_kv_heads, tuple(rest), self.sp.world, self.sp.group_name)
        for u in users:
            u.replace_all_uses_with(out)
        self.dropped += [*users, n]
        self.kind[out] = _S

    def gathered(self, n: fx.Node, i: int, dim: int, backward: str) -> None:
        x = n.args[i]
        if self.kind.get(x) != _S:
            raise Refusal(f"sequence_parallel: {n.name} reads {x.name} on the packed stream, which is not per token")
        sp = self.sp
        g = self.emit(n, torch.ops.dualkv.sp_all_gather.default, (x, dim, sp.world, sp.rank, sp.group_name, backward), f"{x.name}_gathered")
        n.update_arg(i, g)

    def run(self) -> fx.GraphModule:
        sp = self.sp
        for n in list(self.g.nodes):
            if n in self.dropped:
                continue
            if n.op == "placeholder":
                self.kind[n] = _S if n.name in SHARDED_INPUTS else _P if _is_parameter(n) else _C
                continue
            if n.op == "call_method" and n.target == "size" and _is_placeholder(n.args[0], "pack_index"):
                if n.args[1:] != (0,):
                    raise Refusal(f"sequence_parallel: {n.name} reads the size of pack_index in another way")
                n.replace_all_uses_with(self.local_count(n))  # T: this rank's count
                self.kind[n] = _C
                continue
            if n.op == "output":
                self.check_outputs(n)
                continue
            if n.op == "call_function" and n.target is torch.ops.dualkv.attention_fwd.default:
                heads = _heads(n)
                why = check_heads(*heads, sp.world) if heads else "the attention's head counts are unknown"
                if why is not None:
                    raise Refusal(f"sequence_parallel: {n.name}: {why}")
                self.ulysses(n, heads[1])
                continue
            if n.op == "call_function" and n.target is torch.ops.dualkv.linear_log_prob_entropy.default:
                # Its entropy covers every row of the (gathered) hidden states, not this rank's tokens; the backend
                # does not fuse the entropy under sequence parallelism, so only a hand-built graph gets here.
                raise Refusal(f"sequence_parallel: {n.name}: the fused entropy is not split over the group")
            if n.op == "call_function" and n.target is token_weights:
                n.target = local_token_weights
                n.args = (*n.args, sp.world, sp.rank)
                self.kind[n] = _S
                continue
            dim = _unpack_dim(n)
            if n.op == "call_function" and n.target is torch.ops.dualkv.linear_log_prob.default and _is_placeholder(n.args[2], "unpack_index"):
                dim = 0  # the fused gather_unpacked: rows of the whole stream for every original position, replicated
            if dim is not None:
                self.gathered(n, 0, dim, "slice")
                self.kind[n] = _R
                continue
            read = _predecessor_read(n)
            if read is not None:
                self.gathered(n, read[0], read[1], "sum")
            if token_sum(n) is not None:
                self.token_sum(n)
                continue
            kinds = {self.kind.get(a, _C) for a in n.all_input_nodes}
            if _S in kinds and _R in kinds:
                raise Refusal(
                    f"sequence_parallel: {n.name} reads both per-token values and a value gathered or reduced over "
                    "all tokens; it cannot be split over the group"
                )
            self.kind[n] = _S if _S in kinds else _R if _R in kinds else _P if _P in kinds else _C
            if n.op == "call_function" and n.target is pack_tokens:
                self.chunk_of_packed_input(n)
            elif n.op == "call_function" and n.target is gather_columns:
                x = n.args[0]
                if self.kind.get(x) != _P and _requires_grad(x):
                    raise Refusal(f"sequence_parallel: {n.name} reads a per-column value with a gradient ({x.name})")
        for n in self.dropped:  # getitems first, then the attention they read
            self.g.erase_node(n)
        eliminate_dead_code(self.g)  # the replaced size of pack_index (in-place ops stay)
        self.g.lint()
        self.gm.recompile()
        return self.gm

    def token_sum(self, n: fx.Node) -> None:
        """``n`` sums this rank's tokens: the group's sum replaces it for every reader."""
        sp = self.sp
        users = list(n.users)
        accumulate = token_sum(n) == "accumulate"  # scatter_add / index_add into a base
        base = n.args[0] if accumulate else None
        if accumulate:
            # Each rank adds its tokens into zeros; the base is added once, after the sum over the group.
            zeros = self.emit(n, torch.zeros_like, (base,), f"{n.name}_zeros")
            n.update_arg(0, zeros)
        with self.g.inserting_after(n):
            total = self.g.call_function(torch.ops.dualkv.sp_all_reduce.default, (n, sp.world, sp.group_name), name=f"{n.name}_over_group")
        result = total
        if accumulate:
            with self.g.inserting_after(total):
                result = self.g.call_function(operator.add, (base, total), name=f"{n.name}_plus_base")
        set_recompute_tags(total, _recompute_tags(n))
        set_recompute_tags(result, _recompute_tags(n))
        for u in users:
            u.replace_input_with(n, result)
        self.kind[n], self.kind[total], self.kind[result] = _S, _R, _R
        if accumulate:
            self.kind[zeros] = _C

    def check_outputs(self, n: fx.Node) -> None:
        for a in n.all_input_nodes:
            if self.kind.get(a) == _S:
                raise Refusal(f"sequence_parallel: the graph returns {a.name}, a per-token value of the packed stream")

    def chunk_of_packed_input(self, n: fx.Node) -> None:
        """After ``n = pack_tokens(x, pack_index)`` (the whole padded stream): this rank's chunk of it.

        For an activation input with a gradient, through ``sp_shard``: its producer (an earlier graph's
        gather, or replicated code) gets the whole gradient on every rank. Otherwise a plain slice."""
        x, s_dim = n.args[0], n.args[3]
        sp = self.sp
        users = list(n.users)
        n_local = self.local_count(n)
        with self.g.inserting_after(n):
            if self.kind.get(x) != _P and _requires_grad(x):
                chunk = self.g.call_function(
                    torch.ops.dualkv.sp_shard.default, (n, s_dim, sp.world, sp.rank, sp.group_name), name=f"{n.name}_chunk"
                )
            else:
                start = self.g.call_function(operator.mul, (n_local, sp.rank))
                with self.g.inserting_after(start):
                    chunk = self.g.create_node("call_method", "narrow", (n, s_dim, start, n_local), name=f"{n.name}_chunk")
        set_recompute_tags(chunk, _recompute_tags(n))
        for u in users:
            u.replace_input_with(n, chunk)
        self.kind[n], self.kind[chunk] = _C, _S

    def local_count(self, where: fx.Node) -> fx.Node:
        """The node of ``Tl``, this rank's packed token count (the padded stream's length over ``world``)."""
        if self.n_local is None:
            placeholders = list(self.g.find_nodes(op="placeholder"))
            index = next(p for p in placeholders if p.name == "pack_index")
            with self.g.inserting_after(placeholders[-1]):
                total = self.g.call_method("size", (index, 0))
            with self.g.inserting_after(total):
                self.n_local = self.g.call_function(operator.floordiv, (total, self.sp.world), name="local_tokens")
            self.kind[total] = self.kind[self.n_local] = _C  # sizes: read by per-token shapes and token weights alike
        return self.n_local


def shard_packed_graph(packed: fx.GraphModule, sp: SPGroup) -> fx.GraphModule:
    """The packed graph split over ``sp`` (see the module docstring for its contract); ``packed`` is not changed."""
    return _Sharder(copy_graph_module(packed), sp).run()
