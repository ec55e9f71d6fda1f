"""Rewrite: the packed graph of a static-shape Dynamo graph.

Contract
    Input: the original ``GraphModule`` and its ``TokenAxes`` (no refusals), the attention backend to call.
    Output: a new ``GraphModule`` taking the original placeholders followed by ``PACKED_INPUTS`` (``PackedInputs``'
    fields: the layout's index tensors, segments and their maxima) and returning the original outputs, in the
    original layout, equal to the original program's at every non-padding position (zeros at padding).

How
    Every node gets up to two translations. The *packed* one (TOKEN nodes) runs on the packed stream: token axes
    ``[b, s]`` become ``[1, T]``, shape arguments are re-derived from the tags (``b -> 1``, ``s -> T * f``,
    ``bs -> T * f``: ``packed_shapes``), each attention becomes ``dualkv::attention_fwd`` on the layout's segments,
    and COLUMN values (``arange(S)``, ``[1, S]`` position ids) are gathered at each token's column. The *original*
    one is the node copied unchanged; a TOKEN node's original value is ``unpack`` of its packed one, emitted just
    before the first node that needs it (graph outputs, ops that leave the token-local region such as a shift along
    the sequence), or, for a value of the ids, mask and positions alone, the op itself on the original inputs. A
    sum over every token axis is taken on the packed stream, each token weighted by its multiplicity
    (``weighted_reductions``). A size read off a token value (``x.size()``) keeps its original value, as a number.
    Dead-code elimination then drops what nothing reads (in-place ops stay, read or not), the attention masks among
    it, so ``[B, S, ...]`` values are built only where an original-layout consumer reads them.
"""

from __future__ import annotations

import logging
import operator
from typing import Optional

import torch
import torch.fx as fx

from ..ops import attention as _attention_op  # noqa: F401  (registers torch.ops.dualkv.attention_fwd)
from ..analysis.attention_match import AttentionMatch, default_scale
from ..layout.packed_ops import gather_columns, gather_previous, gather_unpacked, pack_tokens, previous_tokens, unpack_merged, unpack_tokens
from ..normalize.functionalize import eliminate_dead_code
from ..graph import Refusal
from ..graph.meta import (
    TAGGED_OPS, copy_meta, ev as _ev, recompute_tags, set_heads, set_original, set_picked_rank, set_recompute_tags,
    set_unpacked_rank,
)
from .output_aliases import aliased_outputs
from .recurrent_layers import emit_recurrent
from .packed_inputs import PackedInputs
from .packed_shapes import emit_original_size, rewrite_shapes
from .weighted_reductions import emit_weighted
from ..analysis.node_info import Kind, shape_of
from ..analysis.recurrent_rules import recurrent_kind
from ..analysis.shape_rules import is_size_query
from ..analysis.token_axes import TokenAxes
from ..analysis.token_inputs import Role

log = logging.getLogger("dualkv_compile")

__all__ = ["pack_graph", "PACKED_INPUTS"]

PACKED_INPUTS = PackedInputs._fields


