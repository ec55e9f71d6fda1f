"""Segments' host twin: the kernels' per-step schedules (tile schedules, ancestor walks) are built on the CPU copy of
the segments and copied over, and only while the device tensors are the very ones registered and
unmodified. On a CPU machine the twin is registered by hand (``tree_segments`` registers one for CUDA segments
only); the CUDA test checks that path and that its results equal the ones built on the device."""

from __future__ import annotations

import pytest
import torch

from dualkv_compile.kernels.common import schedule
from dualkv_compile.layout.segments import Segments, derived_on_host, host_twin, register_host_twin, tree_segments

LENS, PARENTS = [300, 40, 0, 70, 129, 5], [-1, 0, 0, 2, -1, 4]
OTHER_LENS, OTHER_PARENTS = [200, 160, 30, 129, 5, 20], [-1, 0, 1, -1, 3, 3]  # the same total: 544 tokens
T = sum(LENS)


def _derived(segs):
    schedule.clear_plans()  # the plan cache would hand back an earlier call's result
    return (schedule.tile_schedule(segs, T, 64, "q"), schedule.tile_schedule(segs, T, 128, "kv"),
            schedule.ancestor_walk(segs, 64), schedule.ancestor_walk(segs, 128))


def test_derived_maps_are_built_on_the_registered_twin():
    """A twin of a different forest makes every derived map that forest's: proof the twin, not the tensors, built
    them (a real twin holds the same values, so its results cannot tell)."""
    segs = tree_segments(LENS, PARENTS)
    other = tree_segments(OTHER_LENS, OTHER_PARENTS)
    own = _derived(segs)
    assert host_twin(segs) is None  # CPU segments get no twin from tree_segments
    register_host_twin(segs, other)
    assert host_twin(segs) is other
    for got, want, own_map in zip(_derived(segs), _derived(other), own):
        assert torch.equal(got, want)
        assert not torch.equal(got, own_map)  # each map tells the two forests apart


def test_a_modified_or_replaced_tensor_drops_the_twin():
    segs = tree_segments(LENS, PARENTS)
    register_host_twin(segs, tree_segments(OTHER_LENS, OTHER_PARENTS))
    copy = segs._replace(parent=segs.parent.clone())  # same values, another tensor
    assert host_twin(copy) is None
    segs.subtree_end.add_(0)  # an in-place op, even one that changes nothing, may have changed the values
    assert host_twin(segs) is None
    assert torch.equal(derived_on_host(segs, lambda s: s.seg_len + 1), segs.seg_len + 1)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_segments_derive_on_their_twin_the_same_bits():
    segs = tree_segments(LENS, PARENTS, "cuda")
    twin = host_twin(segs)
    assert twin is not None and twin.seg_start.device.type == "cpu"
    for t, h in zip(segs[:5], twin[:5]):
        assert torch.equal(t.cpu(), h)
    on_twin = _derived(segs)
    on_device = _derived(Segments(*(t.clone() for t in segs[:5]), *segs[5:]))  # other tensors: no twin
    for a, b in zip(on_twin, on_device):
        assert a.device == b.device and torch.equal(a, b)
