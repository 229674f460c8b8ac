"""FSDP2 shards of full fine-tuning's copies of the trained weights (the old policy, the reference, the parameter EMA).

The copies are built from the whole weights before accelerate shards the transformer (``fully_shard`` turns every
parameter into a ``DTensor`` at ``prepare``). At their first use after that, :meth:`ShardedCopies.localise` replaces
each whole copy by this process's shard of it (plain tensors shaped like ``param.to_local()``, in the copy's own
dtype, on the parameter's device), so no process keeps a whole copy on the accelerator; :meth:`ShardedCopies.whole`
gathers them back for a checkpoint (a collective: every process calls it) and :meth:`ShardedCopies.load` cuts a
checkpoint's whole tensors into shards. Without FSDP2 every method leaves the copies whole.
"""

from __future__ import annotations

import torch
from torch import nn

from ..distributed import is_dtensor


def is_sharded(params: dict[str, nn.Parameter]) -> bool:
    """Whether the parameters are FSDP2 shards (``DTensor``)."""
    return any(is_dtensor(p) for p in params.values())


def local_shard(value: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """This process's shard of the whole ``value`` (the same on every process) laid out like the ``DTensor``
    ``like``, as a plain tensor in ``value``'s dtype on ``like``'s device (no communication)."""
    from torch.distributed.tensor import distribute_tensor

    value = value.detach().to(like.device)
    return distribute_tensor(value, like.device_mesh, like.placements, src_data_rank=None).to_local().clone()


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

    def whole(self, copies: dict[str, torch.Tensor], params: dict[str, nn.Parameter]) -> dict[str, torch.Tensor]:
        """Whole CPU copies of ``copies`` (gathered from the shards: every process must call this)."""
        if id(copies) not in self._local:
            return {name: t.detach().cpu().clone() for name, t in copies.items()}
        from torch.distributed.tensor import DTensor

        out = {}
        for name, param in params.items():
            shard = copies[name]
            spread = DTensor.from_local(
                shard, param.device_mesh, param.placements, shape=param.shape, stride=param.stride()
            )
            out[name] = spread.full_tensor().cpu()
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
