"""The model a recipe names, without its weights: its family, its transformer (on the meta device from the published
or local configuration; the offline tiny models are built for real, they are small), the frozen models' sizes, and
what the family needs of the config (resolution multiple, token limit, rollout solver, LoRA targets)."""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cache, lru_cache
from pathlib import Path

import torch

from .architectures import (
    ARCHITECTURES,
    Architecture,
    architecture_of_hub_id,
    block_parameters,
    count,
    frozen_counts,
    on_meta,
)
from .report import Report

logger = logging.getLogger(__name__)

# The published pipelines' scheduler class (scheduler_config.json's _class_name), what sample_scheduler 'pipeline'
# resolves to; Wan ships UniPC with flow sigmas.
FAMILY_SCHEDULERS = {
    "sd3": "FlowMatchEulerDiscreteScheduler",
    "flux": "FlowMatchEulerDiscreteScheduler",
    "qwen-image": "FlowMatchEulerDiscreteScheduler",
    "z-image": "FlowMatchEulerDiscreteScheduler",
    "wan": "UniPCMultistepScheduler",
    "flux-kontext": "FlowMatchEulerDiscreteScheduler",
    "qwen-image-edit": "FlowMatchEulerDiscreteScheduler",
}
# The longest max_sequence_length each family's diffusers pipeline accepts (its check_inputs raises beyond it).
TOKEN_LIMITS = {"sd3": 512, "flux": 512, "qwen-image": 1024, "flux-kontext": 512, "qwen-image-edit": 1024}
TEXT_COMPONENTS = ("text_encoder", "text_encoder_2", "text_encoder_3")


@dataclass
class ModelInfo:
    name: str
    family: type  # the adapter class (marble_trl.models.FAMILIES)
    kind: str  # "hub", "local" or "tiny"
    key: str = ""  # what identifies its transformer (an architecture, a folder, a tiny model): the caches' key
    build_transformer: Callable[[], torch.nn.Module] | None = None  # a fresh transformer (meta, or the tiny one)
    frozen: dict[str, int] | None = None  # text encoders and "vae": parameters
    latent_factor: int | None = None
    scheduler_class: str | None = None
    architecture: Architecture | None = None
    measured: str | None = None  # the entry of measured_memory.json its activations come from
    notes: list[str] = field(default_factory=list)

    @property
    def text_encoder_params(self) -> int:
        return sum(v for k, v in (self.frozen or {}).items() if k != "vae")


def resolve_model(name: str, report: Report, tiny_seed: int = 0) -> ModelInfo | None:
    """The :class:`ModelInfo` of ``model_name_or_path``, or ``None`` (with the reason in ``report``) when its family
    cannot be known offline."""
    from ..models import FAMILIES, family_of
    from ..models.loading import local_folder
    from ..models.tiny import SHAPES_EDIT_MODEL_NAME, SHAPES_MODEL_NAME

    name = str(name)
    tiny = {f.tiny_name for f in FAMILIES} | {SHAPES_MODEL_NAME, SHAPES_EDIT_MODEL_NAME}
    if name in tiny:
        return _tiny(name, family_of(name), tiny_seed)
    try:
        folder = local_folder(name)
    except FileNotFoundError as err:
        report.error("model", str(err), "point model_name_or_path at an existing diffusers folder, a Hub id or 'tiny'")
        return None
    if folder is not None:
        try:
            family = family_of(name)
        except (FileNotFoundError, ValueError) as err:
            report.error("model", str(err))
            return None
        return _folder(name, folder, family, "local", report)
    family = next((f for f in FAMILIES if name in f.hub_ids), None)
    cached = _cached_snapshot(name)
    if family is None and cached is None:
        report.error(
            "model",
            f"{name!r} is not a Hub id marble_trl knows offline (known: {sorted(h for f in FAMILIES for h in f.hub_ids)})"
            " and its model_index.json is not in the local Hub cache, so its family cannot be checked offline.",
            "download it first (`huggingface-cli download " + name + "`) or give a local diffusers folder",
        )
        return None
    if cached is None:
        report.note(
            "model",
            f"{name} is not in the local Hub cache: the first run downloads it (every process; set HF_HOME to a shared "
            "cache on a cluster).",
        )
    arch = architecture_of_hub_id(name)
    if family is None or arch is None:
        if cached is not None:
            return _folder(name, cached, family or family_of(str(cached)), "hub", report)
        report.warning(
            "model",
            f"{name}: its architecture is not recorded in marble_trl.preflight.architectures and it is not cached: "
            "LoRA targets are checked on the family's tiny model and the memory estimate is skipped.",
        )
        return _tiny_stand_in(name, family, tiny_seed)
    frozen = dict(_frozen_counts(arch.name))
    return ModelInfo(
        name, family, "hub", f"architecture:{arch.name}", lambda: on_meta(arch.build), frozen, 16, FAMILY_SCHEDULERS[family.family], arch,
        arch.measured, list(arch.notes),
    )  # fmt: skip


@cache
def _frozen_counts(arch_name: str) -> tuple[tuple[str, int], ...]:
    arch = next(a for a in ARCHITECTURES if a.name == arch_name)
    return tuple(frozen_counts(arch).items())


