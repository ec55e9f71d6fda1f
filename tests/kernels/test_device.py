"""``kernels/device.capability``: one query per device, whatever the calls (CPU: the query is stubbed)."""

from __future__ import annotations

import torch

from dualkv_compile.kernels import device


def test_capability_is_asked_once_per_device(monkeypatch):
    asked = []

    def fake(index):
        asked.append(index)
        return (9, 0) if index == 0 else (8, 6)

    monkeypatch.setattr(torch.cuda, "get_device_capability", fake)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    device.capability_of.cache_clear()
    try:
        assert device.capability(torch.device("cuda", 0)) == (9, 0)
        assert device.capability(torch.device("cuda", 0)) == (9, 0)
        assert device.capability(torch.device("cuda")) == (8, 6)  # no index: the current device, 1
        assert device.capability(torch.device("cuda", 1)) == (8, 6)
        assert asked == [0, 1]
    finally:
        device.capability_of.cache_clear()
