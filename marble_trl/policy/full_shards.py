"""This process's shards of full fine-tuning's copies of the trained weights (the old policy, the reference, the
parameter EMA) when the trained weights themselves are sharded: FSDP2 ``DTensor`` shards, or DeepSpeed ZeRO-3
partitions.

The copies are built from the whole weights before the model is sharded (``fully_shard`` at ``prepare`` turns every
parameter into a ``DTensor``; the ZeRO-3 engine empties every parameter and keeps a flat partition, ``ds_tensor``). At
their first use after that, :meth:`ShardedCopies.localise` replaces each whole copy by this process's shard of it (in
the copy's own dtype, on the parameter's device): a plain tensor shaped like ``param.to_local()`` under FSDP2, or like
``param.ds_tensor`` under ZeRO-3 (this rank's slice of the flattened weight, zero-padded as DeepSpeed pads its last
partition). So no process keeps a whole copy on the accelerator. :meth:`ShardedCopies.whole` gathers them back for a
checkpoint (a collective: every process calls it) and :meth:`ShardedCopies.load` cuts a checkpoint's whole tensors
into shards. With whole parameters every method leaves the copies whole.
"""

from __future__ import annotations

import torch
from torch import nn

from ..distributed import is_dtensor, is_zero3


def is_sharded(params: dict[str, nn.Parameter]) -> bool:
    """Whether the parameters are FSDP2 shards (``DTensor``) or ZeRO-3 partitions."""
    return any(is_dtensor(p) or is_zero3(p) for p in params.values())


def local_part(param: nn.Parameter) -> torch.Tensor:
    """The parameter's own shard as a plain tensor: ``to_local()`` of a ``DTensor``, ``ds_tensor`` under ZeRO-3."""
    return param.ds_tensor if is_zero3(param) else param.to_local()


def _zero3_rank(param: nn.Parameter) -> tuple[int, int]:
    import torch.distributed as dist

    group = param.ds_process_group
    return dist.get_rank(group=group), dist.get_world_size(group=group)


def local_shard(value: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """This process's shard of the whole ``value`` (the same on every process) laid out like the sharded parameter
    ``like``, as a plain tensor in ``value``'s dtype on ``like``'s device (no communication)."""
    value = value.detach()
    if is_zero3(like):
        part = like.ds_tensor
        size = part.numel()
        rank, _ = _zero3_rank(like)
        flat = value.reshape(-1)
        out = torch.zeros(size, dtype=value.dtype, device=part.device)
        start, end = rank * size, min((rank + 1) * size, flat.numel())
        if end > start:
            out[: end - start].copy_(flat[start:end])
        return out
    from torch.distributed.tensor import distribute_tensor

    value = value.to(like.device)
    return distribute_tensor(value, like.device_mesh, like.placements, src_data_rank=None).to_local().clone()


def valid(shard: torch.Tensor, like: nn.Parameter) -> torch.Tensor:
    """The part of this process's shard that holds weights: under ZeRO-3 the partition without DeepSpeed's padding
    (its float32 masters' padding is uninitialised memory), else the shard itself."""
    if not is_zero3(like):
        return shard
    rank, _ = _zero3_rank(like)
    size = shard.numel()
    return shard[: max(0, min(size, like.ds_numel - rank * size))]


def whole_of(shard: torch.Tensor, like: nn.Parameter, keep: bool = True) -> torch.Tensor | None:
    """The whole tensor of the shards laid out like ``like`` (``shard`` is this process's), on the CPU where ``keep``
    (None elsewhere; a collective: every process calls it)."""
    if is_zero3(like):
        import torch.distributed as dist

        _, world = _zero3_rank(like)
        parts = [torch.empty_like(shard) for _ in range(world)]
        dist.all_gather(parts, shard.contiguous(), group=like.ds_process_group)
        return torch.cat(parts)[: like.ds_numel].view(like.ds_shape).cpu() if keep else None
    from torch.distributed.tensor import DTensor

    spread = DTensor.from_local(shard, like.device_mesh, like.placements, shape=like.shape, stride=like.stride())
    whole = spread.full_tensor()
    return whole.cpu() if keep else None


class ShardedCopies:
    """Which dicts of copies (``{parameter name: tensor}``) hold this process's shards instead of whole tensors."""

    def __init__(self) -> None:
        self._local: set[int] = set()  # id() of the dicts holding shards (one registry for every copy of a policy)

    def localise(self, copies: dict[str, torch.Tensor], params: dict[str, nn.Parameter]) -> None:
        """Replace the whole ``copies`` by their shards, once, when ``params`` are shards."""
        if id(copies) in self._local or not is_sharded(params):
            return
        for name, param in params.items():
            copies[name] = local_shard(copies[name], param)
        self._local.add(id(copies))

    def whole(
        self, copies: dict[str, torch.Tensor], params: dict[str, nn.Parameter], keep: bool = True
    ) -> dict[str, torch.Tensor]:
        """Whole CPU copies of ``copies`` (gathered from the shards: every process must call this; only where
        ``keep`` are they kept, one at a time, so the others hold no host copy)."""
        if id(copies) not in self._local:
            return {name: t.detach().cpu().clone() for name, t in copies.items()} if keep else {}
        out = {}
        for name, param in params.items():
            value = whole_of(copies[name], param, keep)
            if keep:
                out[name] = value
        return out

    @torch.no_grad()
    def load(
        self, copies: dict[str, torch.Tensor], state: dict[str, torch.Tensor], params: dict[str, nn.Parameter]
    ) -> None:
        """Set ``copies`` from the whole tensors ``state`` (a checkpoint's), as shards where they are sharded."""
        for name, value in state.items():
            if id(copies) in self._local:
                copies[name] = local_shard(value.to(copies[name].dtype), params[name])
            else:
                copies[name].copy_(value)
