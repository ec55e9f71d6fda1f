"""A stub, named as such: a CPU platform for veRL 0.9, so its real FSDP engine runs in CPU tests.

veRL 0.9 knows CUDA, NPU and ROCm platforms only; on a machine without an accelerator it falls back to
"nvidia" and its engine calls ``torch.cuda.set_device``. This registers the least a platform needs to
answer for the engine's forward/backward on CPU (device name "cpu", gloo, no-op device management),
before veRL's engine modules read the device name at import. Nothing else of veRL is replaced.
"""

from __future__ import annotations

import contextlib

import torch


def install() -> None:
    """Make veRL's platform the CPU stub. Call before importing ``verl.workers.engine``."""
    from verl.plugin.platform import platform_manager
    from verl.plugin.platform.platform_base import PlatformBase

    class PlatformCPUStub(PlatformBase):
        device_name = "cpu"
        vendor_name = "cpu"
        device_module = torch.cpu

        def is_available(self):
            return True

        def current_device(self):
            return "cpu"  # veRL moves batches with .to(get_device_id())

        def device_count(self):
            return 1

        def set_device(self, device_index):
            pass

        def synchronize(self, device_index=None):
            pass

        def manual_seed(self, seed):
            torch.manual_seed(seed)

        manual_seed_all = manual_seed

        def set_allocator_settings(self, settings):
            pass

        def empty_cache(self):
            pass

        def get_device_capability(self, device_index=0):
            return None, None

        def communication_backend_name(self):
            return "gloo"

        def visible_devices_envvar(self):
            return "CUDA_VISIBLE_DEVICES"

        def nvtx_range(self, msg):
            return contextlib.nullcontext()

        def profiler_start(self):
            pass

        def profiler_stop(self):
            pass

        def ray_resource_name(self):
            return "CPU"

        def ray_noset_envvars(self):
            return []

        def is_ipc_supported(self):
            return False

        def cudart(self):
            return None

    current = platform_manager._current_platform
    if current is None or current.device_name != "cpu":
        platform_manager._current_platform = PlatformCPUStub()
