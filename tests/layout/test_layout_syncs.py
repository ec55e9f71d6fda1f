"""The one host sync of dualkv_compile.layout.detect (and read_sequences), counted.

On CPU a TorchFunctionMode proxy counts the calls that would read device data
on the host (checked on its own first); on CUDA the sync debug mode counts the
real synchronizations, and the CUDA layout is compared with the CPU one.
"""

from __future__ import annotations

import weakref

import pytest
import torch
from torch.overrides import TorchFunctionMode

from dualkv_compile.layout import detect
from dualkv_compile.layout.sequences import read_sequences

from tests.helpers import cuda_syncs

from .layout_cases import MIXED_IDS, MIXED_MASK, VERL_IDS, VERL_MASK, T


pytestmark = pytest.mark.usefixtures("one_thread")


class _CountHostSyncs(TorchFunctionMode):
    """CPU proxy for device-to-host syncs: counts the calls that, on a CUDA
    tensor, read device data on the host (or wait for the device to size a
    result).

    Host tensors are tracked: ``.cpu()``'s result, factories called without a
    ``device`` (``torch.tensor(...)``, ``torch.arange(n)``) and whatever is
    computed from host tensors alone. Reading those costs no sync, nor does
    moving one to the device (a host-to-device copy, not counted here: the
    CUDA test below sees those). Anything else is taken to live on the device."""

    ALWAYS = {
        "tolist", "item", "__bool__", "__int__", "__float__", "__index__", "numpy",
        "nonzero", "argwhere", "masked_select", "unique", "unique_consecutive", "equal", "allclose",
        "__repr__", "__format__", "bincount",
    }
    FACTORIES = {"tensor", "as_tensor", "arange", "zeros", "ones", "full", "empty", "randint", "randn", "rand"}

    def __init__(self):
        super().__init__()
        self.syncs = []
        self._host = {}  # id -> weakref of host tensors

    def is_host(self, t):
        r = self._host.get(id(t))
        return r is not None and r() is t

    def _mark(self, out):
        for o in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(o, torch.Tensor):
                self._host[id(o)] = weakref.ref(o)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", str(func))
        inputs = [a for a in args if isinstance(a, torch.Tensor)]
        inputs += [t for a in args if isinstance(a, (list, tuple)) for t in a if isinstance(t, torch.Tensor)]
        inputs += [v for v in kwargs.values() if isinstance(v, torch.Tensor)]
        host = bool(inputs) and all(self.is_host(t) for t in inputs)
        self_t = args[0] if args and isinstance(args[0], torch.Tensor) else None
        hit = name in self.ALWAYS
        if name == "repeat_interleave" and kwargs.get("output_size") is None:
            hit = True
        if name in ("__getitem__", "__setitem__", "index_put_", "index_put") and len(args) > 1:
            idx = args[1] if isinstance(args[1], tuple) else (args[1],)
            hit |= any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in idx)
        if name in ("cpu", "to") and self_t is not None:
            hit = True
        if name == "tensor" and inputs:
            hit = True
        if hit and not host:
            self.syncs.append(name)
        out = func(*args, **kwargs)
        if name in ("cpu", "to") and out is self_t:
            out = out.clone()  # on CPU these return their input: stand for the copy a device would make
        if name == "cpu" or (name in self.FACTORIES and kwargs.get("device") is None and not inputs):
            self._mark(out)
        elif host and name != "to":  # a host tensor moved with .to(device) is on the device
            self._mark(out)
        return out


def test_proxy_counts_syncs():
    t = torch.arange(4)  # built outside the mode: a device tensor for the proxy
    with _CountHostSyncs() as c:
        t.tolist()
        bool(t[0])
        t[t > 1]
        t.nonzero()
        h = t.cpu()
        torch.tensor([1, 2]).to(t.device)  # host -> device: not counted
        # Reading host data is free: .cpu()'s result, host factories, and what they compute.
        h.tolist()
        int(h[1] + 1)
        (h > 1).nonzero().tolist()
        torch.where(h > 1, torch.arange(4), 0).amax().item()
        torch.tensor([3, 4]).tolist()
        # ... but not once moved to the device, nor when mixed with device data.
        torch.tensor([3, 4]).to(t.device).tolist()
        (h + t).tolist()
    assert c.syncs == ["tolist", "__bool__", "__getitem__", "nonzero", "cpu", "tolist", "tolist"]


# veRL remove-padding: one [1, total] row of four sequences, positions restarting, no mask.
PACKED_IDS = T([[1, 2, 3, 4, 1, 2, 3, 5, 1, 2, 9, 7, 7]])
PACKED_POS = T([[0, 1, 2, 3, 0, 1, 2, 3, 0, 1, 2, 0, 1]])


