"""``kernels/device``: one capability and SM-count query per device, whatever the calls (CPU: the query is stubbed)."""

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


def test_sm_count_is_asked_once_per_device(monkeypatch):
    asked = []

    class Props:
        def __init__(self, n):
            self.multi_processor_count = n

    def fake(index):
        asked.append(index)
        return Props(132 if index == 0 else 78)

    monkeypatch.setattr(torch.cuda, "get_device_properties", fake)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    device.sm_count_of.cache_clear()
    try:
        assert device.sm_count(torch.device("cuda", 0)) == 132
        assert device.sm_count(torch.device("cuda")) == 78
        assert device.sm_count(torch.device("cuda", 0)) == 132 and device.sm_count(torch.device("cuda", 1)) == 78
        assert asked == [0, 1]
    finally:
        device.sm_count_of.cache_clear()
