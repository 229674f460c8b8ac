"""The steps of ``marble-trl check`` after the parse (:mod:`marble_trl.commands.check`): each reuses what training
runs (the trainer's setup checks, the train command's dataset loading, the trainer's batching arithmetic) and adds
findings and tables to the report. A user of the trainer (its constructor's checks), like the commands."""

from __future__ import annotations

import dataclasses
import math
import os
from pathlib import Path
from types import SimpleNamespace

import torch

from .memory import GIB, STRATEGY_NAMES, MemoryInputs, Strategy, estimate_memory, parse_size, table_lines, verdict
from .report import Report


def run_checks(parsed, strategy: Strategy, gpu_memory: str | None, measure: bool, report: Report) -> None:
    from ..trainer.setup import check_resolution, lora_config
    from .model import check_family_needs, check_lora_targets, lora_count, resolve_model, transformer_of
    from .rewards import resolve_each

    script_args, args = parsed.script_args, parsed.args
    report.section("Run", _run_lines(script_args, args, parsed.bf16, strategy))
    if not script_args.reward_funcs:
        report.error("rewards", "reward_funcs is empty: name at least one reward (e.g. --reward_funcs brightness).",
                     "add --reward_funcs NAME ... (docs/rewards.md lists the built-in rewards)")  # fmt: skip
    info = resolve_model(script_args.model_name_or_path, report, script_args.tiny_seed)
    lora_params = summary = None
    full_params = 0
    if info is not None:
        check_family_needs(info, args, report, check_resolution)
        transformer, summary = transformer_of(info)
        if not args.use_peft:
            full_params = _full_finetuning(transformer, args, strategy, report, len(script_args.reward_funcs or []))
            lora_params = 0 if full_params else None
        elif check_lora_targets(
            transformer,
            peft_config := lora_config(args, default_targets=tuple(info.family.default_lora_targets)),
            report,
        ):
            try:
                lora_params = lora_count(info, peft_config)
            except ValueError as err:  # peft's own refusal
                report.error("lora", str(err), "fix lora_target_modules")
        for note in info.notes:
            report.note("model", note)
    funcs = resolve_each(script_args.reward_funcs, args.reward_kwargs, report)
    dataset = _dataset(script_args, args, report)
    if info is not None and dataset is not None:
        _source_images(info.family, dataset, args, report)
    _trainer_reward_checks(script_args, args, funcs, dataset, info, report)
    sizes = _rewards(funcs, dataset, args, report)
    _batching(args, parsed, strategy, report)
    if info is not None and lora_params is not None and summary is not None and info.frozen is not None:
        k = len(script_args.reward_funcs)
        _memory(info, args, parsed, strategy, summary, lora_params, sizes, gpu_memory, k, report, full_params)
    elif strategy.kind != "cpu":
        report.warning("memory", "memory per GPU not estimated (the model's sizes are unknown, see above).")
    if measure and report.errors:
        report.note("measure", "--measure skipped: fix the errors first.")
    elif measure:
        from .measure import measure_step

        measure_step(script_args, args, report)


def _run_lines(script_args, args, bf16: bool, strategy: Strategy) -> list[str]:
    return [
        f"- model: {script_args.model_name_or_path} (torch_dtype {script_args.torch_dtype}, bf16 {bf16})",
        f"- launcher: {strategy.label} ({strategy.source})",
        f"- rewards: {', '.join(script_args.reward_funcs) or '(none)'}; aggregation {args.multi_objective_aggregation}",
        f"- rollouts: {args.sample_scheduler}, {args.num_sample_steps} steps, {args.resolution} px, guidance "
        f"{args.guidance_scale}, max_sequence_length {args.max_sequence_length}",
    ]


