"""DeepSpeed specifics of :class:`~marble_trl.MarbleDiffusionNFTTrainer` (see ``docs/distributed.md``).

One NFT micro-batch is ``T`` forward/backward passes, one per training timestep (``T`` = the sampler's sigma grid
times ``timestep_fraction``), so one optimizer step is ``GA * T`` backward calls. Under DeepSpeed:

- accelerate's ``backward`` runs ``engine.backward`` and, when ``accelerator.sync_gradients`` is set (the Trainer sets
  it for the whole last micro-batch), ``engine.step()``, with the engine's accumulation boundary forced to that flag.
  :func:`backward` therefore keeps ``sync_gradients`` off for all but the last timestep of the last micro-batch:
  exactly one optimizer step, after all ``GA * T`` backward calls;
- the loss is already scaled by ``1 / (GA * T)``; the engine's own division by its ``gradient_accumulation_steps``
  is switched off (``scale_wrt_gas=False``, as transformers' Trainer does);
- the DeepSpeed config's ``gradient_accumulation_steps`` is set to ``GA * T`` (and ``train_batch_size`` to match), so
  the ZeRO code that counts backward calls per step (gradient partitions, CPU offload accumulation) sees the truth;
- the gradient of a step lives in DeepSpeed's partitions, not in ``.grad``: MARBLE refresh steps cannot write the
  hand-made Eq. 7 direction into ``.grad``. They are solved first instead (:mod:`marble_trl.trainer.solve_first`):
  the per-reward gradients of every (micro-batch, timestep) pair (``torch.autograd.grad`` through the unwrapped
  module, which DeepSpeed never sees), the QP, then the step's ordinary DeepSpeed backward passes with Prop. 1's
  advantage and scale, whose gradient is Eq. 7's update (``marble_refresh_update='advantage'`` still trains the
  refresh step on the previous coefficients, as everywhere);
- ZeRO-3 partitions every parameter of the transformer (the LoRA adapters included): reading or writing the LoRA
  outside a forward (saving, the old-policy update, the parameter EMA) goes through :func:`gathered`.

FSDP2 (accelerate ``fsdp_version: 2``, torch's ``fully_shard``) turns every parameter of the transformer into a
``DTensor`` sharded on dim 0: element-wise updates between adapters (the old policy, the EMA) work shard by shard as
they are; whole values are read with :func:`full_tensor` (a collective: every process) and written with
:func:`copy_full_`.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterable, Iterator

import torch
from accelerate.utils import DistributedType

logger = logging.getLogger(__name__)


def num_train_timesteps(num_sigmas: int, timestep_fraction: float) -> int:
    """Training timesteps per sample (= backward calls per micro-batch); the rule of the trainer's rollout step."""
    return max(1, int(num_sigmas * timestep_fraction))


def deepspeed_without_accelerator() -> bool:
    """Whether ``accelerate launch`` started a multi-process DeepSpeed run on a machine without CUDA
    (``DS_ACCELERATOR=cpu``): there accelerate chooses no process-group backend unless told one, and then counts
    every process as the only one (``world_size`` 1, each rank its own main process, DeepSpeed's batch-size check
    fails), which the config fixes by choosing ``gloo``."""
    import os

    if os.environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() != "true" or torch.cuda.is_available():
        return False
    return int(os.environ.get("WORLD_SIZE", "1")) > 1


def is_deepspeed(accelerator) -> bool:
    return accelerator.distributed_type == DistributedType.DEEPSPEED


def configure_deepspeed(config: dict, args, num_sigmas: int) -> None:
    """Adapt the DeepSpeed ``config`` (the plugin's ``deepspeed_config``) to the per-timestep backward loop (called in
    the trainer's ``__init__``, before ``train()`` builds the engine)."""
    # Creating the Trainer's DeepSpeed config re-registered transformers' global ZeRO-3 flag: off again.
    disable_zero3_init()
    backwards = args.gradient_accumulation_steps * num_train_timesteps(num_sigmas, args.timestep_fraction)
    config["gradient_accumulation_steps"] = backwards
    config["train_batch_size"] = args.per_device_train_batch_size * backwards * args.world_size


def backward(accelerator, loss: torch.Tensor, last_of_micro_batch: bool) -> None:
    """``accelerator.backward`` for one training timestep. Under DeepSpeed, only the last backward of the optimizer
    step is an accumulation boundary (it runs ``engine.step()``), and the engine does not rescale the loss."""
    if not is_deepspeed(accelerator):
        accelerator.backward(loss)
        return
    state = accelerator.gradient_state
    boundary = state.sync_gradients
    state._set_sync_gradients(boundary and last_of_micro_batch)
    try:
        accelerator.backward(loss, scale_wrt_gas=False)
    finally:
        state._set_sync_gradients(boundary)


