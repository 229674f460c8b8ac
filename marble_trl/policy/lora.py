"""The trainable and old-policy LoRA adapters on one transformer, and the parameter EMA.

DiffusionNFT keeps the old policy as a second LoRA adapter ("old") on the same transformer: rollouts and ``v_old``
use it, and after every optimizer step it moves towards the trained adapter,
``theta_old <- eta theta_old + (1 - eta) theta``. The reference model of the KL term is the transformer with all
adapters disabled.

peft's ``set_adapter`` / ``enable_adapters`` switch ``requires_grad`` on for the adapter they activate; the context
managers here restore the trainable flags on exit, so the optimizer and DDP see a stable set of trainable parameters.
They switch through a cached list of the transformer's LoRA layers (:class:`_Switch`) instead of diffusers' model-level
``set_adapter``, which walks every module on each call: a training timestep switches four times, and for a small model
those walks were about 5% of the step (a cProfile of the ShapesBench step, docs/shapesbench.md).

Precision: every adapter is float32 whatever the base model's dtype (peft would create them in the dtype of the layer
they wrap, bf16 for SD3.5 in bf16). The forward runs under autocast; the optimizer then updates float32 weights, and
the soft update ``eta old + (1 - eta) theta`` is exact to float32 (in bf16 a 3e-4 step on a weight of 0.03 is below one
ulp, and at ``eta = 0.999`` the update was 17% off). Under DeepSpeed bf16, which casts every parameter of the module to
bf16, :class:`OldPolicy` keeps the old adapter's float32 master and reads the trainable adapter's float32 master
weights from the optimizer (:func:`master_weights`).
"""

from __future__ import annotations

import contextlib
import copy
import warnings
from collections.abc import Iterator

import torch
from torch import nn

from ..distributed import copy_full_, full_tensor, gathered, is_deepspeed_param, is_fsdp_module, reshard

TRAIN_ADAPTER = "default"
OLD_ADAPTER = "old"
ADAPTER_DTYPE = torch.float32


def lora_parameters(module: nn.Module, adapter: str) -> dict[str, nn.Parameter]:
    """``{name: parameter}`` of one LoRA adapter (names contain ``.<adapter>.``); under FSDP2 the sharded ones."""
    reshard(module)
    tag = f".{adapter}."
    return {n: p for n, p in module.named_parameters() if tag in n and "lora_" in n}


def add_policy_adapters(transformer: nn.Module, lora_config) -> None:
    """Add the trainable adapter and the old-policy adapter (an exact copy, frozen), both float32 whatever the base
    model's dtype; freeze everything else."""
    transformer.requires_grad_(False)
    transformer.add_adapter(lora_config, adapter_name=TRAIN_ADAPTER)
    with warnings.catch_warnings():
        # peft warns that a second adapter is being added: here that is the point (the old policy).
        warnings.filterwarnings("ignore", message="Already found a `peft_config` attribute", category=UserWarning)
        transformer.add_adapter(copy.deepcopy(lora_config), adapter_name=OLD_ADAPTER)
    transformer.set_adapter(TRAIN_ADAPTER)
    train, old = lora_parameters(transformer, TRAIN_ADAPTER), lora_parameters(transformer, OLD_ADAPTER)
    if not train:
        raise ValueError(
            "The LoRA config matched no module of the transformer: check lora_target_modules "
            f"(got {getattr(lora_config, 'target_modules', None)})."
        )
    with torch.no_grad():
        for param in [*train.values(), *old.values()]:
            if param.dtype != ADAPTER_DTYPE:  # peft matched the base layer's dtype (bf16 / fp16)
                param.data = param.data.to(ADAPTER_DTYPE)
        for name, param in train.items():
            old[_old_name(name)].copy_(param)
    _set_trainable(transformer)


def _old_name(train_name: str) -> str:
    return train_name.replace(f".{TRAIN_ADAPTER}.", f".{OLD_ADAPTER}.")


def _set_trainable(transformer: nn.Module) -> None:
    for name, param in transformer.named_parameters():
        param.requires_grad_(f".{TRAIN_ADAPTER}." in name and "lora_" in name)


