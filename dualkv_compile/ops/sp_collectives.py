"""The collectives of Ulysses sequence parallelism, as ``dualkv::`` ops with fake implementations and autograd.

Under sequence parallelism (docs/design.md, semantics 13) rank ``r`` of ``world`` holds the packed tokens
``[r * Tl, (r + 1) * Tl)``. These ops move values between that sharded form and the whole stream; they are opaque
to Inductor (a blocking ``torch.distributed`` call inside), so a compiled graph calls them like any custom op and
traces with dynamic token counts. Gloo (CPU) and NCCL both run every call used here.

Gradient convention: the backward starts on every rank from the same replicated loss. A replicated value's
gradient is then the loss's whole gradient; a sharded value's gradient on a rank, and a parameter's, is ``world``
times its share, so the *mean* of a parameter's gradients over the group (what FSDP2 and DDP reduce) is the
gradient of the group's batch, as veRL's Ulysses scales it. Each op's backward keeps that convention:

    sp_all_gather(x, backward="slice")  sharded -> replicated (read by replicated code, the unpacked outputs):
                                        this rank's chunk of the gradient, times ``world``
    sp_all_gather(x, backward="sum")    sharded -> the whole stream, read by sharded code at other tokens (each
                                        token's predecessor): the partial gradients summed (reduce-scatter)
    sp_all_reduce                       a sum over this rank's tokens -> over all tokens: the gradient times ``world``
    sp_all_to_all                       tokens for heads and back: the inverse exchange
    sp_shard                            replicated -> this rank's chunk, where an activation input enters the
                                        packed stream: the chunks' gradients gathered, divided by ``world``
"""

from __future__ import annotations

from typing import NamedTuple

import torch

__all__ = ["SPGroup", "all_gather_flat", "process_group", "sp_shard", "sp_all_gather", "sp_all_reduce", "sp_all_to_all", "sp_reduce_scatter"]


class SPGroup(NamedTuple):
    """A sequence-parallel group as the graph passes and ops take it: plain values, no process group object."""

    world: int
    rank: int
    group_name: str

    @classmethod
    def of(cls, group) -> "SPGroup":
        """From a ``ProcessGroup`` or a 1-D ``DeviceMesh``; ``ValueError`` names what was expected."""
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()):
            raise ValueError("sequence_parallel needs an initialised torch.distributed process group")
        try:
            from torch.distributed.device_mesh import DeviceMesh
        except ImportError:  # pragma: no cover - every supported torch has it
            DeviceMesh = ()
        if isinstance(group, DeviceMesh):
            if group.ndim != 1:
                raise ValueError(
                    f"sequence_parallel must be a ProcessGroup or a 1-D DeviceMesh (the sequence-parallel dimension, "
                    f"mesh['sp']), got a {group.ndim}-D DeviceMesh"
                )
            group = group.get_group()
        if not isinstance(group, dist.ProcessGroup):
            raise ValueError(f"sequence_parallel must be a ProcessGroup, a 1-D DeviceMesh or None, got {type(group).__name__}")
        return cls(dist.get_world_size(group), dist.get_rank(group), group.group_name)


def process_group(group_name: str):
    """The process group of that name (its ops take names: plain values for graphs and custom op schemas)."""
    from torch.distributed.distributed_c10d import _resolve_process_group

    return _resolve_process_group(group_name)


def all_gather_flat(out: torch.Tensor, x: torch.Tensor, group) -> None:
    """Every rank's ``x`` concatenated along dim 0 into ``out`` (torch 2.13 renamed the call ``all_gather_single``)."""
    import torch.distributed as dist

    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    gather(out, x, group=group)


def _gather(x: torch.Tensor, dim: int, world: int, group_name: str) -> torch.Tensor:
    xm = x.movedim(dim, 0).contiguous()
    out = xm.new_empty((world * xm.shape[0], *xm.shape[1:]))
    all_gather_flat(out, xm, process_group(group_name))
    return out.movedim(0, dim).contiguous()


@torch.library.custom_op("dualkv::sp_all_gather", mutates_args=())
def sp_all_gather(x: torch.Tensor, dim: int, world: int, rank: int, group_name: str, backward: str) -> torch.Tensor:
    """The whole stream along ``dim`` (chunks in rank order); ``backward`` "slice" or "sum" (module docstring)."""
    return _gather(x, dim, world, group_name)


@sp_all_gather.register_fake
def _(x, dim, world, rank, group_name, backward):
    shape = list(x.shape)
    shape[dim] = shape[dim] * world
    return x.new_empty(shape)


def _gather_setup(ctx, inputs, output):
    _, ctx.dim, ctx.world, ctx.rank, ctx.group_name, ctx.mode = inputs


def _gather_backward(ctx, grad):
    if ctx.mode == "slice":
        n = grad.shape[ctx.dim] // ctx.world
        g = grad.narrow(ctx.dim, ctx.rank * n, n) * ctx.world
    else:
        g = sp_reduce_scatter(grad, ctx.dim, ctx.world, ctx.rank, ctx.group_name)
    return g, None, None, None, None, None