def is_fsdp(accelerator) -> bool:
    return accelerator.distributed_type == DistributedType.FSDP


def configure_fsdp(accelerator) -> None:
    """Check and adapt accelerate's FSDP plugin before the model is prepared (called in the trainer's ``__init__``).

    - Only FSDP2 is a strategy here: FSDP1's flat parameters hide the LoRA weights the gradient engine needs.
    - Under bf16 / fp16, accelerate's FSDP2 policy casts every parameter and every forward input to that dtype and
      reduce-scatters the gradients in it. Cast inputs include the timestep (SD3's ``1000 sigma`` in bf16 is off
      by up to 2), and the float32 LoRA and norms would compute in bf16. Here the parameters are gathered in their
      own dtypes, the inputs are left alone and autocast decides, as under DDP, and the gradients are reduced in
      float32 (the adapters are float32, ``docs/distributed.md``).
    """
    if not is_fsdp(accelerator):
        if os.environ.get("ACCELERATE_USE_FSDP", "false").lower() in ("1", "true"):
            # accelerate drops FSDP silently where it does not apply (one process; CPU processes).
            logger.warning(
                "The accelerate config asks for FSDP (distributed_type: FSDP), but accelerate runs %d %s process(es) "
                "as %s: this run does NOT shard the transformer; every process holds all of it, as under DDP. FSDP2 "
                "needs at least 2 processes on GPUs (--num_processes N); for one GPU use recipes/accelerate/"
                "single_gpu.yaml.",
                accelerator.num_processes,
                accelerator.device.type,
                accelerator.distributed_type,
            )
        return
    plugin = accelerator.state.fsdp_plugin
    version = getattr(plugin, "fsdp_version", 1)
    if version != 2:
        raise ValueError(
            f"FSDP version {version} is not supported: set `fsdp_version: 2` in the accelerate config's fsdp_config "
            "(recipes/accelerate/fsdp2.yaml), or use DDP or DeepSpeed."
        )
    if plugin.mixed_precision_policy is not None:
        from torch.distributed.fsdp import MixedPrecisionPolicy

        plugin.mixed_precision_policy = MixedPrecisionPolicy(reduce_dtype=torch.float32)


def is_dtensor(t: torch.Tensor) -> bool:
    """Whether ``t`` is an FSDP2 shard (a ``DTensor``)."""
    from torch.distributed.tensor import DTensor

    return isinstance(t, DTensor)


def is_fsdp_module(module: torch.nn.Module) -> bool:
    """Whether ``module`` is an FSDP2 unit (``fully_shard`` has wrapped it)."""
    from torch.distributed.fsdp import FSDPModule

    return isinstance(module, FSDPModule)


def reshard(module: torch.nn.Module) -> None:
    """FSDP2: put every FSDP module of ``module`` in its sharded state (nothing for other modules). A forward leaves
    the root module's parameters gathered (torch's default for the root), and then the module holds whole temporary
    tensors instead of the sharded parameters the optimizer updates; read or write parameters only after this."""
    if is_fsdp_module(module):
        for m in module.modules():
            if is_fsdp_module(m):
                m.reshard()