class _Packer:
    def __init__(self, gm: fx.GraphModule, axes: TokenAxes, backend: str, requested: str):
        self.gm, self.axes, self.backend, self.requested = gm, axes, backend, requested
        self.backends: list[str] = []  # the concrete backend of each attention, in graph order
        self.B, self.S = axes.B, axes.S
        self.g = fx.Graph()
        self.packed: dict[fx.Node, fx.Node] = {}
        self.orig: dict[fx.Node, fx.Node] = {}
        self.prev: dict[fx.Node, fx.Node] = {}
        self.attn = {m.output: m for m in axes.attention}

    # ------------------------------------------------------------ lookups
    def packed_of(self, n: fx.Node) -> fx.Node:
        if n in self.packed:
            return self.packed[n]
        info = self.axes.info[n]
        if info.kind is Kind.COLUMN:
            s_dim = info.tags.index("s")
            p = self.g.call_function(gather_columns, (self.orig_of(n), self.inp["col_index"], s_dim))
        elif info.kind is Kind.NONE:
            p = self.orig_of(n)
        else:
            raise Refusal(f"{n.name}: needed on the packed stream but computed in the original layout ({info.cause})")
        self.packed[n] = p
        return p

    def packed_at_targets(self, n: fx.Node) -> fx.Node:
        """For an op on next-token values: a shift-0 token operand read at each token's predecessor."""
        info = self.axes.info[n]
        if info.kind is not Kind.TOKEN or info.shift:
            return self.packed_of(n)
        if n not in self.prev:
            self.prev[n] = self.g.call_function(previous_tokens, (self.packed_of(n), self.inp["prev_index"], info.tags.index("s")))
        return self.prev[n]

    def orig_of(self, n: fx.Node) -> fx.Node:
        if n in self.orig:
            return self.orig[n]
        info = self.axes.info[n]
        if info.kind is not Kind.TOKEN:
            raise AssertionError(f"{n.name} has no original translation yet")
        if info.from_inputs:
            # Of the ids, mask and positions alone: the original op on the original inputs (exact at padding
            # too, where unpack would give zeros), e.g. a loss mask that a reduction in the original layout reads.
            self.orig[n] = self.copy(n, self.orig_of)
            return self.orig[n]
        tags, shape = info.tags, shape_of(n)
        p = self.packed[n]
        slen = info.slen
        truncate = info.shift == 0 and slen == self.S - 1
        if "bs" in tags:
            d = tags.index("bs")
            if shape[d] != self.B * slen:
                raise Refusal(f"{n.name}: leaves the packed region with a merged token axis of size {shape[d]}")
            ids = self.orig[self.size_ref()]
            o = self.g.call_function(
                unpack_merged, (p, self.inp["unpack_index"], self.inp["valid"], ids, d, info.shift, truncate)
            )
        else:
            b, s = tags.index("b"), tags.index("s")
            if shape[b] != self.B or shape[s] != slen:
                raise Refusal(f"{n.name}: leaves the packed region with token axes of sizes {shape[b]}, {shape[s]}")
            ids = self.orig[self.size_ref()]
            o = self.g.call_function(
                unpack_tokens, (p, self.inp["unpack_index"], self.inp["valid"], ids, b, s, info.shift, truncate)
            )
        set_unpacked_rank(o, len(shape))  # for analysis.padding_reads
        self.orig[n] = o
        return o

    def size_ref(self) -> fx.Node:
        """A ``[B, S, ...]`` input that ``unpack`` reads B and S from: ``input_ids``, else a carried token-major input."""
        inputs = self.axes.token_inputs
        if Role.INPUT_IDS in inputs:
            return inputs.get(Role.INPUT_IDS)
        for node in inputs.of(Role.CARRIED):
            if self.axes.info[node].tags[:2] == ("b", "s"):
                return node
        raise Refusal("no [B, S] input to size the unpacked outputs by")

    # ------------------------------------------------------------ translation
    def run(self) -> fx.GraphModule:
        placeholders = [n for n in self.gm.graph.nodes if n.op == "placeholder"]
        for n in placeholders:
            new = self.g.placeholder(n.name, type_expr=n.type)
            copy_meta(n, new)
            self.orig[n] = new
        self.inp = {name: self.g.placeholder(name) for name in PACKED_INPUTS}
        self.T = self.g.call_method("size", (self.inp["pack_index"], 0))
        self.recomputed = self.originals_to_recompute()
        for n in self.gm.graph.nodes:
            if n.op == "placeholder":
                info = self.axes.info[n]
                if info.kind is Kind.TOKEN:
                    b, s = info.tags.index("b"), info.tags.index("s")
                    self.packed[n] = self.g.call_function(pack_tokens, (self.orig[n], self.inp["pack_index"], b, s))
                    set_original(self.packed[n], n.name)  # a mask input as a factor (analysis.padding_reads)
                continue
            if n.op == "output":
                leaves: list = []
                fx.map_arg(n.args[0], leaves.append)
                aliased = aliased_outputs(self, leaves)  # views of one value stay views of one tensor
                out = fx.map_arg(n.args[0], lambda a: aliased.get(a) or self.orig_of(a))
                self.g.output(out)
                continue
            info = self.axes.info[n]
            last = next(iter(reversed(self.g.nodes)))  # nodes emitted for n follow it
            if info.kind in (Kind.TOKEN, Kind.ROUTED):  # ROUTED (MoE dispatch): the packed form only
                self.packed[n] = self.emit_packed(n)
                if n in self.recomputed:
                    self.emit_original(n)
            elif info.weighted is not None:  # a sum over tokens: weighted on the packed stream, never unpacked
                self.orig[n] = emit_weighted(self, n)
            elif is_size_query(n) and self.axes.info[n.args[0]].kind is Kind.TOKEN:
                # x.size() of a token value: the original sizes, without unpacking x only to read its shape.
                self.orig[n] = emit_original_size(self, n)
            else:
                self.orig[n] = self.emit_gather_unpacked(n) or self.copy(n, self.orig_of)
                if info.kind is Kind.BCAST:  # both forms; DCE keeps what is read
                    self.packed[n] = self.emit_packed(n)
            _inherit_recompute_tags(n, last)
        eliminate_dead_code(self.g)  # in-place ops stay, read or not
        self.g.lint()
        return fx.GraphModule(self.gm, self.g, class_name="PackedGraph")

    def unpackable(self, n: fx.Node) -> bool:
        """Whether ``unpack`` of ``n``'s packed form gives its original one (token axes of the batch's sizes)."""
        if not isinstance(_ev(n), torch.Tensor):
            return True  # a tuple (topk's): its elements are checked
        info, shape = self.axes.info[n], shape_of(n)
        if "bs" in info.tags:
            return shape[info.tags.index("bs")] == self.B * info.slen
        b, s = info.tags.index("b"), info.tags.index("s")
        return shape[b] == self.B and shape[s] == info.slen

    def originals_to_recompute(self) -> set:
        """TOKEN values ``unpack`` cannot restore (a merged axis of k entries per token: a top-k's
        ``ids.reshape(-1)``) that a reader in the original layout needs, directly or through another such value
        (a load-balancing loss counting experts): ``emit_original`` recomputes them from their operands'."""
        need: set = set()
        for n in reversed(self.gm.graph.nodes):
            info = self.axes.info.get(n)
            if info is None or info.kind is not Kind.TOKEN or self.unpackable(n):
                continue
            if any(u.op == "output" or u in need or self.axes.info[u].kind not in (Kind.TOKEN, Kind.ROUTED) for u in n.users):
                need.add(n)
        return need

    def emit_original(self, n: fx.Node) -> None:
        """The original form of ``n`` (``originals_to_recompute``): its op on its operands' original forms, equal
        to the original program's at every valid position (a per-token op on unpacked operands)."""
        if any(self.axes.info[a].kind is Kind.ROUTED for a in n.all_input_nodes):
            return  # an MoE dispatch's output: orig_of refuses if a reader needs it
        try:
            self.orig[n] = self.copy(n, self.orig_of)
        except Refusal:
            pass  # an operand has no original form either: orig_of refuses if a reader needs it

    def copy(self, n: fx.Node, lookup) -> fx.Node:
        args = fx.map_arg(n.args, lookup)
        kwargs = fx.map_arg(n.kwargs, lookup)
        new = self.g.create_node(n.op, n.target, args, kwargs, name=n.name)
        copy_meta(n, new)
        return new

    def emit_packed(self, n: fx.Node) -> fx.Node:
        if n in self.attn:
            return self.emit_attention(self.attn[n])
        if recurrent_kind(n) is not None:  # never the op itself on the packed stream: it would join the sequences
            return emit_recurrent(self, n)
        lookup = self.packed_of
        # Where next-token values meet shift-0 values (the analysis allows
        # that for pointwise ops and gathers only), read the latter at each
        # token's predecessor. The slice x[:, 1:] that makes a shift-1 value is
        # the identity on the packed stream.
        if self.axes.info[n].shift and not (n.op == "call_function" and n.target is operator.getitem):
            fused = self.emit_gather_previous(n)
            if fused is not None:
                return fused
            lookup = self.packed_at_targets
        args = fx.map_arg(n.args, lookup)
        kwargs = fx.map_arg(n.kwargs, lookup)
        args, kwargs = rewrite_shapes(self, n, args, kwargs)
        new = self.g.create_node(n.op, n.target, args, kwargs, name=n.name + "_packed")
        set_original(new, n.name)  # for analysis.padding_reads
        return new

    def emit_gather_previous(self, n: fx.Node) -> Optional[fx.Node]:
        """``src.gather(-1, next_ids)`` with ``src`` a ``[B, S, V]`` value of each token (the log-probs), the
        index a next-token value: read each entry at the token's predecessor without copying ``src``
        (``gather_previous``). None where the pattern differs; the caller then shifts ``src`` whole."""
        is_gather = (n.op == "call_method" and n.target == "gather") or (n.op == "call_function" and n.target is torch.gather)
        if not is_gather or len(n.args) < 2:
            return None
        src, dim = n.args[0], n.args[1]
        index = n.args[2] if len(n.args) > 2 else n.kwargs.get("index")
        if not isinstance(src, fx.Node) or not isinstance(index, fx.Node) or not isinstance(dim, int):
            return None
        if set(n.kwargs) - {"index"}:
            return None
        s_info, i_info = self.axes.info[src], self.axes.info[index]
        if s_info.kind is not Kind.TOKEN or s_info.shift or not i_info.shift or i_info.kind is not Kind.TOKEN:
            return None
        if s_info.tags != ("b", "s", None) or i_info.tags != ("b", "s", None) or dim not in (-1, 2):
            return None
        return self.g.call_function(
            gather_previous, (self.packed_of(src), self.inp["prev_index"], self.packed_of(index)), name=n.name + "_packed"
        )

    def emit_gather_unpacked(self, n: fx.Node) -> Optional[fx.Node]:
        """``src.gather(-1, index)`` with ``src`` a ``[B, S, V]`` (or one-row ``[S, V]``) value of each token and
        ``index`` in the original layout (labels computed outside the graph): pick the entries from the packed
        rows (``gather_unpacked``) instead of unpacking ``src`` whole. None where the pattern differs."""
        is_gather = (n.op == "call_method" and n.target == "gather") or (n.op == "call_function" and n.target is torch.gather)
        if not is_gather or len(n.args) != 3 or n.kwargs:
            return None
        src, dim, index = n.args
        if not isinstance(src, fx.Node) or not isinstance(index, fx.Node) or dim not in (-1, len(shape_of(src)) - 1):
            return None
        s_info, i_info = self.axes.info[src], self.axes.info[index]
        if s_info.kind is not Kind.TOKEN or s_info.shift or s_info.slen != self.S or i_info.kind is Kind.TOKEN:
            return None
        merged = s_info.tags == ("bs", None)
        if not merged and s_info.tags != ("b", "s", None):
            return None
        lead = (self.B * self.S,) if merged else (self.B, self.S)
        if tuple(shape_of(index)[:-1]) != lead or tuple(shape_of(src)[:-1]) != lead:
            return None
        picked = self.g.call_function(
            gather_unpacked, (self.packed_of(src), self.inp["unpack_index"], self.inp["valid"], self.orig_of(index)),
            name=n.name,
        )
        # For analysis.padding_reads: zero at padding, as unpack leaves it (the fusion marks its replacement alike).
        set_picked_rank(picked, len(shape_of(n)))
        set_unpacked_rank(picked, len(shape_of(n)))
        return picked

    def emit_attention(self, m: AttentionMatch) -> fx.Node:
        # The kernel takes q, k, v in the attention output's dtype. They differ under autocast: SDPA
        # casts its inputs to the autocast dtype (HF's fp32 RMSNorm and rotary leave q, k in float32
        # and v in bfloat16), which an opaque op does not do; so the cast is made here, in the graph.
        want = _ev(m.output).dtype
        k, v = _unrepeated_kv(m.k, self.axes), _unrepeated_kv(m.v, self.axes)
        if _ev(k).shape[1] != _ev(v).shape[1]:
            k, v = m.k, m.v  # one of them un-repeated alone: the op takes both repeated (its check refuses a mix)
        kv_heads = int(_ev(k).shape[1])
        q, k, v = (self._in_dtype(x, want) for x in (m.q, k, v))
        scale = m.scale if m.scale is not None else default_scale(m.q)
        backend = self._backend_for(m, want)
        sinks = None
        if m.sinks is not None:
            sinks = self.g.call_method("reshape", (self.packed_of(m.sinks), (-1,)))
        i = self.inp
        args = (q, k, v, i["seg_start"], i["seg_len"], i["parent"], i["prefix_len"], i["subtree_end"],
                i["max_seg_len"], i["max_prefix_len"], float(scale), float(m.softcap), backend)
        if m.window or m.chunk or sinks is not None:  # the op's defaults otherwise: graphs without them read as before
            args += (int(m.window), int(m.chunk), sinks)
        res = self.g.call_function(torch.ops.dualkv.attention_fwd.default, args)
        self.backends.append(backend)
        set_heads(res, int(_ev(m.q).shape[1]), kv_heads)  # for rewrite.sequence_parallel
        return self.g.call_function(operator.getitem, (res, 0), name=m.output.name + "_packed")

    def _backend_for(self, m: AttentionMatch, dtype: torch.dtype) -> str:
        """The concrete backend of this attention: the graph's, or, for windows, sinks or a softcap it cannot run,
        what ``auto`` picks for them when the user asked for ``auto``; ``Refusal`` when none can."""
        qv, vv = _ev(m.q), _ev(m.v)
        probe_q, probe_v = (torch.empty((1, 1, 1, int(t.shape[-1])), dtype=dtype, device=t.device) for t in (qv, vv))
        feats = dict(window=int(m.window), chunk=int(m.chunk), sinks=m.sinks is not None, softcap=float(m.softcap))
        why = _attention_op.unsupported_reason(self.backend, probe_q, probe_v, **feats)
        if why is None:
            return self.backend
        if self.requested == "auto" and any(feats.values()):
            try:
                picked = _attention_op.resolve_backend("auto", probe_q, probe_v, **feats)
            except ValueError as e:
                why = str(e)
            else:
                if picked != "reference" or probe_q.device.type != "cuda":
                    return picked
                # The dense reference holds [Hq, T, T] scores: on a GPU at training lengths that is out of memory,
                # where the unchanged program runs; the user may still ask for it by name.
                why = (f"no GPU kernel runs this attention's window={feats['window']}, chunk={feats['chunk']}, "
                       f"sinks={feats['sinks']} ({why}); attention_backend='reference' would, densely")
        raise Refusal(f"{m.output.name}: attention_backend={self.backend!r} cannot run this attention: {why}")

    def _in_dtype(self, n: fx.Node, dtype: torch.dtype) -> fx.Node:
        p = self.packed_of(n)
        return p if _ev(n).dtype == dtype else self.g.call_method("to", (p, dtype))


