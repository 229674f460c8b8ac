"""The model card of a marble_trl LoRA: what it shows (:class:`CardInfo`), the summaries of a run's logs, and its
rendering.

The card is a diffusers LoRA card (``library_name: diffusers``, ``base_model``, tags ``diffusers``, ``lora``,
``text-to-image``, ``trl``, ``marble``) with real values from the run: the rewards with their first and final logged
means, the MARBLE coefficient trajectory, the training configuration, sample images, a ``load_lora_weights`` usage
snippet and the citations. It is rendered from a :class:`CardInfo`, built either from a live trainer
(``marble_trl.trainer.publishing.card_info_from_trainer``) or from a run folder
(:func:`marble_trl.publish.run_info.card_info_from_checkpoint`: a ``checkpoint-N`` folder, or a run's final
``output_dir`` through its ``marble_trl.json``), so ``trainer.push_to_hub()`` and ``marble-trl export`` write the same
card.
"""

from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .._version import __version__
from ..models.tiny import SHAPES_EDIT_MODEL_NAME, TINY_SOURCE_RESOLUTION, is_tiny

CARD_TAGS = ["diffusers", "lora", "text-to-image", "trl", "marble", "diffusion-nft"]

MARBLE_CITATION = """@article{marble2026,
  title   = {{MARBLE}: Multi-Aspect Reward Balance for Diffusion {RL}},
  journal = {arXiv preprint arXiv:2605.06507},
  year    = {2026},
  url     = {https://arxiv.org/abs/2605.06507}
}"""
DIFFUSIONNFT_CITATION = """@inproceedings{zheng2026diffusionnft,
  title     = {{DiffusionNFT}: Online Diffusion Reinforcement with Forward Process},
  author    = {Zheng, Kaiwen and others},
  booktitle = {International Conference on Learning Representations (ICLR)},
  year      = {2026},
  url       = {https://arxiv.org/abs/2509.16117}
}"""
TRL_CITATION = """@software{vonwerra2020trl,
  title   = {{TRL: Transformers Reinforcement Learning}},
  author  = {von Werra, Leandro and Belkada, Younes and Tunstall, Lewis and Beeching, Edward and Thrush, Tristan and Lambert, Nathan and Huang, Shengyi and Rasul, Kashif and Gallouédec, Quentin},
  license = {Apache-2.0},
  url     = {https://github.com/huggingface/trl},
  year    = {2020}
}"""

# Training arguments shown in the card, in this order (those present in the run's arguments).
CARD_CONFIG_FIELDS = [
    "learning_rate",
    "lr_scheduler_type",
    "max_grad_norm",
    "num_generations",
    "prompts_per_step",
    "per_device_train_batch_size",
    "gradient_accumulation_steps",
    "multi_objective_aggregation",
    "scale_rewards",
    "marble_rho",
    "marble_refresh_interval",
    "marble_uniform_final_steps",
    "nft_beta",
    "beta",
    "adv_clip_max",
    "timestep_fraction",
    "old_policy_decay",
    "lora_r",
    "lora_alpha",
    "lora_target_modules",
    "use_peft",
    "full_finetune_modules",
    "sample_scheduler",
    "num_sample_steps",
    "guidance_scale",
    "resolution",
    "bf16",
    "fp16",
    "seed",
]

FULL_FIELDS = ("use_peft", "full_finetune_modules")  # a full fine-tune's card shows these instead of the lora_* fields


@dataclass
class CardInfo:
    """Everything the model card shows. ``log_history`` is ``trainer.state.log_history``."""

    base_model: str | None
    reward_names: list[str]
    reward_weights: list[float]
    aggregation: str
    global_step: int
    training_args: dict[str, Any]
    log_history: list[dict[str, Any]]
    balancer_state: dict[str, Any] | None = None
    weights: str = "raw"  # "raw" or "ema"
    lora_format: str = "diffusers"  # "diffusers" or "peft" (a LoRA), or "full" (a fully fine-tuned transformer)
    repo_id: str | None = None
    samples: list[tuple[str, str]] = field(default_factory=list)  # (path relative to the card, prompt)
    model_name: str | None = None
    license: str | None = None
    dataset_name: str | None = None
    tags: list[str] = field(default_factory=list)
    tiny_seed: int | None = None  # the seed of an offline tiny model (base_model "tiny", "tiny-flux", ...)
    pipeline_class: str = "StableDiffusion3Pipeline"  # the base model family's diffusers pipeline


def override_card(info: CardInfo, overrides: dict[str, Any]) -> CardInfo:
    for key, value in overrides.items():
        if not hasattr(info, key):
            raise TypeError(f"Unknown model card field {key!r}.")
        if value is not None:
            setattr(info, key, value)
    return info