# ------------------------------------------------------------------------------------------------ data and rewards
def _offline_sources(script_args, report: Report) -> bool:
    """Whether every prompt source can be read here without a network (a local file, a built-in source, a prompt set
    already cached); a missing local file is an error (the run would fail at its start)."""
    from ..data.sources import PROMPT_SETS, SHAPES_SOURCES, as_sources, named_mixture

    names = [s.path for s in script_args.dataset_mixture] or [
        s.path for s in (named_mixture(script_args.dataset_name) or as_sources([script_args.dataset_name]))
    ]
    if script_args.eval_dataset_name:
        names += [
            s.path for s in named_mixture(script_args.eval_dataset_name) or as_sources([script_args.eval_dataset_name])
        ]
    readable = True
    for name in names:
        local = Path(name).expanduser()
        if name == "bundled" or name in SHAPES_SOURCES:
            continue
        if name in PROMPT_SETS:
            from ..data.prompt_files import available_offline

            if not available_offline(PROMPT_SETS[name]):
                report.note(
                    "data",
                    f"prompt set {name!r} is not cached: the first run downloads it (`marble-trl datasets download "
                    f"{name}` beforehand on an offline cluster); the rewards' prompt shares need it, so they are not "
                    "estimated.",
                )
                readable = False
            continue
        if local.suffix.lower() in (".txt", ".json", ".jsonl", ".csv", ".parquet") or name.startswith((".", "/", "~")):
            if not local.is_file():
                report.error(
                    "data",
                    f"prompt file {name!r} does not exist (from {os.getcwd()}); the run would stop at its start.",
                    f'create {name} (one prompt per line, or one {{"prompt": ...}} per JSONL line; docs/data.md) or '
                    "point dataset_name / dataset_mixture at your prompts",
                )
                readable = False
            continue
        report.note("data", f"{name!r} is a Hub dataset: not read offline, so the rewards' prompt shares are unknown.")
        readable = False
    return readable


def _dataset(script_args, args, report: Report):
    """The train dataset as ``marble-trl train`` loads it (``load_script_datasets``), when it can be read offline."""
    if not _offline_sources(script_args, report):
        return None
    from ..commands.train import load_script_datasets
    from ..trainer.setup import check_inputs

    try:
        dataset, eval_dataset = load_script_datasets(script_args, args)
        check_inputs(dataset, eval_dataset, [], args)
    except (ValueError, TypeError, FileNotFoundError, OSError) as err:
        report.error("data", str(err), "fix the prompt data as the error says (docs/data.md)")
        return None
    report.note("data", f"{len(dataset)} training prompts ({', '.join(dataset.column_names)}).")
    return dataset


def _source_images(family, dataset, args, report: Report) -> None:
    """The trainer's checks of the source images (an editing model's every header read; a text-to-image model's
    refusal of them) and of an editing model's prompt cache."""
    from ..trainer.setup import check_editing_data

    if family.editing and family.prompt_sees_image and args.cache_prompt_embeddings:
        report.error(
            "config",
            f"cache_prompt_embeddings: {family.pipeline_class_name}'s prompt conditioning depends on the source image",
            "set --cache_prompt_embeddings false (--offload_text_encoders still frees the GPU between encodings)",
        )
    try:
        check_editing_data(family, dataset, "train_dataset")
    except ValueError as err:
        report.error("data", str(err), "give an editing model a readable source image per row, a text-to-image "
                     "model none (docs/models.md#editing-models)")  # fmt: skip
        return
    if family.editing:
        report.note("data", f"{len(dataset)} source images readable ({family.pipeline_class_name} edits them).")


def _trainer_reward_checks(script_args, args, funcs: dict, dataset, info, report: Report) -> None:
    """The trainer constructor's reward checks, on the resolved rewards: signatures against the dataset's columns,
    unique names, ``reward_weights``' length, the evaluation rewards, images vs videos for the family."""
    from ..trainer.setup import eval_rewards, family_rewards, training_rewards

    if not funcs or len(funcs) != len(script_args.reward_funcs):
        return
    try:
        kwargs = dict(args.reward_kwargs or {})
        args_view = SimpleNamespace(reward_kwargs=kwargs, reward_weights=args.reward_weights)
        columns = dataset.column_names if dataset is not None else None
        resolved, names, _ = training_rewards(script_args.reward_funcs, args_view, columns)
        evals, _ = eval_rewards(None, args, resolved, names)
        if info is not None:
            view = SimpleNamespace(video=info.family.video, family=info.family.family, num_frames=None)
            family_rewards(view, args, resolved, evals)
    except (ValueError, TypeError, ImportError) as err:
        report.error("rewards", str(err), "fix reward_funcs / reward_kwargs / reward_weights as the error says")


def _rewards(funcs: dict, dataset, args, report: Report):
    from .rewards import applicability, check_extras, check_weights, reward_sizes

    check_extras(funcs, report)
    check_weights(funcs, report)
    sizes = reward_sizes(funcs, report)
    if dataset is not None and funcs:
        rows = applicability(funcs, dataset, args.source_ratios, report)
        report.section(
            "Rewards: prompts they score",
            ["| reward | share | rule |", "| --- | ---: | --- |"] + [f"| {r} | {s} | {how} |" for r, s, how in rows],
        )
    return sizes


