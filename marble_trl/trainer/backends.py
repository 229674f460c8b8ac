"""The back-ends of a training step (:class:`Backend`): one process or DDP, DeepSpeed (ZeRO 1-3), FSDP2. Each answers
the capability questions the trainer asks instead of branching on the launcher, and forms the step's gradients:

- :class:`PlainBackward` (one process or DDP): the per-reward gradients (MARBLE refresh steps and the cosine
  diagnostic) and the update come from one forward through the unwrapped module, which the gradient engine
  back-propagates itself (the step's gradients are all-reduced by hand in :meth:`PlainBackward.all_reduce`);
- :class:`DeepSpeedBackward`: DeepSpeed hooks every backward through its engine's outputs, so the per-reward gradients
  get a forward of their own through the unwrapped module, which DeepSpeed never sees, and the update goes through the
  DeepSpeed engine (:func:`marble_trl.distributed.backward`: one optimizer step per ``GA x T`` backward calls);
- :class:`FSDPBackward` (FSDP2): the transformer is its own wrapper, so everything runs through it as in one process;
  FSDP's hooks gather each block's weights for the forward and the engine's backward passes (which read layer inputs
  and output gradients, never the weights) and reduce-scatter ``.grad`` into this process's shard, so only the
  per-reward buffers are all-reduced by hand, and Eq. 7's update is added to ``.grad`` shard by shard.

:func:`make_backend` picks one from the accelerator.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal, Protocol

import torch

from ..balance import GradientEngine, unflatten
from ..distributed import (
    backward,
    configure_deepspeed,
    configure_fsdp,
    full_tensor,
    is_deepspeed,
    is_fsdp,
    shard_like,
    shard_trained_modules_outside_blocks,
)
from ..policy.nft import NFTTerms


@dataclass(frozen=True)
class LossSettings:
    """The loss's hyperparameters (from the config), read by every timestep."""

    nft_beta: float
    beta: float  # KL weight
    adv_clip_max: float
    refresh_update: str  # marble_refresh_update
    masked_solve: bool = False  # marble_masked_solve: per-reward gradients of a refresh average applicable samples


def engine_scale(settings: LossSettings, scale: float, batch_size: int) -> float:
    """The per-reward sums' weight: the NFT loss's ``A_max / nft_beta`` prefactor and its mean over samples."""
    return settings.adv_clip_max / settings.nft_beta * scale / batch_size


class Backend(Protocol):
    """What the trainer asks of a back-end (the capabilities, then the step's gradient operations)."""

    name: str
    accelerator: object
    owns_gradients: bool
    reduces_update_gradient: bool
    checkpoint_owner: Literal["trainer", "deepspeed", "fsdp"]

    @property
    def can_skip_step(self) -> bool: ...

    @property
    def shards_transformer(self) -> bool: ...

    @property
    def update_row_in_engine(self) -> bool: ...

    def configure(self, args, num_sigmas: int) -> None: ...

    def before_prepare(self, transformer: torch.nn.Module) -> None: ...

    def release_gathered(self) -> None: ...

    def per_reward_r(self, r_k: torch.Tensor, r: torch.Tensor, mode: str) -> torch.Tensor: ...

    def timestep(
        self,
        model,
        transformer,
        forward: Callable,
        engine: GradientEngine | None,
        plan_mode: str,
        settings: LossSettings,
        r_k: torch.Tensor | None,
        scale: float,
        last: bool,
        weights: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, NFTTerms, torch.Tensor]: ...

    def ordinary(self, model, forward: Callable, scale: float, last: bool): ...

    def average_buffers(self, buffers: torch.Tensor) -> None: ...

    def all_reduce(self, buffers: torch.Tensor, params: list[torch.nn.Parameter]) -> None: ...

    def update_and_rows(self, buffers: torch.Tensor, params: list[torch.nn.Parameter]): ...

    def apply_update(self, update: torch.Tensor, params: list[torch.nn.Parameter]) -> None: ...