def shard_trained_modules_outside_blocks(transformer: torch.nn.Module, accelerator) -> None:
    """FSDP2: make every LoRA layer outside the blocks accelerate will wrap its own FSDP unit (under full fine-tuning:
    every top-level module outside them with trained weights), before accelerate wraps the rest.

    Left to accelerate, such a layer (SD3's root-level ``proj_out``, say) joins the root unit, and after the per-reward
    engine's backward passes FSDP left the root's gradient without its reduce-scatter (the cosine steps of the tiny
    recipe trained with ``grad_norm`` 0.0021 against 0.0267). As a unit of its own it is gathered, freed and reduced
    like a block. The blocks are accelerate's: the plugin's ``transformer_cls_names_to_wrap``, else the model's
    ``_no_split_modules``."""
    from peft.tuners.tuners_utils import BaseTunerLayer
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    plugin = accelerator.state.fsdp_plugin
    blocks = set(plugin.transformer_cls_names_to_wrap or getattr(transformer, "_no_split_modules", None) or [])
    block_names = [n for n, m in transformer.named_modules() if type(m).__name__ in blocks]
    outside = [
        m
        for name, m in transformer.named_modules()
        if isinstance(m, BaseTunerLayer)
        and not is_fsdp_module(m)
        and not any(name.startswith(b + ".") for b in block_names)
    ]
    full = not outside
    if full:  # full fine-tuning: each top-level module outside the blocks that holds trained weights
        outside = [
            m
            for name, m in transformer.named_children()
            if not is_fsdp_module(m)
            and any(p.requires_grad for p in m.parameters())
            and not any(b == name or b.startswith(name + ".") for b in block_names)
        ]
    kwargs = {
        "reshard_after_forward": plugin.reshard_after_forward,
        "mp_policy": plugin.mixed_precision_policy or MixedPrecisionPolicy(),
        "offload_policy": plugin.cpu_offload,
    }
    if full:
        # Kept gathered between forward and backward: resharded after the forward, the per-reward engine's backward
        # through these small units read a freed gather (context_embedder and proj_out of tiny SD3, together).
        kwargs["reshard_after_forward"] = False
    for module in outside:
        fully_shard(module, **kwargs)


def root_unit_parameters(module: torch.nn.Module, params: Iterable[torch.nn.Parameter]) -> list[int]:
    """FSDP2: the indices in ``params`` of the parameters held by ``module``'s own (root) unit rather than by a child
    unit (a wrapped block). Empty when ``module`` is not an FSDP module."""
    if not is_fsdp_module(module):
        return []
    in_child = {id(p) for m in module.modules() if m is not module and is_fsdp_module(m) for p in m.parameters()}
    return [i for i, p in enumerate(params) if id(p) not in in_child]


def full_tensor(t: torch.Tensor) -> torch.Tensor:
    """The whole value of ``t``: an FSDP2 ``DTensor`` is all-gathered (every process must call this), any other
    tensor is returned as it is."""
    return t.full_tensor() if is_dtensor(t) else t


