"""What the trainer's constructor resolves before it builds anything: the LoRA config, the rewards and their weights,
the aggregation, the evaluation rewards and the prompt sources' ratios. Each check names the field and the fix."""

from __future__ import annotations

import contextlib
import copy
import logging
from typing import Any

import torch

from ..data.prompts import GroupSampler, check_prompt_dataset
from ..data.source_images import SOURCE_IMAGES_COLUMN, SourceImageLoader, check_source_images
from ..data.sources import SOURCE_COLUMN
from ..models.editing import probe_sources, small_sources
from ..rewards import RewardFunc, check_reward_funcs, resolve_reward_funcs, reward_name

logger = logging.getLogger(__name__)

FROZEN_COMPONENTS = ("vae", "text_encoder", "text_encoder_2", "text_encoder_3")


def check_inputs(train_dataset, eval_dataset, reward_funcs, args) -> None:
    """The checks that can fail before the model loads: the datasets, the callable rewards' signatures (named ones are
    checked once resolved), a mixture's ``source_ratios``."""
    check_prompt_dataset(train_dataset)
    train_columns = getattr(train_dataset, "column_names", None)
    specs = [reward_funcs] if isinstance(reward_funcs, str) or callable(reward_funcs) else list(reward_funcs)
    check_reward_funcs([f for f in specs if callable(f)], columns=train_columns)
    source_indices(train_dataset, args.source_ratios)
    for name, dataset in eval_datasets(eval_dataset):
        check_prompt_dataset(dataset, name=name)


def lora_config(args, peft_config=None, default_targets: tuple[str, ...] = ()):
    """``peft_config``, or one built from the ``lora_*`` fields of ``args``; a zero ``lora_alpha`` is an error. Unset
    ``lora_target_modules`` become the family's ``default_targets``, written back into ``args`` (so resume checks
    and model cards see the modules trained)."""
    if args.lora_target_modules is None:
        args.lora_target_modules = list(default_targets)
    if peft_config is None:
        from peft import LoraConfig  # peft imports transformers' model zoo: only when the trainer builds one

        init = {"true": True, "false": False}.get(str(args.lora_init).lower(), args.lora_init)
        peft_config = LoraConfig(
            r=args.lora_r,
            lora_alpha=args.lora_alpha,
            lora_dropout=args.lora_dropout,
            init_lora_weights=init,
            target_modules=list(args.lora_target_modules),
        )
    if getattr(peft_config, "lora_alpha", None) == 0:
        raise ValueError(
            "peft_config.lora_alpha is 0: the adapter's output is scaled by lora_alpha / r, so training would never "
            "change the model. Use a positive lora_alpha (e.g. 2 r)."
        )
    return peft_config


def family_rewards(adapter, args, reward_funcs: list, eval_reward_funcs: list) -> tuple[list, list]:
    """The rewards as the family's samples need them: for a video family every reward wrapped in
    :class:`~marble_trl.rewards.video.VideoReward` (``video_reward_frames``) and the adapter's ``num_frames`` set;
    for an image family, an error for ``num_frames`` or a reward that only takes ``videos``."""
    from ..rewards.video import as_video_rewards, takes_images, takes_videos

    if adapter.video:
        if args.num_frames is not None:
            adapter.num_frames = args.num_frames
        return (as_video_rewards(reward_funcs, args.video_reward_frames),
                as_video_rewards(eval_reward_funcs, args.video_reward_frames))  # fmt: skip
    if args.num_frames is not None:
        raise ValueError(f"num_frames={args.num_frames} is for video families (Wan); {adapter.family} makes images.")
    for fn in [*reward_funcs, *eval_reward_funcs]:
        if takes_videos(fn) and not takes_images(fn):
            raise ValueError(
                f"Reward {reward_name(fn)!r} takes videos, but {adapter.family} makes images: use it with a video "
                "family (Wan), or give it an `images` parameter."
            )
    return reward_funcs, eval_reward_funcs


def check_resolution(resolution: int, factor: int) -> None:
    if resolution % factor:
        raise ValueError(
            f"resolution={resolution} must be a multiple of {factor} (VAE factor x patch size) for this pipeline."
        )


def training_rewards(reward_funcs, args, columns) -> tuple[list[RewardFunc], list[str], torch.Tensor]:
    """The resolved training rewards, their (unique) names and their weights (``reward_weights`` or ones)."""
    funcs = resolve_reward_funcs(reward_funcs, args.reward_kwargs)
    names = [reward_name(f) for f in funcs]
    check_reward_funcs(funcs, names, columns)  # (prompts, images, **columns)
    if len(set(names)) != len(names):
        raise ValueError(
            f"Reward names must be unique (they name the logged metrics), got {names}; give each callable a distinct "
            "__name__."
        )
    if args.reward_weights is not None and len(args.reward_weights) != len(funcs):
        raise ValueError(f"reward_weights has {len(args.reward_weights)} entries for {len(funcs)} rewards ({names}).")
    weights = args.reward_weights if args.reward_weights is not None else [1.0] * len(funcs)
    return funcs, names, torch.tensor(weights, dtype=torch.float32)