# ------------------------------------------------------------------------------------------------- summaries
def _series(log_history: list[dict[str, Any]], key: str) -> list[tuple[int, float]]:
    return [
        (int(h.get("step", 0)), float(h[key]))
        for h in log_history
        if key in h and isinstance(h[key], (int, float)) and math.isfinite(h[key])
    ]


def reward_summary(info: CardInfo) -> list[dict[str, Any]]:
    """Per reward: weight, first and final logged batch mean (``rewards/{name}/mean``), best, number of logs."""
    rows = []
    for name, weight in zip(info.reward_names, info.reward_weights):
        series = _series(info.log_history, f"rewards/{name}/mean")
        values = [v for _, v in series]
        rows.append(
            {
                "name": name,
                "weight": weight,
                "first": values[0] if values else None,
                "final": values[-1] if values else None,
                "best": max(values) if values else None,
                "final_step": series[-1][0] if series else None,
                "num_logs": len(values),
            }
        )
    return rows


def coefficient_summary(info: CardInfo, max_rows: int = 8) -> dict[str, Any] | None:
    """MARBLE's coefficients: final alpha_bar, the range of alpha* over refreshes, and a thinned trajectory."""
    from ..balance.registry import BALANCER_AGGREGATIONS

    if info.aggregation not in BALANCER_AGGREGATIONS:
        return None
    names = info.reward_names
    k = len(names)
    alpha_star = {n: [v for _, v in _series(info.log_history, f"marble/alpha/{n}")] for n in names}
    bar_series = {n: _series(info.log_history, f"marble/alpha_bar/{n}") for n in names}
    steps = [s for s, _ in bar_series[names[0]]]
    state = info.balancer_state or {}
    final = state.get("alpha_bar") or [bar_series[n][-1][1] if bar_series[n] else 1.0 / k for n in names]
    trajectory = [(steps[i], [bar_series[n][i][1] for n in names]) for i in range(len(steps))]
    if len(trajectory) > max_rows:
        picks = sorted({round(j * (len(trajectory) - 1) / (max_rows - 1)) for j in range(max_rows)})
        trajectory = [trajectory[i] for i in picks]
    return {
        "initial": [1.0 / k] * k,
        "final": [float(a) for a in final],
        "alpha_star_min": [min(alpha_star[n]) if alpha_star[n] else None for n in names],
        "alpha_star_max": [max(alpha_star[n]) if alpha_star[n] else None for n in names],
        "alpha_star_mean": [sum(alpha_star[n]) / len(alpha_star[n]) if alpha_star[n] else None for n in names],
        "num_refreshes": int(state.get("num_refreshes", len(steps))),
        "num_qp_fallbacks": state.get("num_qp_fallbacks"),
        "num_clamp_violations": state.get("num_clamp_violations"),
        "trajectory": trajectory,
        "worst_cos": [v for _, v in _series(info.log_history, "marble/worst_cos")],
    }


def sampling_settings(training_args: dict[str, Any]) -> dict[str, Any]:
    """How the run generated images (rollouts, ``trainer.generate``): the defaults of ``marble-trl generate``."""
    return {
        "num_inference_steps": training_args.get("num_sample_steps"),
        "guidance_scale": training_args.get("guidance_scale", 1.0),
        "resolution": training_args.get("resolution"),
        "scheduler": training_args.get("sample_scheduler", "pipeline"),
        "max_sequence_length": training_args.get("max_sequence_length"),
        "negative_prompt": training_args.get("negative_prompt", ""),
        "num_frames": training_args.get("num_frames"),
    }


def hub_base_model(name: str | None) -> str | None:
    """``name`` if it looks like a Hub model id (``org/name``), else ``None`` (local paths, the tiny model)."""
    if not name or is_tiny(name) or name.startswith((".", "/", "~")) or Path(name).expanduser().exists():
        return None
    return name if re.fullmatch(r"[\w.-]+/[\w.-]+", name) else None


# ------------------------------------------------------------------------------------------------- rendering
def _fmt(value: Any) -> str:
    if value is None:
        return "n/a"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, float):
        return f"{value:.4g}"
    if isinstance(value, (list, tuple)):
        return ", ".join(str(v) for v in value)
    return str(value).replace("|", "\\|")


