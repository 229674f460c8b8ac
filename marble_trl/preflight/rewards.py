"""The rewards of a recipe, checked without running them: each name resolves in the registry (built with its options:
cheap, the weights load on the first call), its optional dependencies import, its weights are on this machine (the
Hub cache, read offline) or will be downloaded, its server answers, its size on the GPU when known, and the share of
the dataset's prompts it applies to (a reward returns ``None`` for a row it does not apply to)."""

from __future__ import annotations

import os
import socket
import typing
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import cache
from typing import Any
from urllib.parse import urlparse

from .report import Report

FEW = 0.05  # a reward applying to fewer prompts than this share of a step: a warning (none: an error)
# Optional dependencies by reward object class, and the extra of pyproject.toml that installs them.
EXTRAS = {"OCRReward": (("rapidocr", "onnxruntime"), "ocr"), "GenEvalReward": (("scipy",), "geneval")}


def _ocr_rule(prompts, columns):
    from ..rewards.ocr import quoted_text

    return [quoted_text(p) is not None for p in prompts]


def _geneval_rule(prompts, columns):
    from ..rewards.geneval.metadata import row_metadata

    return [m is not None for m in row_metadata(columns, len(prompts))]


def _family_rule(name: str):
    def rule(prompts, columns):  # marble_trl.shapesbench.scorers: None outside the reward's prompt family
        family = columns.get("family")
        return [family is not None and family[i] == name for i in range(len(prompts))]

    return rule


# reward name -> (the documented rule, the rows it applies to). Rewards not here and not typed list[float] have no
# cheap rule: their share is not estimated.
RULES: dict[str, tuple[str, Callable[[list[str], dict], list[bool]]]] = {
    "ocr": ("prompts with text between double quotes", _ocr_rule),
    "geneval": ("rows with GenEval metadata (an 'include' list)", _geneval_rule),
    **{
        f"shapes_{n}": (f"rows whose 'family' column is {n!r}", _family_rule(n))
        for n in ("color", "count", "position")
    },
}
ALWAYS = {f"shapes_{n}" for n in ("alignment", "preference", "fidelity", "judge", "retrieval", "diversity")}


@dataclass
class RewardSizes:
    """Bytes of reward models on the GPU: kept there, or visiting while scoring (offloaded: each reward brings its
    weights for its own call and takes them back, so one visits at a time and ``visiting`` is the largest)."""

    resident: int = 0
    visiting: int = 0
    notes: list[str] = field(default_factory=list)
    on_gpu: list[str] = field(default_factory=list)  # names of the model rewards placed on a GPU, for the fixes


def resolve_each(specs: Sequence[str], reward_kwargs: Mapping | None, report: Report) -> dict[str, Any]:
    """Every reward built by the registry with its options (``get_reward``), each failure an error of its own."""
    from ..rewards import available_rewards, get_reward

    out = {}
    for spec in specs:
        try:
            out[spec] = get_reward(spec, **dict((reward_kwargs or {}).get(spec) or {}))
        except (ValueError, TypeError, ImportError) as err:
            known = available_rewards()
            fix = f"remove {spec!r} from reward_funcs, or name a registered reward or a dotted path (see the error)"
            if spec in known:
                fix = f"fix reward_kwargs.{spec} (docs/rewards.md lists its options)"
            report.error("rewards", f"reward {spec!r}: {err}", fix)
    stray = sorted(set(reward_kwargs or {}) - set(specs))
    if stray:
        report.error("rewards", f"reward_kwargs names rewards that are not in reward_funcs: {stray}.",
                     f"remove {stray} from reward_kwargs or add them to reward_funcs")  # fmt: skip
    return out


def check_extras(funcs: Mapping[str, Any], report: Report) -> None:
    """Each reward's optional dependencies import (:func:`marble_trl.rewards._lazy.require`, the message a run
    would fail with at its first call)."""
    from ..rewards._lazy import require

    for spec, fn in funcs.items():
        modules, extra = EXTRAS.get(type(fn).__name__, ((), None))
        for module in modules:
            try:
                require(module, reward=spec, hint=f'pip install "marble-trl[{extra}]"')
            except ImportError as err:
                report.error("rewards", str(err), f'pip install "marble-trl[{extra}]"')
                break


def _repos(fn: Any) -> list[tuple[str, str]]:
    """``(repo or path, file)`` pairs a model reward loads: its ``*_name_or_path`` options (``filename`` for a
    checkpoint file, else the transformers ``config.json``)."""
    out = []
    for key, value in sorted(vars(fn).items()):
        if key.endswith("_name_or_path") and isinstance(value, str):
            main = key == "model_name_or_path" and isinstance(getattr(fn, "filename", None), str)
            pair = (value, fn.filename if main else "config.json")
            if pair not in out:
                out.append(pair)
    return out


def check_weights(funcs: Mapping[str, Any], report: Report) -> None:
    """Weights on this machine (a local path, or the Hub cache read offline), else a note that the first call
    downloads them (an error when the Hub is switched off); reward servers answer a TCP connection."""
    from huggingface_hub import try_to_load_from_cache

    offline = os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes")
    for spec, fn in funcs.items():
        for repo, filename in _repos(fn):
            if os.path.exists(repo):
                continue
            try:
                hit = try_to_load_from_cache(repo, filename)
            except Exception:
                hit = None
            if isinstance(hit, str):
                continue
            message = f"reward {spec!r}: {repo} ({filename}) is not cached; will download {repo} on first use"
            if offline:
                report.error("rewards", message + ", but HF_HUB_OFFLINE is set.",
                             f"download it where the Hub is reachable: huggingface-cli download {repo}")  # fmt: skip
            else:
                report.note("rewards", message + " (every process; share HF_HOME on a cluster).")
        mlp = getattr(fn, "mlp_path", None)
        if isinstance(mlp, str) and mlp.startswith(("http://", "https://")):
            import torch

            if not os.path.isfile(os.path.join(torch.hub.get_dir(), "checkpoints", os.path.basename(mlp))):
                report.note("rewards", f"reward {spec!r}: will download {mlp} on first use.")
        url = getattr(fn, "url", None)
        if isinstance(url, str):
            _probe(spec, url, report)


