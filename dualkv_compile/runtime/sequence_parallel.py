"""Per call under sequence parallelism: the layout agreed by the group, and this rank's chunk of the packed inputs.

Assumes every rank of the group calls the runner with the same batch (as veRL's Ulysses and
``examples/fsdp_grpo.py --sp`` give it: the ranks of a sequence-parallel group read the same micro-batch). Each
rank detects the layout from its own copy; detection is deterministic, so the ranks agree.

Guarantees
    * ``agree`` checks that agreement with one small all-gather of a fingerprint (sizes, token and node counts, a
      digest of the forest's nodes and sequences; or of the reason nothing was packed), once per layout, so the
      ranks take the same path (packed: the same collectives; unpacked: none); ranks that disagree raise
      ``RuntimeError`` naming both fingerprints instead of waiting on each other or computing on different layouts.
    * ``shard_packed_inputs``: the stream is padded to ``world * Tl`` tokens, ``Tl = ceil(T / world)``; rank ``r``
      gets the tokens ``[r * Tl, (r + 1) * Tl)`` of ``col_index`` and ``prev_index`` and the whole padded
      ``pack_index`` (the sharded graph packs its inputs whole, then slices them). A padding token is a copy of the
      first packed token (finite values), its own predecessor and a root segment of its own; no output or sum reads
      it (``unpack_index`` never names it, its token weight is zero). The segments cover the padded stream.
    * The unpacked fallback needs nothing: every rank computes the whole program and gets whole gradients, whose
      mean over the group is the single-process one (``ops.sp_collectives``' convention).
"""

from __future__ import annotations

import hashlib
from typing import Union

import torch

from ..layout import SharedPromptLayout
from ..ops.sp_collectives import SPGroup
from ..rewrite.packed_inputs import PackedInputs

__all__ = ["agree", "local_token_count", "shard_packed_inputs"]


def local_token_count(num_tokens: int, world: int) -> int:
    """Tokens per rank: the packed stream padded to a multiple of ``world``, split evenly."""
    return -(-num_tokens // world)


def _fingerprint(layout: Union[SharedPromptLayout, str]) -> list[int]:
    if isinstance(layout, str):
        digest = hashlib.blake2b(layout.encode(), digest_size=8).digest()
        return [-1, -1, -1, -1, int.from_bytes(digest, "little", signed=True)]
    # Host values only (no device sync): the forest's nodes and the sequences that read them.
    digest = hashlib.blake2b(repr((layout.nodes, layout.sequences)).encode(), digest_size=8).digest()
    return [layout.batch_size, layout.seq_len, layout.num_tokens, len(layout.nodes), int.from_bytes(digest, "little", signed=True)]


def agree(layout: Union[SharedPromptLayout, str], sp: SPGroup, device: torch.device) -> None:
    """``RuntimeError`` unless every rank of the group has this layout (or this reason for none)."""
    from ..ops.sp_collectives import all_gather_flat, process_group

    mine = torch.tensor(_fingerprint(layout), dtype=torch.int64, device=device)
    everyone = mine.new_empty(sp.world * mine.numel())
    all_gather_flat(everyone, mine, process_group(sp.group_name))
    rows = everyone.view(sp.world, -1).tolist()
    for r, row in enumerate(rows):
        if row != rows[sp.rank]:
            raise RuntimeError(
                f"sequence_parallel: ranks {sp.rank} and {r} of the group see different batches "
                f"(layout fingerprints {rows[sp.rank]} and {row}); every rank of a sequence-parallel group "
                "must receive the same micro-batch"
            )


def shard_packed_inputs(extra: PackedInputs, num_tokens: int, sp: SPGroup) -> PackedInputs:
    """This rank's inputs of the sharded packed graph (see the module docstring)."""
    n = local_token_count(num_tokens, sp.world)
    pad = n * sp.world - num_tokens
    start = sp.rank * n

    def chunk(x: torch.Tensor, filler: torch.Tensor) -> torch.Tensor:
        if pad:
            x = torch.cat([x, filler])
        return x.narrow(0, start, n)

    first = extra.pack_index[:1].expand(pad)
    own = torch.arange(num_tokens, num_tokens + pad, device=extra.prev_index.device, dtype=extra.prev_index.dtype)
    fields = extra._replace(
        pack_index=torch.cat([extra.pack_index, first]) if pad else extra.pack_index,  # whole: the graph slices it
        col_index=chunk(extra.col_index, extra.col_index[:1].expand(pad)),
        prev_index=chunk(extra.prev_index, own),
    )
    if pad:
        def append(t: torch.Tensor, value: int) -> torch.Tensor:
            return torch.cat([t, t.new_full((1,), value)])

        fields = fields._replace(
            seg_start=append(extra.seg_start, num_tokens),
            seg_len=append(extra.seg_len, pad),
            parent=append(extra.parent, -1),
            prefix_len=append(extra.prefix_len, 0),
            subtree_end=append(extra.subtree_end, num_tokens + pad),
            max_seg_len=max(extra.max_seg_len, pad),
        )
    return fields