def _trainable_flags(transformer: nn.Module) -> list[tuple[nn.Parameter, bool]]:
    return [(p, f".{TRAIN_ADAPTER}." in n and "lora_" in n) for n, p in transformer.named_parameters()]


class _Switch:
    """The transformer's peft LoRA layers and the trainable flag of every parameter, found once: switching adapters
    then costs one call per LoRA layer. Rebuilt when the set of adapters (``peft_config``) changes."""

    def __init__(self, transformer: nn.Module) -> None:
        from peft.tuners.tuners_utils import BaseTunerLayer

        self.adapters = tuple(getattr(transformer, "peft_config", {}))
        self.layers = [m for m in transformer.modules() if isinstance(m, BaseTunerLayer)]
        # FSDP2 swaps the registered parameters (sharded / gathered, and new ones when it wraps the model): there the
        # flags are restored on whatever the module holds at the time, never on a cached list.
        self.transformer = transformer
        self.fsdp = is_fsdp_module(transformer)
        self.trainable = None if self.fsdp else _trainable_flags(transformer)

    @classmethod
    def of(cls, transformer: nn.Module) -> _Switch:
        switch = transformer.__dict__.get("_marble_adapter_switch")
        adapters = tuple(getattr(transformer, "peft_config", {}))
        if switch is None or switch.adapters != adapters or switch.fsdp != is_fsdp_module(transformer):
            switch = cls(transformer)
            transformer.__dict__["_marble_adapter_switch"] = switch  # a plain attribute: not a submodule
        return switch

    def activate(self, adapter: str) -> None:
        for layer in self.layers:
            layer.set_adapter(adapter)

    def enable(self, enabled: bool) -> None:
        for layer in self.layers:
            layer.enable_adapters(enabled)

    def restore_trainable(self) -> None:
        for param, flag in self.trainable if self.trainable is not None else _trainable_flags(self.transformer):
            if param.requires_grad != flag:
                param.requires_grad_(flag)


@contextlib.contextmanager
def use_old_policy(transformer: nn.Module) -> Iterator[None]:
    """Run the transformer with the old-policy adapter active."""
    switch = _Switch.of(transformer)
    switch.activate(OLD_ADAPTER)
    try:
        yield
    finally:
        switch.activate(TRAIN_ADAPTER)
        switch.restore_trainable()


@contextlib.contextmanager
def use_reference(transformer: nn.Module) -> Iterator[None]:
    """Run the pretrained transformer (every adapter disabled): the reference of the KL term."""
    switch = _Switch.of(transformer)
    switch.enable(False)
    try:
        yield
    finally:
        switch.enable(True)
        switch.activate(TRAIN_ADAPTER)
        switch.restore_trainable()


def master_weights(params: dict[str, nn.Parameter]) -> dict[str, torch.Tensor]:
    """Float32 values of trainable ``params``: DeepSpeed's float32 master copy when it holds one (bf16 / fp16 training
    casts the module's parameters down and keeps the float32 weights in the optimizer), else the parameters
    themselves. Under ZeRO-3 call it inside :func:`~marble_trl.distributed.gathered` (every process)."""
    return {name: master_weight(param) for name, param in params.items()}


def master_weight(param: nn.Parameter) -> torch.Tensor:
    """One parameter's float32 value (:func:`master_weights`; under DeepSpeed bf16 / fp16 a collective: every process
    calls it for the same parameters in the same order)."""
    full = None
    if param.dtype != torch.float32 and is_deepspeed_param(param):
        from deepspeed.utils import safe_get_full_fp32_param

        full = safe_get_full_fp32_param(param)
    return (full if full is not None else param.detach()).float()


