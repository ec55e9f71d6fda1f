"""Rewrite: the packed graph split over a sequence-parallel group (Ulysses; DESIGN.md semantics 13).

Contract
    Input: a packed ``GraphModule`` (``pack_graph``, then ``fuse_linear_log_prob``) and an ``SPGroup``.
    Output: a new ``GraphModule`` with the same placeholders and outputs. Run on every rank of the group with
    the same original inputs and ``runtime.sequence_parallel.shard_packed_inputs`` of the same layout (the
    per-token index inputs are this rank's chunk of a stream padded to ``world * Tl`` tokens, the segments
    cover the padding with a root of its own), it returns on every rank the values the packed graph returns.
    A parameter's gradient on a rank is its share: their sum over the group is the packed graph's gradient.
    ``Refusal`` names what cannot be split (heads the degree does not divide; a value reduced over all
    tokens that per-token code reads again).

How
    Every per-token op already runs on whatever tokens its operands hold: with this rank's chunk of
    ``pack_index``/``col_index`` every packed value is this rank's chunk, and ``T`` (the size of
    ``pack_index``) is the chunk's length, so reshapes follow. What reads other tokens is rewritten:

    - attention -> ``ops.ulysses_attention`` (heads exchanged for tokens, the kernel over the whole forest);
    - a read of each token's predecessor (``previous_tokens``, ``gather_previous``, the fused
      ``linear_log_prob``'s hidden rows) reads the gathered stream (``sp_all_gather``, backward "sum"),
      indexed by this rank's chunk of ``prev_index``;
    - ``unpack`` reads the gathered stream (``sp_all_gather``, backward "slice"): its result is
      replicated, the same on every rank;
    - a sum over tokens (``weighted_reductions``, marked ``TOKEN_SUM_META``) is this rank's partial sum,
      then ``sp_all_reduce``; its token weights are this rank's chunk of the whole stream's;
    - a value of parameters alone read by replicated code (after a gather or a reduction), or returned, is
      read through ``scale_grad(x, 1 / world)``: every rank runs that code, and a parameter's gradient is
      summed over the group, so each rank adds its share. Other replicated values (activations an earlier
      graph gathered, the caller's inputs) get their whole gradient on every rank, as their producers'
      gathers expect.
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx

from ..analysis.node_info import Refusal
from ..ops import sp_collectives as _collectives  # noqa: F401  (registers torch.ops.dualkv.sp_*)
from ..ops.sp_collectives import SPGroup, scale_grad
from ..ops.ulysses_attention import check_heads, ulysses_attention
from .graph_copy import copy_graph_module
from .inline_checkpoint import RECOMPUTE_META
from .sp_meta import HEADS_META, TOKEN_SUM_META
from .packed_ops import gather_previous, previous_tokens, token_weights, unpack_merged, unpack_tokens

__all__ = ["shard_packed_graph", "local_token_weights"]

# Per-token index inputs the runner gives as this rank's chunk.
SHARDED_INPUTS = ("pack_index", "col_index", "prev_index")

# Per token chunk; gathered or reduced over the group; of parameters (and inputs); of other inputs alone.
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
    return None


def _is_parameter(n: fx.Node) -> bool:
    return isinstance(n.meta.get("example_value"), torch.nn.Parameter)


def _requires_grad(n) -> bool:
    ev = n.meta.get("example_value") if isinstance(n, fx.Node) else None
    return isinstance(ev, torch.Tensor) and ev.requires_grad


class _Sharder:
    def __init__(self, gm: fx.GraphModule, sp: SPGroup):
        self.gm, self.sp, self.g = gm, sp, gm.graph
        self.kind: dict[fx.Node, str] = {}

    def emit(self, where: fx.Node, target, args, name: str) -> fx.Node:
        """A call inserted before ``where``, in ``where``'s checkpoint region if it has one."""
        with self.g.inserting_before(where):
            new = self.g.call_function(target, args, name=name)
        new.meta.update({k: where.meta[k] for k in RECOMPUTE_META if k in where.meta})
        return new

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
            if n.op == "placeholder":
                self.kind[n] = _S if n.name in SHARDED_INPUTS else _P if _is_parameter(n) else _C
                continue
            if n.op == "output":
                self.scale_constant_reads(n, outputs=True)
                continue
            if n.op == "call_function" and n.target is torch.ops.dualkv.attention_fwd.default:
                heads = n.meta.get(HEADS_META)
                why = check_heads(*heads, sp.world) if heads else "the attention's head counts are unknown"
                if why is not None:
                    raise Refusal(f"sequence_parallel: {n.name}: {why}")
                n.target = ulysses_attention
                n.args = (*n.args, sp.world, sp.group_name)
                self.kind[n] = _S
                continue
            if n.op == "call_function" and n.target is token_weights:
                n.target = local_token_weights
                n.args = (*n.args, sp.world, sp.rank)
                self.kind[n] = _S
                continue
            dim = _unpack_dim(n)
            if dim is not None:
                self.gathered(n, 0, dim, "slice")
                self.kind[n] = _R
                self.scale_constant_reads(n)
                continue
            read = _predecessor_read(n)
            if read is not None:
                self.gathered(n, read[0], read[1], "sum")
            if TOKEN_SUM_META in n.meta:
                self.token_sum(n)
                continue
            kinds = {self.kind.get(a, _C) for a in n.all_input_nodes}
            if _S in kinds and _R in kinds:
                raise Refusal(
                    f"sequence_parallel: {n.name} reads both per-token values and a value gathered or reduced over "
                    "all tokens; it cannot be split over the group"
                )
            self.kind[n] = _S if _S in kinds else _R if _R in kinds else _P if _P in kinds else _C
            if self.kind[n] == _R:
                self.scale_constant_reads(n)
        self.g.lint()
        self.gm.recompile()
        return self.gm

    def token_sum(self, n: fx.Node) -> None:
        """``n`` sums this rank's tokens: the group's sum replaces it for every reader."""
        sp = self.sp
        users = list(n.users)
        accumulate = n.meta[TOKEN_SUM_META] == "accumulate"  # scatter_add / index_add into a base
        base = n.args[0] if accumulate else None
        if accumulate:
            # Each rank adds its tokens into zeros; the base is added once, after the sum over the group.
            zeros = self.emit(n, torch.zeros_like, (base,), f"{n.name}_zeros")
            n.update_arg(0, zeros)
        with self.g.inserting_after(n):
            total = self.g.call_function(torch.ops.dualkv.sp_all_reduce.default, (n, sp.group_name), name=f"{n.name}_over_group")
        result = total
        if accumulate:
            with self.g.inserting_after(total):
                result = self.g.call_function(operator.add, (base, total), name=f"{n.name}_plus_base")
        for k in RECOMPUTE_META:
            if k in n.meta:
                total.meta[k] = result.meta[k] = n.meta[k]
        for u in users:
            u.replace_input_with(n, result)
        self.kind[n], self.kind[total], self.kind[result] = _S, _R, _R
        if accumulate:
            self.kind[zeros] = _C
            if self.kind.get(base) == _P and _requires_grad(base):
                scaled = self.emit(result, scale_grad, (base, 1.0 / sp.world), f"{base.name}_share")
                result.update_arg(0, scaled)

    def scale_constant_reads(self, n: fx.Node, outputs: bool = False) -> None:
        """Read each operand of the replicated node ``n`` computed from parameters alone through ``scale_grad``.

        Only those: a replicated value's gradient is whole on every rank (an activation that an earlier graph
        gathered, or the caller's input, gets it whole, as its producer expects), while a parameter's
        gradient is summed over the group, so a reader that every rank runs adds ``1 / world`` of it on each."""
        for a in list(n.all_input_nodes):
            if self.kind.get(a, _C) == _S and outputs:
                raise Refusal(f"sequence_parallel: the graph returns {a.name}, a per-token value of the packed stream")
            if self.kind.get(a, _C) != _P or not _requires_grad(a):
                continue
            scaled = self.emit(n, scale_grad, (a, 1.0 / self.sp.world), f"{a.name}_share")
            self.kind[scaled] = _C
            n.replace_input_with(a, scaled)


def shard_packed_graph(packed: fx.GraphModule, sp: SPGroup) -> fx.GraphModule:
    """The packed graph split over ``sp`` (see the module docstring for its contract); ``packed`` is not changed."""
    return _Sharder(copy_graph_module(packed), sp).run()