def _cached_snapshot(repo_id: str) -> Path | None:
    """The local Hub cache's snapshot folder of ``repo_id`` when its model_index.json is cached (no network)."""
    try:
        from huggingface_hub import try_to_load_from_cache

        hit = try_to_load_from_cache(repo_id, "model_index.json")
    except Exception:  # not a valid repo id
        return None
    return Path(hit).parent if isinstance(hit, str) else None


@lru_cache(maxsize=8)
def _tiny_pipeline(name: str, seed: int):
    from ..models import load_model

    return load_model(name, tiny_seed=seed)


def _tiny(name: str, family: type, seed: int) -> ModelInfo:
    import copy

    adapter = _tiny_pipeline(name, seed)
    pipe = adapter.pipeline
    frozen = {c: count(getattr(pipe, c)) for c in TEXT_COMPONENTS if getattr(pipe, c, None) is not None}
    frozen["vae"] = count(pipe.vae)
    return ModelInfo(
        name, family, "tiny", f"tiny:{name}:{seed}", lambda: copy.deepcopy(pipe.transformer), frozen, adapter.latent_factor,
        type(pipe.scheduler).__name__, notes=[f"{name}: an offline model built here (activations not measured: tiny)"],
    )  # fmt: skip


def _tiny_stand_in(name: str, family: type, seed: int) -> ModelInfo:
    """The family's tiny model standing in for module names (LoRA targets), without sizes."""
    info = _tiny(family.tiny_name, family, seed)
    info.name, info.kind, info.frozen = name, "hub", None
    info.scheduler_class = FAMILY_SCHEDULERS.get(family.family)
    info.notes = [f"{name}: module names from {family.tiny_name} (its architecture is not recorded)"]
    return info


def _component(folder: Path, index: dict, component: str) -> torch.nn.Module | None:
    """One component of a diffusers folder built on the meta device from its config (``None`` when absent)."""
    import importlib

    entry = index.get(component)
    config_file = folder / component / "config.json"
    if not (isinstance(entry, list) and entry[0] and config_file.is_file()):
        return None
    cls = getattr(importlib.import_module(entry[0]), entry[1])
    if entry[0] == "diffusers":
        config = cls.load_config(str(folder / component))
        return on_meta(lambda: cls.from_config(config))
    config = cls.config_class.from_pretrained(str(folder / component))
    return on_meta(lambda: cls(config))


def _folder(name: str, folder: Path, family: type, kind: str, report: Report) -> ModelInfo:
    """A diffusers folder (local, or a cached Hub snapshot): every component from its config, on the meta device."""
    index = json.loads((folder / "model_index.json").read_text())
    try:
        transformer = _component(folder, index, "transformer")
        frozen = {c: count(m) for c in TEXT_COMPONENTS if (m := _component(folder, index, c)) is not None}
        vae = _component(folder, index, "vae")
    except Exception as err:  # a config this diffusers / transformers cannot read
        report.warning("model", f"{name}: its components could not be built from their configs ({err}).")
        return _tiny_stand_in(name, family, 0)
    if transformer is None or vae is None:
        report.warning("model", f"{name}: transformer/ or vae/ config.json missing: sizes unknown.")
        return _tiny_stand_in(name, family, 0)
    frozen["vae"] = count(vae)
    scale = getattr(vae.config, "scale_factor_spatial", None)
    if scale is None:
        scale = (
            2 ** len(vae.config.temperal_downsample)
            if hasattr(vae.config, "temperal_downsample")
            else 2 ** (len(vae.config.block_out_channels) - 1)
        )
    patch = getattr(transformer.config, "patch_size", 2) or 2
    patch = patch[-1] if isinstance(patch, (tuple, list)) else patch
    factor = scale * (
        2 if family.family in ("flux", "qwen-image", "z-image", "flux-kontext", "qwen-image-edit") else patch
    )
    scheduler = (index.get("scheduler") or [None, None])[1]
    arch = _matching_architecture(transformer, family.family)
    config = dict(transformer.config)
    info = ModelInfo(
        name, family, kind, f"folder:{folder.resolve()}", lambda: on_meta(lambda: type(transformer).from_config(config)), frozen, factor, scheduler,
        arch, arch.measured if arch else None,
    )  # fmt: skip
    if arch is None:
        info.notes.append(f"{name}: activations not measured for this transformer configuration")
    return info


def _matching_architecture(transformer: torch.nn.Module, family: str) -> Architecture | None:
    """The recorded architecture whose transformer has the same configuration (its measured activations apply)."""
    ignore = {"_name_or_path", "_diffusers_version", "_class_name", "_use_default_values"}
    mine = {k: v for k, v in dict(transformer.config).items() if k not in ignore}
    for arch in ARCHITECTURES:
        if arch.family != family:
            continue
        theirs = {k: v for k, v in dict(on_meta(arch.build).config).items() if k not in ignore}
        if json.dumps(mine, sort_keys=True, default=str) == json.dumps(theirs, sort_keys=True, default=str):
            return arch
    return None


