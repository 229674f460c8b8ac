"""What a run folder says about its run: ``marble_trl.json`` (written next to a published LoRA and a run's final
``output_dir``: the base model, the weights and format, the rewards, the sampling settings that ``marble-trl generate``
defaults to and the card's training settings) and the :class:`~marble_trl.publish.card.CardInfo` of a folder, read
from a ``checkpoint-N`` folder's manifest or from that file (:func:`card_info_from_checkpoint`).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from ..artifacts import BALANCER_FILE, EXPORT_CONFIG_FILE, MANIFEST_FILE, METRICS_FILE, TRAINER_STATE_FILE
from ..models.tiny import is_tiny
from ..persistence.checkpoint import read_manifest
from .card import CARD_CONFIG_FIELDS, CardInfo, override_card, sampling_settings

# Training arguments kept in marble_trl.json (what the card and `generate` need from a run's final output_dir).
EXPORT_CONFIG_FIELDS = [*CARD_CONFIG_FIELDS, "max_sequence_length", "negative_prompt", "num_frames"]


def read_export_config(folder: str | os.PathLike) -> dict[str, Any]:
    """A folder's ``marble_trl.json`` (``{}`` when it has none)."""
    path = Path(folder) / EXPORT_CONFIG_FILE
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}


def card_info_from_checkpoint(folder: str | os.PathLike, **overrides) -> CardInfo:
    """The card of a run folder: a ``checkpoint-N`` folder (its manifest), else a folder with a ``marble_trl.json``
    (a run's final ``output_dir``, an export folder); the log history is ``trainer_state.json`` or ``metrics.jsonl``."""
    folder = Path(folder)
    config = read_export_config(folder)
    if (folder / MANIFEST_FILE).is_file() or not config:
        manifest = read_manifest(folder)
        balancer = manifest["files"].get("balancer") or (BALANCER_FILE if (folder / BALANCER_FILE).is_file() else None)
        info = CardInfo(
            base_model=manifest.get("base_model"),
            reward_names=list(manifest["reward_names"]),
            reward_weights=list(manifest["reward_weights"]),
            aggregation=manifest["aggregation"],
            global_step=int(manifest["global_step"]),
            training_args=manifest.get("training_args", {}),
            log_history=_log_history(folder),
            balancer_state=json.loads((folder / balancer).read_text(encoding="utf-8")) if balancer else None,
            pipeline_class=manifest.get("pipeline_class") or "StableDiffusion3Pipeline",
            lora_format="full" if manifest.get("policy") == "full" else "diffusers",
        )
    else:
        names = list(config.get("reward_names") or [])
        args = config.get("training_args") or {}
        info = CardInfo(
            base_model=config.get("base_model"),
            reward_names=names,
            reward_weights=list(config.get("reward_weights") or [1.0] * len(names)),
            aggregation=config.get("aggregation") or args.get("multi_objective_aggregation") or "unknown",
            global_step=int(config.get("global_step") or 0),
            training_args=args,
            log_history=_log_history(folder),
            weights=config.get("weights") or "raw",
            pipeline_class=config.get("pipeline_class") or "StableDiffusion3Pipeline",
            lora_format="full" if config.get("format") == "full" else "diffusers",
        )
    if is_tiny(info.base_model):
        info.tiny_seed = int(config.get("tiny_seed") or 0)
    return override_card(info, overrides)


def _log_history(folder: Path) -> list[dict[str, Any]]:
    state_file, metrics = folder / TRAINER_STATE_FILE, folder / METRICS_FILE
    if state_file.is_file():
        return json.loads(state_file.read_text(encoding="utf-8"))["log_history"]
    if metrics.is_file():  # written by `marble-trl train` next to the final LoRA
        return [json.loads(line) for line in metrics.read_text(encoding="utf-8").splitlines() if line.strip()]
    return []


def write_export_config(folder: str | os.PathLike, info: CardInfo, source: str | None = None) -> Path:
    """``marble_trl.json``: base model (and the tiny model's seed), weights, format, step, rewards, the sampling
    settings (``generate``'s defaults) and the card's training settings: what ``marble-trl export`` needs to export a
    run's final ``output_dir``, which has no checkpoint manifest."""
    path = Path(folder) / EXPORT_CONFIG_FILE
    config = {
        "base_model": info.base_model,
        **({"tiny_seed": info.tiny_seed or 0} if is_tiny(info.base_model) else {}),
        "pipeline_class": info.pipeline_class,
        "weights": info.weights,
        "format": info.lora_format,
        "global_step": info.global_step,
        "reward_names": info.reward_names,
        "reward_weights": info.reward_weights,
        "aggregation": info.aggregation,
        "source": source,
        "sampling": sampling_settings(info.training_args),
        "training_args": {k: info.training_args[k] for k in EXPORT_CONFIG_FIELDS if k in info.training_args},
    }
    path.write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
    return path