# ------------------------------------------------------------------------------------------------ batching, memory
def _batching(args, parsed, strategy: Strategy, report: Report) -> None:
    """The trainer's batching (``check_batching`` ran in the config at this process count): the table, and valid
    alternatives when it failed."""
    from ..config_checks import check_batching
    from ..distributed import num_train_timesteps

    n = strategy.processes
    T = num_train_timesteps(args.num_sample_steps, args.timestep_fraction)
    ga = args.gradient_accumulation_steps
    lines = [
        "| quantity | value |",
        "| --- | ---: |",
        f"| groups per step (prompts_per_step) | {args.per_device_train_batch_size * ga * n // args.num_generations} |",
        f"| images per group (num_generations) | {args.num_generations} |",
        f"| processes | {n} |",
        f"| images per micro-batch (per_device_train_batch_size) | {args.per_device_train_batch_size} |",
        f"| gradient accumulation (derived) | {ga} |",
        f"| images per optimizer step | {args.per_device_train_batch_size * ga * n} |",
        f"| training timesteps per sample (T) | {T} |",
        f"| backward calls per optimizer step and process (GA x T) | {ga * T} |",
    ]
    report.section("Batching (the trainer's arithmetic)", lines)
    if "per_device_train_batch_size" in parsed.dropped:
        from .fixes import valid_micro_batches

        wanted = int(str(parsed.raw.get("per_device_train_batch_size", args.per_device_train_batch_size)).split()[0])
        valid = valid_micro_batches(args, n, check_batching, upto=max(64, wanted))
        best = max((m for m in valid if m <= wanted), default=None)
        for i, f in enumerate(report.findings):  # the config's batching error gets the concrete values
            if f.topic == "config" and "per_device_train_batch_size" in f.message:
                fix = (
                    f"lower per_device_train_batch_size to {best} (--per_device_train_batch_size {best})"
                    if best
                    else f.fix
                )
                message = f"{f.message} Valid per_device_train_batch_size on {n} process(es): {valid}."
                report.findings[i] = dataclasses.replace(f, message=message, fix=fix)


def _full_finetuning(transformer, args, strategy: Strategy, report: Report, num_rewards: int) -> int:
    """``use_peft=False``: the trained parameters (0 after an error), and the launcher's checks (the trainer's:
    :func:`~marble_trl.trainer.setup.check_full_finetuning_backend`)."""
    from ..policy.full import full_parameters
    from ..trainer.setup import per_reward_gradients, resolve_aggregation

    aggregation = resolve_aggregation(args.multi_objective_aggregation, max(num_rewards, 1))
    engine = per_reward_gradients(args, aggregation)
    if strategy.kind == "zero3" and strategy.offload_params:
        report.error(
            "full fine-tuning",
            "use_peft false under DeepSpeed ZeRO-3 does not support parameter offload (offload_param_device).",
            "launch with recipes/accelerate/deepspeed_zero3.yaml (no offload), or train a LoRA (use_peft true)",
        )
    if strategy.shards_weights and engine and args.marble_gradient_engine != "layer_gram":
        report.error(
            "full fine-tuning",
            f"use_peft false under {STRATEGY_NAMES[strategy.kind]} takes its per-reward gradients from layer_gram (the "
            "other engines need every weight whole at once).",
            "add --marble_procedure released --marble_gradient_engine layer_gram, or use an aggregation without "
            "per-reward gradients, or DDP / DeepSpeed ZeRO-2",
        )

    count = sum(p.numel() for p in full_parameters(transformer, args.full_finetune_modules).values())
    if not count:
        report.error("full fine-tuning", f"full_finetune_modules={args.full_finetune_modules} matched no module.",
                     "name modules as lora_target_modules does, or leave it unset to train every weight")  # fmt: skip
    else:
        report.note("full fine-tuning", f"{count / 1e6:,.1f} M trained parameters (use_peft false).")
    return count