# ------------------------------------------------------------------------------------------------ what the family needs
def check_lora_targets(transformer: torch.nn.Module, lora_config, report: Report) -> bool:
    """Every name in ``lora_config.target_modules`` matches at least one layer peft can adapt (peft's own matching
    rule), else an error naming the target and what exists; ``True`` when all match."""
    import copy

    from peft.tuners.tuners_utils import check_target_module_exists

    names = [n for n, _ in transformer.named_modules() if n]
    modules = dict(transformer.named_modules())
    supported = (torch.nn.Linear, torch.nn.Conv1d, torch.nn.Conv2d, torch.nn.Conv3d, torch.nn.Embedding)
    ok = True
    targets = lora_config.target_modules
    for target in [targets] if isinstance(targets, str) else sorted(targets):
        one = copy.copy(lora_config)
        one.target_modules = target if isinstance(targets, str) else {target}
        hits = [n for n in names if check_target_module_exists(one, n)]
        layers = [n for n in hits if isinstance(modules[n], supported)]
        if not layers:
            ok = False
            suffixes = sorted({n.split(".")[-1] for n, m in modules.items() if isinstance(m, torch.nn.Linear)})
            what = f"matches {len(hits)} module(s) but no Linear/Conv layer" if hits else "matches no module"
            report.error(
                "lora",
                f"lora_target_modules entry {target!r} {what} of the {type(transformer).__name__} (its Linear layers "
                f"end in: {', '.join(suffixes[:24])}{' ...' if len(suffixes) > 24 else ''}).",
                f"remove {target!r} from lora_target_modules, or leave lora_target_modules unset for the family's "
                "default targets",
            )
    return ok


def check_family_needs(info: ModelInfo, args, report: Report, check_resolution) -> None:
    """Resolution multiple (``check_resolution``: the trainer's own check), the pipeline's token limit, the rollout
    solvers on this family, video settings."""
    if info.latent_factor:
        try:
            check_resolution(args.resolution, info.latent_factor)
        except ValueError as err:
            lower = args.resolution // info.latent_factor * info.latent_factor
            report.error("model", str(err), f"set --resolution {lower or info.latent_factor}")
    fam = info.family.family
    limit = TOKEN_LIMITS.get(fam)
    if limit is not None and args.max_sequence_length > limit:
        report.error(
            "model",
            f"max_sequence_length={args.max_sequence_length}: the {info.family.pipeline_class_name} accepts at most "
            f"{limit} text tokens (it raises beyond).",
            f"set --max_sequence_length {limit}",
        )
    for field_name in ("sample_scheduler", "eval_sample_scheduler"):
        if getattr(args, field_name) == "pipeline" and info.scheduler_class:
            from ..rollout.solvers import FLOW_SOLVER_CLASSES

            if info.scheduler_class not in FLOW_SOLVER_CLASSES:
                report.error(
                    "model",
                    f"{field_name}='pipeline' resolves to {info.name}'s {info.scheduler_class}, which marble_trl does "
                    "not run on the training grid.",
                    f"set --{field_name} dpm2 (or euler)",
                )
    if fam == "wan" and args.num_frames is not None and (args.num_frames - 1) % 4:
        report.error(
            "model",
            f"num_frames={args.num_frames}: Wan needs 4k + 1 frames.",
            f"set --num_frames {(args.num_frames - 1) // 4 * 4 + 1}",
        )
    if "Wan2.2-T2V-A14B" in info.name:
        report.error(
            "model",
            "Wan 2.2 A14B has two experts (transformer_2); marble_trl trains one transformer and refuses it.",
            "use Wan-AI/Wan2.1-T2V-14B-Diffusers or Wan-AI/Wan2.2-TI2V-5B-Diffusers",
        )


_TRANSFORMERS: dict[str, tuple[torch.nn.Module, tuple[int, int, int]]] = {}
_LORA_COUNTS: dict[tuple, int] = {}


def transformer_of(info: ModelInfo) -> tuple[torch.nn.Module, tuple[int, int, int]]:
    """The model's transformer (built once per process: meta, or the tiny one) and its ``(parameters, largest
    block, root)`` counts. Not to be modified: :func:`lora_count` adds adapters to a copy of its own."""
    if info.key not in _TRANSFORMERS:
        transformer = info.build_transformer()
        block, root = block_parameters(transformer)
        _TRANSFORMERS[info.key] = transformer, (count(transformer), block, root)
    return _TRANSFORMERS[info.key]


def lora_count(info: ModelInfo, lora_config) -> int:
    """The trainable LoRA's parameters for this model and LoRA config (peft on a fresh copy; once per process)."""
    from .architectures import lora_parameter_count

    targets = lora_config.target_modules
    key = (info.key, targets if isinstance(targets, str) else frozenset(targets), lora_config.r,
           bool(getattr(lora_config, "use_dora", False)))  # fmt: skip
    if key not in _LORA_COUNTS:
        _LORA_COUNTS[key] = lora_parameter_count(info.build_transformer(), lora_config)
    return _LORA_COUNTS[key]
