"""The flat per-reward gradient buffers of the gradient engines (:mod:`marble_trl.balance.engines`): their layout,
the concatenation of the trainable parameters' gradients in list order, sized by each parameter's whole shape also
when it is sharded (:func:`whole_shape`, :func:`unflatten`), and the engines' common base (the ``[K, P]`` buffers in at
least float32, ``reset``, the checks of ``accumulate``'s inputs, the KL term's ordinary backward).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn


def whole_shape(p: Tensor) -> torch.Size:
    """A parameter's whole shape, also when it is sharded: a DeepSpeed ZeRO-3 partition (``ds_shape``; outside a
    gather its data is empty) or an FSDP2 ``DTensor`` (whose ``shape`` is the whole one)."""
    shape = getattr(p, "ds_shape", None)
    return torch.Size(shape) if shape is not None else p.shape


def unflatten(flat: Tensor, params: list[nn.Parameter]) -> list[Tensor]:
    """Views of a flat ``[P]`` vector (a buffer row, or a combined direction) shaped like ``params``, in order."""
    out, offset = [], 0
    for p in params:
        shape = whole_shape(p)
        out.append(flat[offset : offset + shape.numel()].view(shape))
        offset += shape.numel()
    return out


def _buffer_dtype(params: list[nn.Parameter]) -> torch.dtype:
    # Accumulate in at least float32 (bf16/fp16 sums over many micro-batches lose the Gram's small entries);
    # keep float64 when the model is float64 (tests compare to 1e-10).
    dtype = torch.float32
    for p in params:
        dtype = torch.promote_types(dtype, p.dtype)
    return dtype


class _EngineBase:
    def __init__(self, params: list[nn.Parameter], num_rewards: int) -> None:
        if num_rewards < 1:
            raise ValueError(f"num_rewards must be >= 1, got {num_rewards}.")
        if not params:
            raise ValueError("A gradient engine needs at least one trainable parameter.")
        if len({id(p) for p in params}) != len(params):
            raise ValueError("params contains the same parameter twice.")
        self.params = list(params)
        self.num_rewards = num_rewards
        self._offsets: dict[int, int] = {}
        offset = 0
        for p in self.params:
            self._offsets[id(p)] = offset
            offset += whole_shape(p).numel()  # sharded parameters: sized without gathering them
        self._buffers = torch.zeros(
            num_rewards, offset, dtype=_buffer_dtype(self.params), device=self.params[0].device
        )
        self._capturing = False

    @property
    def buffers(self) -> Tensor:
        """``[K, P]``: row k = the accumulated ``scale * grad sum_i l_k`` of ``params``, flat, in list order."""
        return self._buffers

    def reset(self) -> None:
        """Zero the buffers in place (the allocation is kept)."""
        self._buffers.zero_()

    def _check_inputs(self, loss_pos: Tensor, loss_neg: Tensor, r: Tensor, weights: Tensor | None = None) -> None:
        if not self._capturing:
            raise RuntimeError("accumulate() must be called inside `with engine.capture(module):`.")
        if loss_pos.ndim != 1 or loss_pos.shape != loss_neg.shape:
            raise ValueError(
                f"loss_pos/loss_neg must both be [B]; got {tuple(loss_pos.shape)}, {tuple(loss_neg.shape)}."
            )
        if r.shape != (self.num_rewards, loss_pos.shape[0]):
            raise ValueError(f"r must be [K={self.num_rewards}, B={loss_pos.shape[0]}], got {tuple(r.shape)}.")
        if weights is not None and weights.shape != r.shape:
            raise ValueError(f"weights must be [K, B] like r {tuple(r.shape)}, got {tuple(weights.shape)}.")

    @staticmethod
    def _backward_extra(extra_loss: Tensor | None) -> None:
        # The KL term goes to .grad exactly like loss.backward() would put it there (the trainer adds it to d_final).
        if extra_loss is not None and extra_loss.requires_grad:
            extra_loss.backward()