@pytest.mark.parametrize(
    "ids, kwargs",
    [
        (VERL_IDS, dict()),
        (VERL_IDS, dict(attention_mask=VERL_MASK)),
        (VERL_IDS, dict(attention_mask=VERL_MASK.bool(), position_ids=torch.arange(7).view(1, 7))),
        (VERL_IDS, dict(attention_mask=VERL_MASK, position_ids=(VERL_MASK.cumsum(1) - 1).clamp(min=0), group_size=3)),
        (VERL_IDS, dict(attention_mask=VERL_MASK, group_size=1, min_shared=2)),
        (MIXED_IDS, dict(attention_mask=MIXED_MASK)),
        (MIXED_IDS, dict(attention_mask=MIXED_MASK, min_shared=3, same_columns=False)),
        (PACKED_IDS, dict(position_ids=PACKED_POS, same_columns=False)),
        (PACKED_IDS, dict(position_ids=PACKED_POS)),
        (T([[0, 0, 0], [0, 0, 0]]), dict(attention_mask=T([[0, 0, 0], [0, 0, 0]]))),
    ],
    ids=["verl_no_mask", "verl", "verl_pos_1xS", "verl_hf_pos_group_size", "verl_min_shared", "mixed",
         "mixed_min_shared_any_column", "packed_row", "packed_row_same_columns", "all_padding"],
)
def test_detect_does_one_host_sync(ids, kwargs):
    with _CountHostSyncs() as c:
        detect(ids, **kwargs)
    assert c.syncs == ["cpu"], c.syncs


def test_read_sequences_does_one_host_sync():
    with _CountHostSyncs() as c:
        read_sequences(PACKED_IDS, None, PACKED_POS, same_columns=False)
    assert c.syncs == ["cpu"], c.syncs


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_detect_one_cuda_sync():
    dev = torch.device("cuda")
    cases = [
        (VERL_IDS.to(dev), VERL_MASK.to(dev), None, None, True),
        (MIXED_IDS.to(dev), MIXED_MASK.to(dev), torch.arange(6, device=dev).view(1, 6), None, True),
        (VERL_IDS.to(dev), VERL_MASK.to(dev), (VERL_MASK.to(dev).cumsum(1) - 1).clamp(min=0), 3, True),
        (PACKED_IDS.to(dev), None, PACKED_POS.to(dev), None, False),
    ]
    for ids, mask, pos, gs, same_columns in cases:
        detect(ids, mask, pos, group_size=gs, same_columns=same_columns)  # warm up (allocators, pinned memory)
        L, syncs = cuda_syncs(lambda: detect(ids, mask, pos, group_size=gs, same_columns=same_columns))
        assert len(syncs) <= 1, syncs
        assert L.pack_index.device.type == "cuda" and L.attention_segments.seg_start.device.type == "cuda"
        ref = detect(
            ids.cpu(), None if mask is None else mask.cpu(), None if pos is None else pos.cpu(),
            group_size=gs, same_columns=same_columns,
        )
        assert L.sequences == ref.sequences and L.nodes == ref.nodes
        for name in ("pack_index", "unpack_index", "valid"):
            assert torch.equal(getattr(L, name).cpu(), getattr(ref, name)), name
        for name in ("seg_start", "seg_len", "parent", "prefix_len", "subtree_end"):
            assert torch.equal(getattr(L.attention_segments, name).cpu(), getattr(ref.attention_segments, name)), name


def test_detect_reading_reads_riders_in_the_one_transfer():
    """Tensors the runtime needs on the host (the padding reads' factor masks) ride in the layout's one transfer and
    come back as int64 host copies of their values and shapes."""
    from dualkv_compile.layout.detect import detect_reading

    riders = (VERL_MASK.bool()[:, 1:], torch.tensor([[1], [0], [2]]))
    with _CountHostSyncs() as c:
        layout, read = detect_reading(VERL_IDS, VERL_MASK, also_read=riders)
    assert c.syncs == ["cpu"], c.syncs
    assert [r.dtype for r in read] == [torch.long, torch.long]
    for got, want in zip(read, riders):
        assert torch.equal(got, want.long())
    assert layout.sequences == detect(VERL_IDS, VERL_MASK).sequences


@pytest.mark.parametrize("value", [0.5, 2.0, -1.0])
def test_float_mask_values_other_than_0_and_1_are_refused(value):
    """The mask travels to the host as integers; a float 0.5 must not truncate to a valid 0."""
    mask = VERL_MASK.float()
    mask[0, -1] = value
    with pytest.raises(ValueError, match="attention_mask must hold only 0 and 1"):
        detect(VERL_IDS, mask)