class PlainBackward:
    """One process or DDP (accelerate's ``backward``; ``no_sync`` on all but a micro-batch's last timestep)."""

    name = "plain"
    owns_gradients = False  # the update's gradient is this process's .grad, to edit, check and skip
    reduces_update_gradient = False  # the engine bypasses DDP: .grad is all-reduced by hand (all_reduce)
    checkpoint_owner = "trainer"  # transformers' Trainer writes and restores the whole checkpoint

    def __init__(self, accelerator) -> None:
        self.accelerator = accelerator

    @property
    def can_skip_step(self) -> bool:
        """Whether a non-finite step can be dropped before the optimizer moves (the guard zeroes ``.grad``)."""
        return not self.owns_gradients

    @property
    def shards_transformer(self) -> bool:
        """Whether each forward of the transformer gathers its weights from every process (so every process must
        run every forward: sample grids, Hub samples)."""
        return False

    @property
    def update_row_in_engine(self) -> bool:
        """Whether the cosine diagnostic's update gradient is an extra row of the per-reward engine (it is not in
        ``.grad``)."""
        return self.owns_gradients

    def configure(self, args, num_sigmas: int) -> None:
        """Adapt accelerate's plugin before ``train()`` prepares the model (the trainer's constructor)."""
        configure_fsdp(self.accelerator)  # refuses an FSDP launch that accelerate dropped silently

    def before_prepare(self, transformer: torch.nn.Module) -> None:
        """Just before accelerate wraps the transformer."""

    def release_gathered(self) -> None:
        """Drop the gathered copies of partitioned weights kept between forwards (ZeRO-3); nothing elsewhere (FSDP2
        reshards through the module: :func:`~marble_trl.distributed.reshard`)."""

    def per_reward_r(self, r_k: torch.Tensor, r: torch.Tensor, mode: str) -> torch.Tensor:
        return r_k

    def timestep(
        self,
        model,
        transformer: torch.nn.Module,
        forward: Callable,
        engine: GradientEngine | None,
        plan_mode: str,
        settings: LossSettings,
        r_k: torch.Tensor | None,
        scale: float,
        last: bool,
        weights: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, NFTTerms, torch.Tensor]:
        """One timestep's forward(s) and backward; returns ``(v_theta, terms, loss)`` of the update's forward
        (``weights``: a masked solve's per-reward sample weights for the engine)."""
        if engine is None:
            return self.ordinary(model, forward, scale, last)
        # Forward through the unwrapped module: the engine back-propagates itself (DDP is bypassed).
        with engine.capture(transformer):
            v_theta, terms, loss = forward(transformer)
            if plan_mode == "refresh" and settings.refresh_update == "gradient":
                extra = settings.beta * terms.kl.mean() * scale if settings.beta > 0 else None  # Eq. 8: KL apart
            else:
                extra = loss * scale
            weight = engine_scale(settings, scale, terms.loss_pos.shape[0])
            engine.accumulate(terms.loss_pos, terms.loss_neg, r_k, scale=weight, extra_loss=extra, weights=weights)
        return v_theta, terms, loss

    def ordinary(self, model, forward: Callable, scale: float, last: bool):
        """The update's forward through ``model`` (the DDP / DeepSpeed wrapper) and its backward; gradients are
        synchronised on a micro-batch's last timestep only."""
        context = contextlib.nullcontext() if last else self.accelerator.no_sync(model)
        with context:
            v_theta, terms, loss = forward(model)
            backward(self.accelerator, loss * scale, last_of_micro_batch=last)
        return v_theta, terms, loss

    def average_buffers(self, buffers: torch.Tensor) -> None:
        """Average the per-reward buffers over the processes."""
        world = self.accelerator.num_processes
        if world > 1:
            torch.distributed.all_reduce(buffers)
            buffers.div_(world)

    def all_reduce(self, buffers: torch.Tensor, params: list[torch.nn.Parameter]) -> None:
        """Average the per-reward buffers over the processes, and the update's ``.grad`` unless the back-end has
        reduced it itself (here DDP was bypassed: by hand)."""
        world = self.accelerator.num_processes
        if world == 1:
            return
        self.average_buffers(buffers)
        if self.reduces_update_gradient:
            return
        for p in params:
            if p.grad is not None:
                torch.distributed.all_reduce(p.grad)
                p.grad.div_(world)

    def update_and_rows(self, buffers: torch.Tensor, params: list[torch.nn.Parameter]):
        """The step's update (its flat gradient, KL included) and the per-reward rows, for the cosine diagnostic."""
        flat = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1).float() for p in params])
        return flat, buffers

    def apply_update(self, update: torch.Tensor, params: list[torch.nn.Parameter]) -> None:
        """Add MARBLE's Eq. 7 direction to ``.grad`` (which holds the KL term's gradient)."""
        for p, chunk in zip(params, unflatten(update, params)):
            chunk = chunk.to(device=p.device, dtype=p.dtype)
            p.grad = chunk.clone() if p.grad is None else p.grad.add_(chunk)