def _memory(info, args, parsed, strategy, summary, lora, sizes, gpu_memory, k: int, report: Report, full=0) -> None:
    from ..commands.train import _resolve_dtype
    from ..trainer.setup import per_reward_gradients, resolve_aggregation
    from .fixes import plan_fixes, valid_micro_batches
    from .measurements import activation_bytes

    if strategy.kind == "cpu":
        report.note("memory", "use_cpu: the run is on the CPU; no GPU memory to check.")
        return
    dtype = _resolve_dtype(parsed.script_args.torch_dtype, SimpleNamespace(bf16=parsed.bf16, fp16=args.fp16))
    aggregation = resolve_aggregation(args.multi_objective_aggregation, k)
    balancer = per_reward_gradients(args, aggregation)
    tokens = (
        info.architecture.tokens(args.resolution, args.max_sequence_length, args.num_frames)
        if info.architecture
        else 0
    )
    plain, ckpt = activation_bytes(info.measured, tokens)
    optim = str(getattr(args.optim, "value", args.optim))
    moments = 2 if "8bit" in optim else (0 if optim.startswith("sgd") else 8)
    total, block, root = summary
    inputs = MemoryInputs(
        transformer=total, block=block, root=root, lora=lora, text_encoders=info.text_encoder_params,
        vae=info.frozen["vae"], weight_bytes=torch.tensor([], dtype=dtype).element_size(), strategy=strategy,
        micro_batch=args.per_device_train_batch_size, act_plain=plain, act_checkpointed=ckpt,
        checkpointing=bool(args.activation_checkpointing or args.gradient_checkpointing), param_ema=args.param_ema,
        marble_rows=(k + 1) if balancer and k > 1 else 0, moment_bytes=moments,
        text_resident=not (args.offload_text_encoders or args.cache_prompt_embeddings),
        rewards_resident=sizes.resident, rewards_visiting=sizes.visiting, reward_notes=tuple(sizes.notes), full=full,
        layer_gram=args.marble_gradient_engine == "layer_gram", guard_copy=args.max_nonfinite_skips > 0,
        per_reward_gradients=bool(balancer),
    )  # fmt: skip
    estimate = estimate_memory(inputs)
    capacity = _capacity(gpu_memory, report)
    report.section(f"Memory per GPU ({strategy.label})", table_lines(estimate, capacity))
    if not estimate.activations_known:
        report.warning(
            "memory", f"activations not measured for {info.name}: the estimate counts weights and states only."
        )
    if capacity is None:
        report.note("memory", f"no GPU memory given and no GPU here: {GPU_HINT}.")
        return
    v = verdict(estimate, capacity)
    where = f"{estimate.need / GIB:.1f} GiB needed per GPU ({estimate.peak_phase} peak) of {capacity / GIB:.0f} GiB"
    if v == "fits":
        report.note("memory", f"fits: {where}.")
        return
    micro_batches = valid_micro_batches(args, strategy.processes, _check_batching())
    target = capacity if v == "does not fit" else 0.9 * capacity
    fixes, need, fits = plan_fixes(inputs, target, micro_batches, sizes.on_gpu)
    add = report.error if v == "does not fit" else report.warning
    if not fits:  # what the savers cannot reach: a bigger GPU, then the savers that shrink what it must hold
        bigger = f"use GPUs with at least {math.ceil(need / GIB)} GiB" + (
            ", or marble_procedure: released with marble_gradient_engine: layer_gram (the paper's procedure keeps "
            "K + 1 copies of the trained weights; layer_gram none)"
            if full and inputs.per_reward_gradients and not inputs.layer_gram
            else ", or more GPUs with FSDP2 or DeepSpeed ZeRO-3"
            if full and strategy.kind not in ("fsdp2", "zero3")
            else ""
            if full
            else ", or more GPUs with a sharded strategy"
        )
        saved = f"; with the fixes below it still needs {need / GIB:.1f} GiB" if fixes else ""
        add("memory", f"{v}: {where}{saved}.", (bigger, *fixes))
        return
    together = f"the {len(fixes)} fixes below, together," if len(fixes) > 1 else "the fix below"
    add("memory", f"{v}: {where}; {together} bring it to {need / GIB:.1f} GiB.", tuple(fixes))


def _check_batching():
    from ..config_checks import check_batching

    return check_batching


GPU_HINT = "pass --gpu_memory (e.g. 80GB) for a verdict"


def _capacity(gpu_memory: str | None, report: Report) -> float | None:
    if gpu_memory is not None:
        try:
            return parse_size(gpu_memory)
        except ValueError as err:
            report.error("memory", str(err), "--gpu_memory 80GB")
            return None
    if torch.cuda.is_available():
        return float(torch.cuda.get_device_properties(0).total_memory)
    return None