sp_all_gather.register_autograd(_gather_backward, setup_context=_gather_setup)


@torch.library.custom_op("dualkv::sp_reduce_scatter", mutates_args=())
def sp_reduce_scatter(x: torch.Tensor, dim: int, world: int, rank: int, group_name: str) -> torch.Tensor:
    """This rank's chunk along ``dim`` of the sum of ``x`` over the group."""
    import torch.distributed as dist

    xm = x.movedim(dim, 0).contiguous()
    out = xm.new_empty((xm.shape[0] // world, *xm.shape[1:]))
    dist.reduce_scatter_tensor(out, xm, group=process_group(group_name))
    return out.movedim(0, dim).contiguous()


@sp_reduce_scatter.register_fake
def _(x, dim, world, rank, group_name):
    shape = list(x.shape)
    shape[dim] = shape[dim] // world
    return x.new_empty(shape)


def _reduce_scatter_backward(ctx, grad):
    return sp_all_gather(grad, ctx.dim, ctx.world, ctx.rank, ctx.group_name, "sum"), None, None, None, None


def _reduce_scatter_setup(ctx, inputs, output):
    _, ctx.dim, ctx.world, ctx.rank, ctx.group_name = inputs


sp_reduce_scatter.register_autograd(_reduce_scatter_backward, setup_context=_reduce_scatter_setup)


@torch.library.custom_op("dualkv::sp_all_reduce", mutates_args=())
def sp_all_reduce(x: torch.Tensor, world: int, group_name: str) -> torch.Tensor:
    """The sum of ``x`` over the group (a new tensor); the backward passes the gradient on times the group's size."""
    import torch.distributed as dist

    out = x.clone(memory_format=torch.contiguous_format)
    dist.all_reduce(out, group=process_group(group_name))
    return out


@sp_all_reduce.register_fake
def _(x, world, group_name):
    return torch.empty_like(x, memory_format=torch.contiguous_format)


def _all_reduce_setup(ctx, inputs, output):
    ctx.world = inputs[1]


sp_all_reduce.register_autograd(lambda ctx, grad: (grad * ctx.world, None, None), setup_context=_all_reduce_setup)


@torch.library.custom_op("dualkv::sp_all_to_all", mutates_args=())
def sp_all_to_all(x: torch.Tensor, scatter_dim: int, gather_dim: int, world: int, group_name: str) -> torch.Tensor:
    """Chunk ``i`` of ``x`` along ``scatter_dim`` goes to rank ``i``; the chunks received are joined along ``gather_dim``
    in rank order. ``x``: rank-4 ``[1, H, T, D]`` (heads for tokens: scatter 1, gather 2; and back)."""
    import torch.distributed as dist

    chunks = x.movedim(scatter_dim, 0)
    n = chunks.shape[0] // world
    send = chunks.reshape(world, n, *chunks.shape[1:]).contiguous()
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=process_group(group_name))
    # recv[i]: rank i's chunk, scatter_dim first; put it back in place and join along gather_dim.
    parts = [recv[i].movedim(0, scatter_dim) for i in range(world)]
    return torch.cat(parts, dim=gather_dim).contiguous()


@sp_all_to_all.register_fake
def _(x, scatter_dim, gather_dim, world, group_name):
    shape = list(x.shape)
    shape[scatter_dim] = shape[scatter_dim] // world
    shape[gather_dim] = shape[gather_dim] * world
    return x.new_empty(shape)


def _a2a_setup(ctx, inputs, output):
    _, ctx.scatter_dim, ctx.gather_dim, ctx.world, ctx.group_name = inputs


def _a2a_backward(ctx, grad):
    return sp_all_to_all(grad, ctx.gather_dim, ctx.scatter_dim, ctx.world, ctx.group_name), None, None, None, None


sp_all_to_all.register_autograd(_a2a_backward, setup_context=_a2a_setup)


@torch.library.custom_op("dualkv::sp_shard", mutates_args=())
def sp_shard(x: torch.Tensor, dim: int, world: int, rank: int, group_name: str) -> torch.Tensor:
    """This rank's chunk along ``dim`` of a replicated ``x`` (a new tensor); the backward gathers the chunks'
    gradients and divides by ``world``: a replicated input's whole gradient, on every rank."""
    n = x.shape[dim] // world
    return x.narrow(dim, rank * n, n).clone(memory_format=torch.contiguous_format)


@sp_shard.register_fake
def _(x, dim, world, rank, group_name):
    shape = list(x.shape)
    shape[dim] = shape[dim] // world
    return x.new_empty(shape)


def _shard_setup(ctx, inputs, output):
    _, ctx.dim, ctx.world, ctx.rank, ctx.group_name = inputs


def _shard_backward(ctx, grad):
    # Through the op, not _gather: a backward formula is traced, and a collective traced inline puts the
    # process group object into the backward graph (which AOTAutograd then fails to deep-copy).
    whole = sp_all_gather(grad, ctx.dim, ctx.world, ctx.rank, ctx.group_name, "slice")
    return whole / ctx.world, None, None, None, None


sp_shard.register_autograd(_shard_backward, setup_context=_shard_setup)