class OldPolicy:
    """The old-policy adapter's soft update, ``theta_old <- eta theta_old + (1 - eta) theta``, in float32.

    The adapter itself is the float32 truth (:func:`add_policy_adapters`) except under DeepSpeed bf16 / fp16, which
    casts it to the training dtype: a float32 master copy is then kept here (taken at the first update, when the
    old adapter still equals the trainable one DeepSpeed's own master copy started from), updated, and written back
    rounded. The rounding happens only where the adapter is used, in bf16 forwards: the update itself loses nothing.
    """

    def __init__(self) -> None:
        self.master: dict[str, torch.Tensor] | None = None

    def reset(self) -> None:
        self.master = None

    @torch.no_grad()
    def update(self, transformer: nn.Module, eta: float) -> None:
        """``theta_old <- eta theta_old + (1 - eta) theta`` (eta = 0 copies the trained adapter)."""
        old = lora_parameters(transformer, OLD_ADAPTER)
        train = lora_parameters(transformer, TRAIN_ADAPTER)
        # ZeRO-3 may partition both adapters: gather them (on every process), write, and re-partition from rank 0.
        with gathered([*train.values(), *old.values()], modifier_rank=0):
            theta = master_weights(train)
            if self.master is None and any(p.dtype != torch.float32 for p in old.values()):
                self.master = {name: param.detach().float().clone() for name, param in old.items()}
            for name, value in theta.items():
                target = old[_old_name(name)]
                exact = self.master[_old_name(name)] if self.master is not None else target
                exact.mul_(eta).add_(value.to(exact.device), alpha=1.0 - eta)
                if exact is not target:
                    target.copy_(exact)

    def load_master(self, path, old: dict[str, nn.Parameter]) -> None:
        """After a resume: the old adapter's float32 values from its checkpoint file become the master copy when the
        adapter itself is not float32 (DeepSpeed bf16 / fp16); else there is none (the adapter is the truth)."""
        self.master = None
        if all(p.dtype == torch.float32 for p in old.values()):
            return
        from safetensors.torch import load_file

        from ..artifacts import lora_key

        state = load_file(str(path))
        self.master = {name: state[lora_key(name, OLD_ADAPTER)].float().to(p.device) for name, p in old.items()}

    def master_state(self) -> dict[str, torch.Tensor] | None:
        """The float32 master copy of the old adapter by parameter name, or None when the adapter itself is float32."""
        return None if self.master is None else {name: t.detach().cpu().clone() for name, t in self.master.items()}


@torch.no_grad()
def soft_update_old_policy(transformer: nn.Module, eta: float) -> None:
    """``theta_old <- eta theta_old + (1 - eta) theta`` on float32 adapters (see :class:`OldPolicy` for bf16 ones)."""
    OldPolicy().update(transformer, eta)


class LoraEMA:
    """EMA of the trainable LoRA weights (of every trained weight under full fine-tuning: :class:`~.full.FullEMA`) (float32, whole on every process, also under ZeRO-3 and FSDP2), for
    evaluation and export only; never used in the loss."""

    def __init__(self, transformer: nn.Module) -> None:
        params = self._params(transformer)
        self.shadow = {n: full_tensor(p.detach()).float().clone() for n, p in params.items()}  # FSDP2: gathered

    def _params(self, transformer: nn.Module) -> dict[str, nn.Parameter]:
        """The weights averaged: the trainable adapter's (full fine-tuning overrides this)."""
        return lora_parameters(transformer, TRAIN_ADAPTER)

    @torch.no_grad()
    def update(self, transformer: nn.Module, decay: float) -> None:
        params = self._params(transformer)
        with gathered(params.values()):  # ZeRO-3: read the full (gathered) weights, on every process
            for name, param in params.items():  # one float32 master at a time (a full fine-tune's are the model's)
                value = full_tensor(master_weight(param))  # FSDP2: gathered, on every process
                self.shadow[name].mul_(decay).add_(value.to(self.shadow[name].device), alpha=1.0 - decay)

    def state_dict(self) -> dict[str, torch.Tensor]:
        return dict(self.shadow)

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        missing = set(self.shadow) - set(state)
        if missing:
            raise KeyError(f"Parameter-EMA state lacks {len(missing)} LoRA weights, e.g. {sorted(missing)[0]!r}.")
        for name in self.shadow:
            self.shadow[name].copy_(state[name])

    @contextlib.contextmanager
    def swapped_in(self, transformer: nn.Module) -> Iterator[None]:
        """Temporarily load the EMA weights into the trainable adapter."""
        params = self._params(transformer)
        backup = {n: p.detach().clone() for n, p in params.items()}
        with torch.no_grad():
            for name, param in params.items():
                copy_full_(param, self.shadow[name])  # FSDP2: this process's shard
        try:
            yield
        finally:
            with torch.no_grad():
                for name, param in params.items():
                    param.copy_(backup[name])