def make_balancer(aggregation: str, args, reward_names: list[str]):
    """The balancer of a gradient-space aggregation (``None`` for the advantage-space ones): the registry's entry
    (``balance/registry.py``) gives its weighting and whether the EMA applies; ``marble_procedure: released`` is
    MARBLE's own procedure."""
    from ..balance import MarbleBalancer, ReleasedMarble
    from ..balance.registry import aggregation as entry

    spec = entry(aggregation)
    if not spec.balanced:
        return None
    if args.marble_procedure == "released":  # MARBLE's own procedure (the config allows it for 'marble' only)
        return ReleasedMarble(
            reward_names,
            rho=args.marble_rho,
            refresh_interval=args.marble_refresh_interval,
            warmup_steps=args.marble_warmup_steps,
            alpha_floor=args.marble_alpha_floor,
            groups=args.marble_reward_groups,
            mgda_weights=args.marble_mgda_weights,
            normalize=args.marble_normalize_gradients,
            dropout_targets=args.marble_reward_dropout_targets or (),
            dropout_prob=args.marble_reward_dropout_prob,
            dropout_warmup_steps=args.marble_reward_dropout_warmup_steps,
        )
    return MarbleBalancer(
        reward_names=reward_names,
        rho=args.marble_rho if spec.ema else 0.0,
        refresh_interval=args.marble_refresh_interval,
        uniform_final_steps=args.marble_uniform_final_steps,
        amortised=args.marble_amortised_update,
        silent=args.marble_silent_rewards,
        solver=spec.solver(),
    )


def resolve_aggregation(requested: str, num_rewards: int) -> str:
    """'auto' is MARBLE with several rewards; with one reward every aggregation is plain DiffusionNFT (the reward's
    weight, normalised away, does not scale the advantage)."""
    if num_rewards == 1:
        return "sum_then_normalize"
    return "marble" if requested == "auto" else requested


def eval_rewards(specs, args, funcs: list[RewardFunc], names: list[str]) -> tuple[list[RewardFunc], list[str]]:
    """The evaluation rewards: the training rewards unless given; a training reward's name reuses its instance."""
    specs = specs if specs is not None else args.eval_reward_funcs
    if specs is None:
        return list(funcs), list(names)
    specs = [specs] if isinstance(specs, str) or callable(specs) else list(specs)
    trained = dict(zip(names, funcs))
    kwargs = args.reward_kwargs or {}
    out = []
    for spec in specs:
        if isinstance(spec, str) and spec in trained:
            out.append(trained[spec])
        else:
            options = {spec: kwargs[spec]} if isinstance(spec, str) and spec in kwargs else None
            out.extend(resolve_reward_funcs([spec], options))
    out_names = [reward_name(f) for f in out]
    if len(set(out_names)) != len(out_names):
        raise ValueError(f"eval_reward_funcs names must be unique, got {out_names}.")
    return out, out_names


def source_indices(dataset, ratios: dict[str, float] | None) -> tuple[list[int] | None, list[float] | None]:
    """Each row's source index and each source's ratio, from the ``source`` column and ``source_ratios``."""
    if ratios is None:
        return None, None
    if SOURCE_COLUMN not in dataset.column_names:
        raise ValueError(
            f"source_ratios is set ({ratios}) but the train dataset has no {SOURCE_COLUMN!r} column; build it with "
            "marble_trl.data.sources.load_prompt_sources (or add the column), or unset source_ratios."
        )
    names = list(ratios)
    index = {name: k for k, name in enumerate(names)}
    column = dataset[SOURCE_COLUMN]
    unknown = sorted({str(v) for v in column} - set(index))
    if unknown:
        raise ValueError(
            f"source_ratios gives no ratio for the source(s) {unknown} of the train dataset (ratios for: {names}); "
            "add them to source_ratios (0 to leave a source out)."
        )
    absent = sorted(n for n in names if ratios[n] > 0 and n not in set(column))
    if absent:
        raise ValueError(
            f"source_ratios names source(s) {absent} that have no row in the train dataset's {SOURCE_COLUMN!r} "
            "column; fix the names or remove them."
        )
    return [index[str(v)] for v in column], [ratios[n] for n in names]