def _inherit_recompute_tags(n: fx.Node, last: fx.Node) -> None:
    """Give every node emitted after ``last`` (while translating ``n``) ``n``'s checkpoint tags.

    Inside an activation-checkpoint region (``normalize.inline_checkpoint``) the
    packed copy of a node, the shared-prompt attention op replacing an SDPA,
    and the pack/unpack/gather helpers made for the node's operands belong to
    the region: they are recomputed in the backward like the nodes they
    replace, so packing keeps checkpointing's memory behaviour.
    """
    tags = recompute_tags(n)
    if not tags:
        return
    node = last.next
    while node.op != "root":
        if node.op in TAGGED_OPS:
            set_recompute_tags(node, tags)
        node = node.next


def _unrepeated_kv(x: fx.Node, axes: TokenAxes) -> fx.Node:
    """The K/V before Hugging Face's ``repeat_kv`` (``[:, :, None]`` -> expand -> reshape), if ``x`` is its result.

    The attention op does GQA itself, so it reads each KV head once instead
    of a copy per query head (and its backward sums dK/dV per KV head). Dtype casts after the repeat
    (``key_states.float()``) are looked through: the op casts its inputs to the output's dtype itself.
    """
    repeated = x
    while _is_dtype_cast(x):
        x = x.args[0]
    if not (x.op == "call_method" and x.target == "reshape"):
        return repeated
    e = x.args[0]
    if not (isinstance(e, fx.Node) and e.op == "call_method" and e.target == "expand"):
        return repeated
    g = e.args[0]
    if not (isinstance(g, fx.Node) and g.op == "call_function" and g.target is operator.getitem):
        return repeated
    src, idx = g.args
    full = slice(None, None, None)
    if idx != (full, full, None, full, full) or axes.info[src].tags != ("b", None, "s", None):
        return repeated
    src_shape, out_shape = shape_of(src), shape_of(x)
    if len(out_shape) != 4 or out_shape[1] % src_shape[1] or [out_shape[i] for i in (0, 2, 3)] != [src_shape[i] for i in (0, 2, 3)]:
        return repeated
    return src