def shard_like(value: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """``value`` (a whole tensor, the same on every process) laid out like ``like``: this process's shard as a
    ``DTensor`` when ``like`` is one (no communication), else ``value`` itself; on ``like``'s device and dtype."""
    value = value.to(device=like.device, dtype=like.dtype)
    if not is_dtensor(like):
        return value
    from torch.distributed.tensor import distribute_tensor

    return distribute_tensor(value, like.device_mesh, like.placements, src_data_rank=None)


def whole_state_dict(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """FSDP2: ``module``'s whole state dict, gathered into host memory on the main process (every process must call
    this; the others get an empty dict)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    reshard(module)
    return get_model_state_dict(module, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


@torch.no_grad()
def copy_full_(param: torch.Tensor, value: torch.Tensor) -> None:
    """``param.copy_(value)`` for a whole ``value`` (from a file, the same on every process), sharded or not."""
    param.copy_(shard_like(value, param))


@contextlib.contextmanager
def zero3_init_disabled() -> Iterator[None]:
    """Build models as plain modules while a DeepSpeed ZeRO-3 config is active.

    Under ``accelerate launch`` with ZeRO-3, creating the ``TrainingArguments`` registers transformers' global ZeRO-3
    flag, and every transformers model built afterwards (``from_pretrained``) is partitioned by
    ``deepspeed.zero.Init``. That is wrong for the frozen models here (CLIP/T5 text encoders, reward models): they are
    not in the DeepSpeed engine, so nothing would gather their weights for a forward. Only the transformer is
    partitioned, when the engine is built. Also usable as a decorator."""
    try:
        from transformers.integrations import deepspeed as hf_deepspeed
    except ImportError:  # pragma: no cover - transformers is a dependency
        yield
        return
    ref = hf_deepspeed._hf_deepspeed_config_weak_ref
    config = ref() if ref is not None else None
    hf_deepspeed.unset_hf_deepspeed_config()
    try:
        yield
    finally:
        if config is not None:
            hf_deepspeed.set_hf_deepspeed_config(config)


def disable_zero3_init() -> None:
    """Switch transformers' global ZeRO-3 flag off for the rest of the process (see :func:`zero3_init_disabled`):
    reward models may load lazily, at their first call, in the middle of training."""
    try:
        from transformers.integrations.deepspeed import unset_hf_deepspeed_config
    except ImportError:  # pragma: no cover
        return
    unset_hf_deepspeed_config()


def check_frozen_models_not_partitioned(pipeline) -> None:
    """Frozen pipeline components built under ``deepspeed.zero.Init`` have empty weights outside any engine."""
    for name, component in getattr(pipeline, "components", {}).items():
        if name == "transformer" or not isinstance(component, torch.nn.Module):
            continue
        if any(is_zero3(p) for p in component.parameters()):
            raise ValueError(
                f"The {type(pipeline).__name__}'s {name} was built partitioned by DeepSpeed ZeRO-3 "
                "(deepspeed.zero.Init), but it is not part of the DeepSpeed engine, so its weights would never be "
                "gathered. Load the pipeline with marble_trl.models.load_model (any family; or build it inside "
                "marble_trl.distributed.zero3_init_disabled())."
            )


def is_zero3(param: torch.Tensor) -> bool:
    """A DeepSpeed ZeRO-3 parameter: its value is the flat partition ``param.ds_tensor`` outside a gather (DeepSpeed
    gives it ``ds_id`` with the partition)."""
    return hasattr(param, "ds_id")


def is_deepspeed_param(param: torch.Tensor) -> bool:
    """Whether DeepSpeed manages ``param``: ZeRO-3 parameters carry ``ds_id``; ZeRO-1/2 and bf16 link each parameter
    to its optimizer state (``_hp_mapping``: None on the processes whose partition holds none of it, which still take
    part in the collectives that read it, so only its presence counts)."""
    return is_zero3(param) or hasattr(param, "_hp_mapping")


def partitioned(params: Iterable[torch.nn.Parameter]) -> list[torch.nn.Parameter]:
    """The DeepSpeed ZeRO-3 partitions among ``params`` (their data is empty outside a gather)."""
    return [p for p in params if is_zero3(p)]


def not_gathered(params: Iterable[torch.nn.Parameter]) -> list[torch.nn.Parameter]:
    """The ZeRO-3 partitions among ``params`` whose whole value is not gathered right now."""
    parts = partitioned(params)
    if not parts:
        return []
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

    return [p for p in parts if p.ds_status == ZeroParamStatus.NOT_AVAILABLE]


def wait_in_flight(params: Iterable[torch.nn.Parameter], root: torch.nn.Module | None) -> None:
    """Wait for the ZeRO-3 all-gathers in flight among ``params`` (a prefetch DeepSpeed started: the parameter's data
    already points at the buffer being filled). The handle stays registered: DeepSpeed's own wait on it is a no-op."""
    registry = getattr(root, "ds_inflight_param_registry", None) if root is not None else None
    for param in partitioned(params):
        if registry is not None and param in registry:
            registry[param].wait()


@contextlib.contextmanager
def gathered(params: Iterable[torch.nn.Parameter], modifier_rank: int | None = None) -> Iterator[None]:
    """ZeRO-3: gather the partitioned ``params`` for the block (every rank must enter it; with ``modifier_rank``,
    that rank's in-place changes are partitioned back on exit). Without ZeRO-3: nothing."""
    parts = partitioned(params)
    if not parts:
        yield
        return
    import deepspeed

    with deepspeed.zero.GatheredParameters(parts, modifier_rank=modifier_rank):
        yield


def non_finite_tensors(tensors: dict[str, torch.Tensor], all_processes: bool = False) -> list[str]:
    """Names of the tensors holding a NaN or an infinity. FSDP2 shards (``DTensor``) are checked on every process
    with one all-reduce, so every process gets the same answer (a DTensor's own ``isfinite().all()`` is a pending
    partial reduction, which ``bool()`` reads as this process's part alone): every process must call this then.
    ``all_processes``: the tensors are each process's own parts (ZeRO-3 partitions): the verdict is all-reduced over
    every process (each must call this with the same names)."""
    names = [n for n, t in tensors.items() if t.is_floating_point()]
    local = [t.to_local() if is_dtensor(t) else t for t in (tensors[n] for n in names)]
    finite = torch.tensor([bool(torch.isfinite(t).all()) for t in local], dtype=torch.float32)
    sharded = next((tensors[n] for n in names if is_dtensor(tensors[n])), None)
    if sharded is not None:
        finite = finite.to(local[0].device)
        torch.distributed.all_reduce(finite, op=torch.distributed.ReduceOp.MIN, group=sharded.device_mesh.get_group())
    elif all_processes and torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1:
        finite = finite.to(local[0].device if local else "cpu")
        torch.distributed.all_reduce(finite, op=torch.distributed.ReduceOp.MIN)
    return [n for n, ok in zip(names, finite.tolist()) if not ok]