def _table(header: list[str], rows: list[list[Any]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "| " + " | ".join("---" for _ in header) + " |"]
    lines += ["| " + " | ".join(_fmt(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def _usage_snippet(info: CardInfo) -> str:
    settings = sampling_settings(info.training_args)
    repo = info.repo_id or "path/to/this/folder"
    base = info.base_model or "<base model>"
    steps = settings["num_inference_steps"] or 40
    res = settings["resolution"]
    size = f", height={res}, width={res}" if res else ""
    from ..models.family import family_of_pipeline_class

    family = family_of_pipeline_class(info.pipeline_class)
    guidance = "".join(f", {k}={_fmt(v) if isinstance(v, float) else repr(v)}"
                       for k, v in family.call_kwargs(float(settings["guidance_scale"] or 1.0)).items())  # fmt: skip
    frames = f", num_frames={settings['num_frames']}" if family.video and settings.get("num_frames") else ""
    call = f'image = pipe("a photo of a cat", num_inference_steps={steps}{guidance}{size}{frames}).images[0]'
    if family.editing:  # the image to edit, at the size the model was trained to condition on
        offline = is_tiny(base) or base == SHAPES_EDIT_MODEL_NAME  # conditioned on 32 x 32 sources
        side = TINY_SOURCE_RESOLUTION if offline else family.pipeline_source_resolution
        extra = "".join(f", {k}={v!r}" for k, v in family.edit_call_kwargs(res).items()) if res else ""
        call = (
            "from diffusers.utils import load_image\n\n"
            f'source = load_image("path/to/your/image.png").resize(({side}, {side}))  # the image to edit\n'
            f'image = pipe(image=source, prompt="make the cat blue", num_inference_steps={steps}{guidance}{size}'
            f"{extra}).images[0]"
        )
    if is_tiny(base):
        load = (
            "from marble_trl.models import load_model\n\n"
            f'pipe = load_model("{base}", tiny_seed={info.tiny_seed or 0}).pipeline  # the offline tiny model this '
            f"{'model' if info.lora_format == 'full' else 'LoRA'} was trained on"
        )
    else:
        load = (
            f"import torch\nfrom diffusers import {info.pipeline_class}\n\n"
            f'pipe = {info.pipeline_class}.from_pretrained("{base}", torch_dtype=torch.bfloat16).to("cuda")'
        )
    if family.video:
        call = call.replace("image = ", "video = ").replace(").images[0]", ").frames[0]  # [frames, H, W, 3]")
    if info.lora_format == "full":
        attach = (
            "from diffusers import AutoModel\n\n"
            f'pipe.transformer = AutoModel.from_pretrained("{repo}", subfolder="transformer", '
            "torch_dtype=pipe.transformer.dtype).to(pipe.device)  # the fine-tuned transformer"
        )
    elif info.lora_format == "peft":
        attach = (
            "from peft import PeftModel\n\n"
            f'PeftModel.from_pretrained(pipe.transformer, "{repo}")  # injects the LoRA into pipe.transformer'
        )
    else:
        attach = f'pipe.load_lora_weights("{repo}")'
    return f"```python\n{load}\n{attach}\n{call}\n```"


def _tiny_flag(info: CardInfo) -> str:
    return f" --tiny_seed {info.tiny_seed}" if is_tiny(info.base_model) and info.tiny_seed else ""


def render_model_card(info: CardInfo) -> str:
    """The card (YAML front matter + Markdown) as a string."""
    from huggingface_hub import ModelCardData

    hub_base = hub_base_model(info.base_model)
    full = info.lora_format == "full"
    from ..models.family import family_of_pipeline_class

    task = "image-to-image" if family_of_pipeline_class(info.pipeline_class).editing else "text-to-image"
    tags = [task if t == "text-to-image" else t for t in CARD_TAGS if not (full and t == "lora")]
    tags = list(dict.fromkeys([*tags, *info.tags]))
    data = ModelCardData(
        library_name="diffusers",
        base_model=hub_base,
        license=info.license,
        tags=tags,
        pipeline_tag=task,
        widget=[{"text": prompt, "output": {"url": path}} for path, prompt in info.samples] or None,
    )
    multi = len(info.reward_names) > 1
    method = "MARBLE on DiffusionNFT" if info.aggregation == "marble" else "DiffusionNFT"
    kind = "full fine-tune" if full else "LoRA"
    title = info.model_name or (info.repo_id.split("/")[-1] if info.repo_id else f"{method} {kind}")
    base_text = f"[{hub_base}](https://huggingface.co/{hub_base})" if hub_base else f"`{info.base_model or 'unknown'}`"
    weights = f"the parameter EMA of the {kind} weights" if info.weights == "ema" else f"the trained {kind} weights"
    fmt = {
        "diffusers": "diffusers format (`pytorch_lora_weights.safetensors`, with adapter metadata)",
        "peft": "PEFT format (`adapter_model.safetensors` + `adapter_config.json`)",
        "full": "a diffusers model folder (`transformer/`, safetensors): the whole transformer",
    }[info.lora_format]
    parts = [
        f"---\n{data.to_yaml()}\n---",
        f"# {title}",
        f"{'A full fine-tune of the transformer of' if full else 'A LoRA for'} {base_text}, trained with marble_trl ({method}: online RL for text-to-image diffusion, a "
        f"[TRL](https://github.com/huggingface/trl) extension) for {info.global_step} optimizer steps on "
        f"{len(info.reward_names)} reward{'s' if multi else ''}: "
        + ", ".join(f"`{n}`" for n in info.reward_names)
        + f". This folder holds {weights} in {fmt}.",
        "## Usage",
        _usage_snippet(info),
        "The snippet uses the sampler settings of training (rollouts were CFG-free when `guidance_scale` is 1). "
        f"With marble_trl installed: `marble-trl generate --model {info.base_model or '<base>'}{_tiny_flag(info)} "
        "--lora <this folder> "
        '--prompts "a photo of a cat"` reads them from `marble_trl.json`.',
        "## Rewards",
    ]
    rows = [[r["name"], r["weight"], r["first"], r["final"], r["best"], r["final_step"]] for r in reward_summary(info)]
    parts.append(
        "Batch means of each reward over the rollouts of a logged step (`rewards/{name}/mean`), at the first and the "
        "last logged step of training:\n\n"
        + _table(["reward", "weight", "first", "final", "best", "final step"], rows)
    )
    coeffs = coefficient_summary(info)
    if coeffs is not None:
        k = len(info.reward_names)
        rows = [
            [
                n,
                coeffs["initial"][i],
                coeffs["final"][i],
                coeffs["alpha_star_min"][i],
                coeffs["alpha_star_max"][i],
                coeffs["alpha_star_mean"][i],
            ]
            for i, n in enumerate(info.reward_names)
        ]
        text = [
            "## MARBLE coefficients",
            f"The update balanced the {k} per-reward gradients with the MGDA min-norm QP, refreshed "
            f"{coeffs['num_refreshes']} times (every {info.training_args.get('marble_refresh_interval', '?')} steps), "
            f"with EMA rho = {info.training_args.get('marble_rho', '?')} on the coefficients (alpha_bar). "
            f"QP fallbacks: {_fmt(coeffs['num_qp_fallbacks'])}; clamp violations: "
            f"{_fmt(coeffs['num_clamp_violations'])}.",
            _table(
                ["reward", "initial alpha_bar", "final alpha_bar", "min alpha*", "max alpha*", "mean alpha*"], rows
            ),
        ]
        if coeffs["trajectory"]:
            text.append(
                "alpha_bar after refreshes (thinned):\n\n"
                + _table(
                    ["step", *info.reward_names],
                    [[step, *values] for step, values in coeffs["trajectory"]],
                )
            )
        if coeffs["worst_cos"]:
            worst = coeffs["worst_cos"]
            text.append(
                f"Worst per-reward cosine of the refresh updates (min_k cos(d, g_k)): min {_fmt(min(worst))}, "
                f"mean {_fmt(sum(worst) / len(worst))} (>= 0: no reward's gradient was opposed)."
            )
        parts += text
    elif multi:
        parts += ["## Aggregation", f"The rewards were combined with `{info.aggregation}` (no MARBLE balancing)."]
    shown = [k for k in CARD_CONFIG_FIELDS if not (k.startswith("lora_") if full else k in FULL_FIELDS)]
    config_rows = [[f"`{k}`", info.training_args[k]] for k in shown if k in info.training_args]
    config_rows.insert(0, ["optimizer steps", info.global_step])
    parts += ["## Training configuration", _table(["setting", "value"], config_rows)]
    if info.dataset_name:
        parts.append(f"Prompts: `{info.dataset_name}`.")
    if info.samples:
        images = "\n".join(f"![{prompt}]({path})" for path, prompt in info.samples)
        captions = "\n".join(f"{i + 1}. {prompt}" for i, (_, prompt) in enumerate(info.samples))
        parts += [
            "## Samples",
            f"Generated with this {kind} ({info.weights} weights), seed 0:\n\n{images}\n\n{captions}",
        ]
    else:
        parts += ["## Samples", "No sample images were rendered for this folder (see `marble-trl generate`)."]
    parts += [
        "## Framework",
        f"marble_trl {__version__}: TRL's trainer base, diffusers pipelines"
        + (", full fine-tuning of the transformer." if full else ", PEFT LoRA."),
        "## Citations",
        f"MARBLE (arXiv 2605.06507):\n\n```bibtex\n{MARBLE_CITATION}\n```",
        f"DiffusionNFT (arXiv 2509.16117):\n\n```bibtex\n{DIFFUSIONNFT_CITATION}\n```",
        f"TRL:\n\n```bibtex\n{TRL_CITATION}\n```",
    ]
    return "\n\n".join(parts) + "\n"


def write_model_card(info: CardInfo, folder: str | os.PathLike) -> Path:
    path = Path(folder) / "README.md"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(render_model_card(info), encoding="utf-8")
    return path
