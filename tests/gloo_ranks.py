"""Run a function on N CPU ranks (gloo), as the distributed tests do: ``spawn(fn, *args, world=N)`` calls
``fn(rank, *args)`` in each rank's process after ``init_process_group``; a failing assertion in a rank fails
``mp.spawn`` with that rank's traceback. One thread per rank."""

from __future__ import annotations

import gc
import os
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

__all__ = ["spawn"]


def spawn(fn, *args, world: int = 2):
    # A file store, not a TCP store: rank 0 hosting the TCP store's server
    # thread aborted now and then at exit ("terminate called without an
    # active exception") when the other rank disconnected at the same time.
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_init_and_run, args=(fn, os.path.join(tmp, "store"), args, world), nprocs=world, join=True)


def _init_and_run(rank, fn, store_path, args, world):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store_path}", rank=rank, world_size=world)
    try:
        fn(rank, *args)
    finally:
        # Free what holds the group (FSDP state, device meshes, compiled graphs) before teardown, not at exit.
        torch._dynamo.reset()
        gc.collect()
        dist.barrier()
        dist.destroy_process_group()