def _probe(spec: str, url: str, report: Report) -> None:
    parsed = urlparse(url)
    port = parsed.port or (443 if parsed.scheme == "https" else 80)
    try:
        with socket.create_connection((parsed.hostname, port), timeout=1.0):
            report.note("rewards", f"reward {spec!r}: {parsed.hostname}:{port} accepts connections.")
    except OSError as err:
        report.warning(
            "rewards",
            f"reward {spec!r}: nothing answers at {url} from here ({type(err).__name__}); the run fails at its first "
            "scoring unless the server is up by then (docs/rewards.md: serving a reward, a GenEval server).",
            f"start the {spec} server (marble-trl serve-reward --reward {spec} --port {port}) before training",
        )


@cache
def _reward_params(name: str) -> int:
    from .architectures import REWARD_MODELS, count, on_meta

    return count(on_meta(REWARD_MODELS[name]))


def _custom_geneval(fn: Any) -> bool:
    """A geneval reward on other checkpoints than its defaults (their sizes are not known here)."""
    keys = ("detector_name_or_path", "clip_name_or_path")
    return any(hasattr(fn, key) and getattr(fn, key) != _init_default(fn, key) for key in keys)


def reward_sizes(funcs: Mapping[str, Any], report: Report) -> RewardSizes:
    """GPU bytes of the reward models that a run places on a GPU (exact counts of the default checkpoints'
    architectures, in the reward's dtype); rewards on the CPU or remote take none, others are named as unknown."""
    import torch

    from .architectures import REWARD_MODELS

    sizes = RewardSizes()
    for spec, fn in funcs.items():
        device = getattr(fn, "device", None)
        if device is None:
            continue
        device = str(device)
        if not device.startswith("cuda"):
            continue
        default = getattr(type(fn), "default_model", None) or _init_default(fn, "model_name_or_path")
        name = getattr(fn, "reward_name", spec)
        dtype = getattr(fn, "dtype", torch.float32)
        custom = getattr(fn, "model_name_or_path", default) != default or _custom_geneval(fn)
        if name not in REWARD_MODELS or custom:
            report.warning("memory", f"reward {spec!r} runs on {device}, but its size is not recorded: not counted.")
            continue
        size = _reward_params(name) * torch.tensor([], dtype=dtype).element_size()
        if getattr(fn, "offload", False):
            sizes.visiting = max(sizes.visiting, size)
        else:
            sizes.resident += size
        sizes.notes.append(f"{spec} {size / 1024**3:.2f}{' (offloaded)' if getattr(fn, 'offload', False) else ''}")
        sizes.on_gpu.append(spec)
    return sizes


def _init_default(fn: Any, option: str) -> Any:
    import inspect

    param = inspect.signature(type(fn).__init__).parameters.get(option)
    return None if param is None else param.default


def always_applies(fn: Any, name: str) -> bool:
    """A reward whose result never holds ``None``: the model rewards (their ``__call__`` is typed ``list[float]``)
    and the functions typed so."""
    import inspect

    if name in ALWAYS:
        return True
    target = fn if inspect.isfunction(fn) or inspect.ismethod(fn) else type(fn).__call__
    try:
        hint = typing.get_type_hints(target).get("return")
    except Exception:
        return False
    return hint is not None and "None" not in str(hint) and "Optional" not in str(hint)


def applicability(
    funcs: Mapping[str, Any], dataset, ratios: Mapping[str, float] | None, report: Report
) -> list[tuple[str, str, str]]:
    """Each reward's share of the prompts it scores (``None`` elsewhere): per step when the sources have ratios,
    else over the dataset's rows. Rows of the table printed: ``(reward, share, rule)``."""
    from ..data.sources import SOURCE_COLUMN

    rows = []
    prompts = list(dataset["prompt"])
    columns = {c: list(dataset[c]) for c in dataset.column_names if c != "prompt"}
    sources = columns.get(SOURCE_COLUMN)
    for spec, fn in funcs.items():
        name = getattr(fn, "__name__", spec)
        rule = RULES.get(spec) or RULES.get(name)
        if rule is None:
            how = "every prompt (it never returns None)" if always_applies(fn, name) else None
            rows.append((spec, "100%" if how else "not estimated", how or "no cheap rule: it decides per image"))
            if how is None:
                report.note("rewards", f"reward {spec!r}: no cheap rule says which prompts it scores; not estimated.")
            continue
        text, applies = rule
        hits = applies(prompts, columns)
        if sources is not None and ratios:
            share = sum(
                r * _mean([h for h, s in zip(hits, sources) if s == name_]) for name_, r in ratios.items() if r > 0
            )
            scope = "of each step's prompts (source_ratios)"
        else:
            share = _mean(hits)
            scope = f"of the {len(prompts)} prompts"
        rows.append((spec, f"{100 * share:.1f}%", text))
        if share == 0:
            report.error(
                "rewards",
                f"reward {spec!r} applies to none {scope}: it needs {text}. Every step would give it no advantage.",
                f"add prompts with {text} to the dataset, or remove {spec!r} from reward_funcs",
            )
        elif share < FEW:
            report.warning("rewards", f"reward {spec!r} applies to only {100 * share:.1f}% {scope} ({text}).")
    return rows


def _mean(values: list[bool]) -> float:
    return sum(values) / len(values) if values else 0.0