def _is_dtype_cast(x) -> bool:
    """``x.float()``, ``x.half()``, ``x.bfloat16()``, ``x.to(dtype)``: a cast that changes nothing but the dtype."""
    if not (isinstance(x, fx.Node) and x.op == "call_method" and isinstance(x.args[0], fx.Node)):
        return False
    if x.target in ("float", "half", "bfloat16", "double"):
        return len(x.args) == 1 and not x.kwargs
    if x.target == "to":
        rest = list(x.args[1:]) + [v for k, v in x.kwargs.items() if k == "dtype"]
        return len(rest) == 1 and isinstance(rest[0], torch.dtype) and set(x.kwargs) <= {"dtype"}
    return False


def pack_graph(gm: fx.GraphModule, axes: TokenAxes, backend: str, requested: Optional[str] = None) -> fx.GraphModule:
    """The packed ``GraphModule`` of ``gm`` (see the module docstring for its contract).

    ``backend``: the graph's concrete attention backend; ``requested``: what the user asked for (``backend``
    if None): under "auto" an attention with windows, sinks or a softcap that ``backend`` cannot run takes what "auto"
    picks for it. The packed module's ``attention_backends`` lists each attention's backend.
    """
    if axes.refusals:
        raise Refusal("; ".join(axes.refusals))
    packer = _Packer(gm, axes, backend, backend if requested is None else requested)
    packed = packer.run()
    packed.attention_backends = tuple(packer.backends)
    return packed