def frozen_components(pipeline) -> list[Any]:
    """The pipeline's frozen modules (VAE, text encoders) that exist."""
    return [c for c in (getattr(pipeline, name, None) for name in FROZEN_COMPONENTS) if c is not None]


def eval_datasets(eval_dataset: Any) -> list[tuple[str, Any]]:
    """``(name, dataset)`` pairs of an ``eval_dataset`` (``None``, a dataset, or a dict of them)."""
    if eval_dataset is None:
        return []
    if isinstance(eval_dataset, dict):
        return [(f"eval_dataset[{key!r}]", ds) for key, ds in eval_dataset.items()]
    return [("eval_dataset", eval_dataset)]


def source_image_loader(adapter, args, train_dataset, eval_dataset) -> SourceImageLoader | None:
    """An editing model's reader of the rows' source images, after every dataset's images were checked (a clear
    error naming the row); ``None`` for a text-to-image model, which refuses a ``source_images`` column."""
    datasets = [("train_dataset", train_dataset), *eval_datasets(eval_dataset)]
    for name, dataset in datasets:
        check_editing_data(adapter, dataset, name)
    if not adapter.editing:
        return None
    if args.cache_prompt_embeddings and adapter.prompt_sees_image:
        raise ValueError(
            f"cache_prompt_embeddings: {type(adapter.pipeline).__name__}'s prompt conditioning depends on the source "
            "image (its VL encoder sees it), so prompts cannot be cached alone; set cache_prompt_embeddings=False "
            "(offload_text_encoders still frees the accelerator between encodings)."
        )
    return SourceImageLoader(adapter.source_resolution)


def check_editing_data(family, dataset, name: str) -> None:
    """An editing model's dataset has a readable source image in every row (errors name the row); a text-to-image
    model's has no ``source_images`` column. ``family``: the adapter, or its class (``marble-trl check``)."""
    if family.editing:
        check_source_images(dataset, name)
    elif SOURCE_IMAGES_COLUMN in dataset.column_names:
        raise ValueError(
            f"{name} has a {SOURCE_IMAGES_COLUMN!r} column, but {family.pipeline_class_name} generates from text "
            "alone: train an editing model (FLUX.1 Kontext, Qwen-Image-Edit; docs/models.md) or drop the column."
        )


def group_sampler(dataset, args) -> GroupSampler:
    """Whole groups, whole steps: the trainer's sampler over ``dataset`` (with the sources' ratios, if any)."""
    sources, ratios = source_indices(dataset, args.source_ratios)
    return GroupSampler(
        num_prompts=len(dataset),
        num_generations=args.num_generations,
        prompts_per_step=args.prompts_per_optimizer_step,
        seed=args.seed,
        sources=sources,
        ratios=ratios,
    )


def unreached_trainable(adapter, transformer: torch.nn.Module, params: dict[str, torch.nn.Parameter]) -> list[str]:
    """The trainable parameters no forward of the transformer reaches (DDP then stalls: it waits for their gradients).

    One probe forward at the smallest resolution with an empty prompt; a parameter whose gradient is not even
    computed never influences the output, whatever the inputs (e.g. a LoRA on Qwen-Image's last block's text-stream
    projections, whose output the model discards)."""
    device = next(transformer.parameters()).device
    # float32 trained weights in a bf16 / fp16 model (full fine-tuning) run under autocast, as training does
    dtypes = {p.dtype for p in transformer.parameters()}
    low = next((d for d in (torch.bfloat16, torch.float16) if d in dtypes), None)
    mixed = low is not None and torch.float32 in dtypes
    autocast = torch.autocast(device.type, dtype=low) if mixed else contextlib.nullcontext()
    side = adapter.latent_factor * 2
    with torch.no_grad(), autocast, small_sources(adapter, side):
        cond = adapter.encode([""], 8, device, **probe_sources(adapter, 1, side))
        scheduler = copy.deepcopy(adapter.pipeline.scheduler)
        x = adapter.sample(scheduler, cond, 1, side, torch.Generator().manual_seed(0))
    with torch.enable_grad(), autocast:
        sigma = torch.full((x.shape[0],), 0.5, device=x.device)
        out = adapter.predict(transformer, x.to(device), sigma, cond)
        grads = torch.autograd.grad(out.float().sum(), list(params.values()), allow_unused=True)
    return [name for name, g in zip(params, grads) if g is None]


