"""Full fine-tuning (``use_peft=False``): the transformer's own weights train, and the old policy and the reference
are frozen copies of them.

With LoRA the old policy is a second adapter and the reference is the transformer with its adapters disabled
(:mod:`.lora`). Without adapters both are whole copies of the trained weights:

- the **old policy** is a float32 copy of every trainable weight, soft-updated after each optimizer step,
  ``theta_old <- eta theta_old + (1 - eta) theta`` (DiffusionNFT), exact to float32 as for adapters;
- the **reference** (the KL term's, and ``generate(use_lora=False)``'s base model) is the weights as loaded, kept in
  their own dtype: a bf16 model's original bf16 tensors cost nothing extra (the trainable weights become float32
  copies), a float32 model's are cloned;
- their forwards swap the copy into the parameters' storage (``param.data = copy``: a pointer swap, no copy, O(1))
  and swap back on exit, so every forward of the model (the family adapter's ``predict``, the rollout sampler) runs
  unchanged on either set of weights. The trainable flags never change, so the optimizer and DDP see one set.

Under FSDP2 the parameters become ``DTensor`` shards after the policy is built: at their first use the copies become
this process's shards too (:mod:`.full_shards`; the whole copies built before sharding stay in host memory until
then), and a swap copies the copy's shard into the parameter's (the buffer FSDP gathers from) with every unit
resharded around it, so no process ever holds a whole copy on the accelerator.

Under DeepSpeed ZeRO-1/2 the parameters stay whole (views into DeepSpeed's flat buffer, which the swap restores), so
the pointer swap works as without it; with bf16 / fp16 DeepSpeed casts the module and keeps the float32 masters in its
optimizer: the soft update, the EMA and ``transformer/`` read those masters (:func:`~.lora.master_weight`), and a
swapped-in float32 copy is rounded to the module's dtype for the forward (a transient copy of the trained weights in
that dtype, as the LoRA's old adapter is rounded under DeepSpeed).

Under DeepSpeed ZeRO-3 the parameters are partitions (``ds_tensor``): the copies become this process's partitions
as under FSDP2, the soft update and the EMA read DeepSpeed's float32 master partitions, and a swap copies the copy's
partition into ``ds_tensor`` with every gathered weight released around it (:attr:`FullPolicy.release`, the engine's).
Parameter offload, ZeRO++'s secondary partitions and quantized weights are refused
(``trainer.setup.check_full_finetuning_backend``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence

import torch
from torch import nn

from ..distributed import is_deepspeed_param, is_fsdp_module, is_zero3, reshard, whole_state_dict
from .full_shards import ShardedCopies, is_sharded, local_part, valid, whole_of
from .lora import ADAPTER_DTYPE, LoraEMA, master_weight

POLICY_ATTRIBUTE = "_marble_full_policy"  # the policy on its transformer (a plain attribute, not a submodule)


def matches(name: str, targets: Sequence[str] | None) -> bool:
    """peft's rule for ``target_modules`` given as names: the module's name or its last components equal a target."""
    return targets is None or any(name == t or name.endswith("." + t) for t in targets)


def full_parameters(transformer: nn.Module, targets: Sequence[str] | None) -> dict[str, nn.Parameter]:
    """``{name: parameter}`` of the modules named by ``targets`` (every parameter of each, recursively), or of the
    whole transformer when ``targets`` is None."""
    if targets is None:
        return dict(transformer.named_parameters())
    out: dict[str, nn.Parameter] = {}
    for module_name, module in transformer.named_modules():
        if module_name and matches(module_name, targets):
            for name, param in module.named_parameters(prefix=module_name):
                out.setdefault(name, param)
    return out


def local_master(param: nn.Parameter) -> torch.Tensor:
    """This process's shard of a sharded trained weight in float32: FSDP2's local shard, or under ZeRO-3 DeepSpeed's
    float32 master partition (shaped like ``ds_tensor``)."""
    if is_zero3(param):
        from deepspeed.utils import safe_get_local_fp32_param

        return safe_get_local_fp32_param(param)
    return param.to_local()


def zero3_state_dict(transformer: nn.Module, trained: dict[str, nn.Parameter], keep: bool) -> dict[str, torch.Tensor]:
    """The whole state dict of a ZeRO-3 ``transformer`` on the CPU where ``keep`` (empty elsewhere; every process
    must call this): the trained weights from DeepSpeed's float32 masters, the frozen ones from their partitions, one
    parameter at a time."""
    out = {}
    for name, param in transformer.named_parameters():
        if is_zero3(param):
            value = whole_of(local_master(param) if name in trained else param.ds_tensor, param, keep)
        else:
            value = param.detach().cpu() if keep else None
        if keep:
            out[name] = value
    if keep:
        params = set(out)
        out.update({k: v.detach().cpu() for k, v in transformer.state_dict().items() if k not in params})
    return out


class FullPolicy:
    """The trainable weights of a fully fine-tuned transformer, their old-policy copy and the reference weights.

    Args:
        transformer: the model; every parameter not selected is frozen.
        targets: module names (``full_finetune_modules``), or None for every weight of the transformer.
    """

    kind = "full"

    def __init__(self, transformer: nn.Module, targets: Sequence[str] | None = None) -> None:
        transformer.requires_grad_(False)
        params = full_parameters(transformer, targets)
        if not params:
            raise ValueError(
                f"full_finetune_modules={list(targets or [])} matched no module of the transformer: name modules as "
                "lora_target_modules does (e.g. ['to_q', 'to_k', 'to_v', 'to_out.0']), or leave it unset to train "
                "every weight."
            )
        self.names = sorted(params)
        self.reference: dict[str, torch.Tensor] = {}
        with torch.no_grad():
            for name, param in params.items():
                loaded = param.data
                if loaded.dtype != ADAPTER_DTYPE:
                    param.data = loaded.to(ADAPTER_DTYPE)  # the trained weights are float32 (exact soft updates)
                    self.reference[name] = loaded  # the loaded bf16 / fp16 tensor itself: no copy
                else:
                    self.reference[name] = loaded.clone()
                param.requires_grad_(True)
        self.old = {name: param.detach().clone() for name, param in params.items()}
        self.shards = ShardedCopies()  # FSDP2 / ZeRO-3: the copies become this process's shards at their first use
        self.release: Callable[[], None] | None = None  # ZeRO-3: drops the engine's gathered weights (the trainer's)
        transformer.__dict__[POLICY_ATTRIBUTE] = self

    def sharded(self, transformer: nn.Module) -> bool:
        """Whether the trained weights are sharded (FSDP2 or DeepSpeed ZeRO-3): the copies are then this process's
        shards, and saving them gathers (every process must take part)."""
        return is_fsdp_module(transformer) or is_sharded(self.trainable(transformer))

    def trainable(self, transformer: nn.Module) -> dict[str, nn.Parameter]:
        """The trained parameters by name (the transformer's own names)."""
        params = dict(transformer.named_parameters())
        return {name: params[name] for name in self.names}

    @contextlib.contextmanager
    def swapped(self, transformer: nn.Module, weights: dict[str, torch.Tensor]) -> Iterator[None]:
        """Run the transformer on ``weights`` (by parameter name) instead of the trained ones.

        A copy left behind by a device move of the model (``Trainer`` / accelerate move the parameters, not these
        dicts) follows its parameter here, once. Autocast caches its low-precision copy of a float32 parameter by the
        parameter itself, which a ``.data`` swap keeps: the cache is cleared on both sides of the swap, or a second
        forward in the same autocast region (``v_ref`` after ``v_old``) would reuse the first one's weights."""
        if self.sharded(transformer):  # FSDP2 or ZeRO-3 (decided by the module: a forward can leave them gathered)
            with self._swapped_shards(transformer, weights):
                yield
            return
        params = self.trainable(transformer)
        saved: list[tuple[nn.Parameter, torch.Tensor]] = []
        torch.clear_autocast_cache()
        try:
            for name, param in params.items():
                if weights[name].device != param.device:
                    weights[name] = weights[name].to(param.device)
                value = weights[name]
                if value.dtype != param.dtype and is_deepspeed_param(param):
                    # DeepSpeed bf16 / fp16 casts the module and runs it without autocast: the forward takes the
                    # copy rounded to the module's dtype (as the LoRA's old adapter is under DeepSpeed)
                    value = value.to(param.dtype)
                saved.append((param, param.data))
                param.data = value
            yield
        finally:
            for param, data in reversed(saved):
                param.data = data
            torch.clear_autocast_cache()

    @contextlib.contextmanager
    def _swapped_shards(self, transformer: nn.Module, weights: dict[str, torch.Tensor]) -> Iterator[None]:
        """Sharded weights: copy ``weights``' shards into the parameters' own (the buffers the all-gather reads: FSDP2's
        local shard, ZeRO-3's ``ds_tensor``), every gathered copy released first so that none of the trained weights
        survives into the forward, and back."""
        self._release(transformer)
        params = self.trainable(transformer)
        self.shards.localise(weights, params)
        saved = {}
        torch.clear_autocast_cache()
        try:
            with torch.no_grad():
                for name, param in params.items():
                    local = local_part(param)
                    saved[name] = local.clone()
                    local.copy_(weights[name])  # (rounded to the partition's dtype under DeepSpeed bf16)
            yield
        finally:
            try:
                self._release(transformer)
            finally:  # the trained shards back even if the release failed
                with torch.no_grad():
                    for name, value in saved.items():
                        local_part(params[name]).copy_(value)
                torch.clear_autocast_cache()

    def _release(self, transformer: nn.Module) -> None:
        """Drop every gathered copy of the weights: FSDP2 reshards its units; under ZeRO-3, the engine's release of
        its gathered parameters (:attr:`release`, set by the trainer)."""
        reshard(transformer)
        if any(is_zero3(p) for p in self.trainable(transformer).values()):
            if self.release is None:
                raise RuntimeError(
                    "FullPolicy.release is unset under ZeRO-3: set it to the DeepSpeed engine's release of its gathered "
                    "parameters, engine.optimizer.empty_partition_cache (the trainer does)."
                )
            self.release()

    def use_old(self, transformer: nn.Module) -> contextlib.AbstractContextManager[None]:
        return self.swapped(transformer, self.old)

    def use_reference(self, transformer: nn.Module) -> contextlib.AbstractContextManager[None]:
        return self.swapped(transformer, self.reference)

    @torch.no_grad()
    def update(self, transformer: nn.Module, eta: float) -> None:
        """``theta_old <- eta theta_old + (1 - eta) theta`` in float32 (eta = 0 copies the trained weights)."""
        reshard(transformer)
        params = self.trainable(transformer)
        self.shards.localise(self.old, params)
        sharded = is_sharded(params)
        for name, param in params.items():
            if not sharded and self.old[name].device != param.device:  # the model moved after the policy was built
                self.old[name] = self.old[name].to(param.device)
            # DeepSpeed bf16 / fp16: its float32 master (ZeRO-1/2: a collective, every process updates every weight
            # in order); sharded: this process's shard of it (ZeRO-3: its padding left at zero)
            if sharded:
                valid(self.old[name], param).mul_(eta).add_(valid(local_master(param), param), alpha=1.0 - eta)
            else:
                self.old[name].mul_(eta).add_(master_weight(param), alpha=1.0 - eta)

    def saved_state(self, transformer: nn.Module, keep: bool = True) -> dict[str, torch.Tensor] | None:
        """The tensors ``transformer/`` is written from, or None to write the module as it is: under FSDP2 the whole
        state dict gathered from the shards (on the main process), under ZeRO-3 gathered from the partitions, under
        DeepSpeed bf16 / fp16 the module's with the trained weights' float32 masters in place of their rounded copies.
        Every process must call this (the gathers and DeepSpeed's master reads are collectives); ``keep``: this process
        writes the folder (the others get an empty dict and hold no host copy)."""
        if is_fsdp_module(transformer):
            return whole_state_dict(transformer)
        params = self.trainable(transformer)
        if is_sharded(params):  # ZeRO-3: every parameter gathered from its partitions, one at a time
            return zero3_state_dict(transformer, params, keep)
        if not any(p.dtype != ADAPTER_DTYPE and is_deepspeed_param(p) for p in params.values()):
            return None
        masters = {}
        for name, param in params.items():  # one at a time; the read is a collective
            value = master_weight(param)
            if keep:
                masters[name] = value.cpu()
        if not keep:
            return {}
        return {**{k: v.detach().cpu() for k, v in transformer.state_dict().items()}, **masters}

    def reset(self) -> None:
        """Nothing to forget: the old weights are the copy itself (LoRA's :class:`~.lora.OldPolicy` keeps a DeepSpeed
        master; here there is none)."""

    def master_state(self, transformer: nn.Module, keep: bool = True) -> dict[str, torch.Tensor]:
        """The old-policy weights by parameter name, as whole CPU copies (the checkpoint's ``old_policy.safetensors``;
        under FSDP2 / ZeRO-3 gathered: every process must call this, and only where ``keep`` gets them)."""
        return self.shards.whole(self.old, self.trainable(transformer), keep)

    @torch.no_grad()
    def load_old(self, state: dict[str, torch.Tensor], transformer: nn.Module) -> None:
        missing = sorted(set(self.names) - set(state))
        if missing:
            raise KeyError(f"The old-policy weights lack {len(missing)} trained tensors, e.g. {missing[0]!r}.")
        self.shards.load(self.old, {name: state[name] for name in self.names}, self.trainable(transformer))


def attached_policy(transformer: nn.Module) -> FullPolicy | None:
    """The :class:`FullPolicy` of a fully fine-tuned transformer, or None (LoRA)."""
    return transformer.__dict__.get(POLICY_ATTRIBUTE)


class FullEMA(LoraEMA):
    """The parameter EMA of a fully fine-tuned transformer: :class:`~.lora.LoraEMA` over the trained weights (it
    overrides ``_params``, the weights averaged, and ``swapped_in``, a pointer swap)."""

    def _params(self, transformer: nn.Module) -> dict[str, nn.Parameter]:
        return self._policy(transformer).trainable(transformer)

    @staticmethod
    def _policy(transformer: nn.Module) -> FullPolicy:
        policy = attached_policy(transformer)
        if policy is None:
            raise RuntimeError("FullEMA needs a fully fine-tuned transformer (FullPolicy attaches itself to it).")
        return policy

    def swapped_in(self, transformer: nn.Module) -> contextlib.AbstractContextManager[None]:
        """The EMA's weights swapped in by pointer (LoRA's copies the trained values aside: here that would be one
        more whole copy of the transformer)."""
        return self._policy(transformer).swapped(transformer, self.shadow)

    # Under FSDP2 and ZeRO-3 the shadow is this process's shards, tracked by the policy's registry with its other
    # copies (LoRA's EMA is whole on every process).
    @torch.no_grad()
    def update(self, transformer: nn.Module, decay: float) -> None:
        params = self._params(transformer)
        if not self._policy(transformer).sharded(transformer):
            for name, param in params.items():  # built on the host before the model moved: follow it, once
                if self.shadow[name].device != param.device:
                    self.shadow[name] = self.shadow[name].to(param.device)
            super().update(transformer, decay)
            return
        reshard(transformer)
        params = self._params(transformer)
        self._policy(transformer).shards.localise(self.shadow, params)
        for name, param in params.items():
            valid(self.shadow[name], param).mul_(decay).add_(valid(local_master(param), param), alpha=1.0 - decay)

    def state_dict(self, transformer: nn.Module | None = None, keep: bool = True) -> dict[str, torch.Tensor]:
        """Whole tensors by parameter name (under FSDP2 / ZeRO-3 gathered from the shards: every process must call this
        with the ``transformer``, and only where ``keep`` gets them; without it, the shadow as held)."""
        if transformer is None:
            return dict(self.shadow)
        return self._policy(transformer).shards.whole(self.shadow, self._params(transformer), keep)

    def load_state_dict(self, state: dict[str, torch.Tensor], transformer: nn.Module | None = None) -> None:
        missing = set(self.shadow) - set(state)
        if missing:
            raise KeyError(f"Parameter-EMA state lacks {len(missing)} trained weights, e.g. {sorted(missing)[0]!r}.")
        if transformer is None:
            super().load_state_dict(state)
            return
        policy = self._policy(transformer)
        policy.shards.load(self.shadow, {name: state[name] for name in self.shadow}, self._params(transformer))