class DeepSpeedBackward(PlainBackward):
    """DeepSpeed (ZeRO 1-3): the update's gradient lives in DeepSpeed's partitions, not in ``.grad``, and the engine
    steps inside the backward (a non-finite step cannot be skipped)."""

    name = "deepspeed"
    owns_gradients = True
    reduces_update_gradient = True
    checkpoint_owner = "deepspeed"  # the engine saves and restores its partitions (and the adapter it trains)

    @property
    def shards_transformer(self) -> bool:
        plugin = getattr(self.accelerator.state, "deepspeed_plugin", None)
        return getattr(plugin, "zero_stage", 0) == 3

    @property
    def zero_config(self) -> dict:
        """The DeepSpeed config's ``zero_optimization`` section."""
        plugin = getattr(self.accelerator.state, "deepspeed_plugin", None)
        return dict((getattr(plugin, "deepspeed_config", None) or {}).get("zero_optimization") or {})

    def release_gathered(self) -> None:
        # ZeRO-3 keeps persistent and prefetched parameters gathered between forwards: its optimizer releases them all
        # (the engine's empty_partition_cache would also run gc.collect and empty the allocator's cache, per swap)
        if not self.shards_transformer:
            return
        wrapped = getattr(self.accelerator, "deepspeed_engine_wrapped", None)
        if wrapped is None:
            raise RuntimeError(
                "ZeRO-3: the DeepSpeed engine is not built yet; partitions cannot be swapped before it."
            )
        wrapped.engine.optimizer.empty_partition_cache()

    def configure(self, args, num_sigmas: int) -> None:
        super().configure(args, num_sigmas)
        configure_deepspeed(self.accelerator.state.deepspeed_plugin.deepspeed_config, args, num_sigmas)

    def per_reward_r(self, r_k: torch.Tensor, r: torch.Tensor, mode: str) -> torch.Tensor:
        # The cosine diagnostic needs the update's own (KL-free) gradient: the engine computes it as a last row.
        return torch.cat([r_k, r[None]]) if mode == "cosines" else r_k

    def timestep(self, model, transformer, forward, engine, plan_mode, settings, r_k, scale, last, weights=None):
        if engine is not None:
            with engine.capture(transformer):
                _, terms_k, _ = forward(transformer)
                weight = engine_scale(settings, scale, terms_k.loss_pos.shape[0])
                engine.accumulate(terms_k.loss_pos, terms_k.loss_neg, r_k, scale=weight, weights=weights)
            del terms_k
        return self.ordinary(model, forward, scale, last)

    def update_and_rows(self, buffers, params):
        return buffers[-1].float(), buffers[:-1]  # the update's gradient without the KL term: the engine's last row

    def apply_update(self, update, params):
        raise RuntimeError("DeepSpeed owns the gradients: its 'gradient' refreshes are solved first (solve_first).")


class FSDPBackward(PlainBackward):
    """FSDP2: ``.grad`` holds this process's shard of the averaged gradient (FSDP reduce-scatters it in the backward)."""

    name = "fsdp2"
    reduces_update_gradient = True
    checkpoint_owner = "fsdp"  # the optimizer's sharded state; the adapters are the checkpoint's LoRA files

    @property
    def shards_transformer(self) -> bool:
        return True

    def before_prepare(self, transformer: torch.nn.Module) -> None:
        # The LoRA layers outside the blocks become units of their own just before accelerate wraps the rest
        # (marble_trl.distributed); forwards before this point (the CLI's sample grid) run on the plain module.
        shard_trained_modules_outside_blocks(transformer, self.accelerator)

    def update_and_rows(self, buffers, params):
        # Every process gathers the whole gradient (the cosines are computed alike everywhere).
        grads = [
            full_tensor(p.grad) if p.grad is not None else torch.zeros(p.shape, device=buffers.device) for p in params
        ]
        return torch.cat([g.reshape(-1).float() for g in grads]), buffers

    def apply_update(self, update: torch.Tensor, params: list[torch.nn.Parameter]) -> None:
        """Add this process's shard of MARBLE's Eq. 7 direction (the same on every process) to ``.grad``."""
        for p, chunk in zip(params, unflatten(update, params)):
            chunk = shard_like(chunk, p)
            p.grad = chunk.clone() if p.grad is None else p.grad.add_(chunk)


def make_backend(accelerator) -> Backend:
    """The back-end of a launch: DeepSpeed, FSDP2, or plain (one process or DDP)."""
    if is_deepspeed(accelerator):
        return DeepSpeedBackward(accelerator)
    if is_fsdp(accelerator):
        return FSDPBackward(accelerator)
    return PlainBackward(accelerator)