def check_unreached_parameters(args, adapter, transformer: torch.nn.Module, trainable: dict) -> None:
    """Multi-process DDP only: trainable tensors that never reach the output would stall DDP (it waits for their
    gradients); with some, DDP runs with ``find_unused_parameters=True`` and a warning names them."""
    if args.world_size <= 1 or args.ddp_find_unused_parameters:
        return
    unreached = unreached_trainable(adapter, transformer, trainable)
    if unreached:
        field = "lora_target_modules" if args.use_peft else "full_finetune_modules"
        logger.warning(
            "%d trainable tensors never reach the transformer's output (%s, ...): they cannot train, and DDP "
            "would wait for their gradients. Running DDP with find_unused_parameters=True; drop those modules from "
            "%s to avoid its per-step graph traversal.",
            len(unreached),
            unreached[0],
            field,
        )
        args.ddp_find_unused_parameters = True


def full_policy(args, peft_config, transformer: torch.nn.Module):
    """``use_peft=False``: the transformer's own weights train (:class:`~marble_trl.policy.full.FullPolicy`)."""
    from ..policy.full import FullPolicy

    if peft_config is not None:
        raise ValueError(
            "peft_config was given with use_peft=False (full fine-tuning): drop peft_config, or set use_peft=True to "
            "train that LoRA."
        )
    mixed = {str(p.dtype) for p in transformer.parameters()} - {"torch.float32"}
    if mixed and not (args.bf16 or args.fp16):
        raise ValueError(
            f"Full fine-tuning of a {'/'.join(sorted(mixed))} model: the trained weights become float32 and the rest "
            "(the frozen modules, the text encoders' embeddings) is not, so the forward needs autocast. Set bf16 true "
            "(or fp16), or load the model in float32 (torch_dtype float32)."
        )
    return FullPolicy(transformer, args.full_finetune_modules)


def per_reward_gradients(args, aggregation: str) -> bool:
    """Whether the run forms per-reward gradients (a gradient engine): a balanced aggregation, or the cosine
    diagnostic (``log_update_cosines``)."""
    from ..balance import AGGREGATIONS

    return bool(args.log_update_cosines or AGGREGATIONS[aggregation].balanced)


def _true(value) -> bool:
    """A DeepSpeed config flag (a bool, or a string such as "false" from a YAML / CLI override)."""
    return str(value).strip().lower() in ("true", "1", "yes") if isinstance(value, str) else bool(value)


def check_full_finetuning_backend(args, backend, aggregation: str) -> None:
    """Full fine-tuning with sharded weights (FSDP2, DeepSpeed ZeRO-3) takes its per-reward gradients from
    ``layer_gram`` (one backward per solved pair, the weights read only where their unit has gathered them): the other
    engines differentiate the weights themselves (empty ZeRO-3 partitions) or back-propagate one retained graph twice
    (FSDP2 frees the units' gathered weights in between). Under ZeRO-3, the settings whose partitions the swaps do not
    follow are refused: parameter offload, ZeRO++'s secondary partitions and quantized weights."""
    if args.use_peft:
        return
    zero = (getattr(backend, "zero_config", None) or {}) if backend.shards_transformer else {}  # ZeRO-3 only
    offload = str((zero.get("offload_param") or {}).get("device", "none")).lower()
    refused = [
        f"offload_param device {offload} (the copies' partitions would follow the weights to the host)"
        if offload not in ("none", "") or _true(zero.get("cpu_offload_param"))
        else "",
        "zero_hpz_partition_size > 1 (ZeRO++ gathers from secondary partitions the swaps do not write)"
        if int(zero.get("zero_hpz_partition_size", 1) or 1) > 1
        else "",
        "zero_quantized_weights (ZeRO++ gathers quantized partitions the swaps do not write)"
        if _true(zero.get("zero_quantized_weights"))
        else "",
        "zero_quantized_nontrainable_weights (the frozen weights' partitions become int8: transformer/ would hold them)"
        if _true(zero.get("zero_quantized_nontrainable_weights"))
        else "",
    ]
    refused = [r for r in refused if r]
    if refused:
        raise ValueError(
            f"use_peft=False under DeepSpeed does not support {'; '.join(refused)}: drop it from the DeepSpeed config "
            "(recipes/accelerate/deepspeed_zero3.yaml has none), or train a LoRA (use_peft true)."
        )
    engine = per_reward_gradients(args, aggregation)
    if backend.shards_transformer and engine and args.marble_gradient_engine != "layer_gram":
        label = {"fsdp2": "FSDP2", "deepspeed": "DeepSpeed ZeRO-3"}.get(backend.name, backend.name)
        raise ValueError(
            f"use_peft=False under {label}: the per-reward gradients take marble_procedure='released' with "
            "marble_gradient_engine='layer_gram' (the other engines need every weight whole at once), or use an "
            "aggregation without per-reward gradients (e.g. sum_then_normalize), or DDP / DeepSpeed ZeRO-2."
        )
