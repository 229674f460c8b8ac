"""Reward lookup: callables, registered names, or dotted import paths (for YAML configs).

The built-in rewards are a name table (:data:`BUILTIN_REWARDS`: name -> ``"module:attr"`` and whether it is a
factory), imported on first use: the registry imports none of them, so they never import it back, and the ShapesBench
rewards (``shapes_*``, which live with the benchmark) stay outside the trainer's imports. :func:`register_reward` adds
a user's reward under a new name.
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable, Sequence
from typing import Any

from .base import RewardFunc

# name -> (target, factory). A factory is a class/function that takes the per-reward options as keyword arguments and
# returns a reward function; otherwise the target is the reward function itself (options not accepted).
BUILTIN_REWARDS: dict[str, tuple[str, bool]] = {
    "brightness": ("marble_trl.rewards.simple:brightness", False),
    "darkness": ("marble_trl.rewards.simple:darkness", False),
    "saturation": ("marble_trl.rewards.simple:saturation", False),
    "contrast": ("marble_trl.rewards.simple:contrast", False),
    "jpeg_compressibility": ("marble_trl.rewards.jpeg:jpeg_compressibility", False),
    "jpeg_incompressibility": ("marble_trl.rewards.jpeg:jpeg_incompressibility", False),
    "temporal_consistency": ("marble_trl.rewards.video:temporal_consistency", False),
    "clipscore": ("marble_trl.rewards.clip_family:CLIPScore", True),
    "pickscore": ("marble_trl.rewards.clip_family:PickScore", True),
    "aesthetic": ("marble_trl.rewards.clip_family:AestheticScore", True),
    "hpsv2": ("marble_trl.rewards.hpsv2:HPSv2Score", True),
    "imagereward": ("marble_trl.rewards.imagereward:ImageRewardScore", True),
    "ocr": ("marble_trl.rewards.ocr:OCRReward", True),
    "geneval": ("marble_trl.rewards.geneval:geneval", True),
    "http_reward": ("marble_trl.rewards.http:HTTPReward", True),
    "clip_directional": ("marble_trl.rewards.editing:CLIPDirectional", True),
    "preservation": ("marble_trl.rewards.editing:preservation", False),
    "unifiedreward": ("marble_trl.rewards.http:unifiedreward", True),
    **{
        f"shapes_{name}": (f"marble_trl.shapesbench.rewards:shapes_{name}", False)
        for name in (
            "alignment",
            "preference",
            "color",
            "count",
            "position",
            "fidelity",
            "judge",
            "retrieval",
            "diversity",
            "edit_instruction",
            "edit_preservation",
        )
    },  # fmt: skip
}

# Rewards registered at run time (register_reward): name -> (object, factory).
_REGISTRY: dict[str, tuple[Callable[..., Any], bool]] = {}


def register_reward(name: str, *, factory: bool = False) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Register a reward under ``name``. With ``factory=True`` the object is called with the per-reward options
    (model path, device, dtype, batch size, ...) to build the reward; otherwise it is the reward itself."""

    def deco(obj: Callable[..., Any]) -> Callable[..., Any]:
        if name in BUILTIN_REWARDS:
            raise ValueError(f"{name!r} is a built-in reward's name; register yours under another name.")
        if name in _REGISTRY and _REGISTRY[name][0] is not obj:
            raise ValueError(f"A reward named {name!r} is already registered.")
        _REGISTRY[name] = (obj, factory)
        if not factory:
            try:
                obj.__name__ = name
            except (AttributeError, TypeError):
                pass
        return obj

    return deco


def available_rewards() -> list[str]:
    """Sorted names of the built-in and registered rewards."""
    return sorted({*BUILTIN_REWARDS, *_REGISTRY})


def registered(name: str) -> tuple[Callable[..., Any], bool] | None:
    """``(object, factory)`` of a registered or built-in reward name (a built-in's module is imported here; heavy
    dependencies inside it are imported lazily), or ``None``."""
    if name in _REGISTRY:
        return _REGISTRY[name]
    if name not in BUILTIN_REWARDS:
        return None
    target, factory = BUILTIN_REWARDS[name]
    module, _, attr = target.partition(":")
    return getattr(importlib.import_module(module), attr), factory


def _import_dotted(path: str) -> Any:
    module_name, sep, attr = path.partition(":")
    if not sep:
        module_name, _, attr = path.rpartition(".")
    if not module_name or not attr:
        raise ValueError(f"Reward {path!r} is neither a registered name nor a 'module.attr' / 'module:attr' path.")
    try:
        module = importlib.import_module(module_name)
    except ImportError as err:
        raise ValueError(f"Could not import reward {path!r}: {err}.") from err
    if not hasattr(module, attr):
        raise ValueError(f"Reward {path!r}: module {module_name!r} has no attribute {attr!r}.")
    return getattr(module, attr)


def get_reward(spec: str | RewardFunc, **options: Any) -> RewardFunc:
    """Resolve one reward: a callable is returned as is; a registered name is built with ``options``; a dotted
    path ``pkg.module.func`` (or ``pkg.module:func``) is imported (and called with ``options`` if any are given; a
    class is always instantiated, with no arguments when no options are given).

    The signature is checked by the trainer (:func:`~marble_trl.rewards.base.check_reward_signature`), which knows
    the dataset's columns."""
    if callable(spec):
        if options:
            raise ValueError(f"Options {sorted(options)} were given for a reward callable; pass them to it directly.")
        return spec
    if not isinstance(spec, str):
        raise TypeError(f"A reward must be a callable or a string, got {type(spec).__name__}.")
    entry = registered(spec)
    if entry is not None:
        obj, is_factory = entry
        if is_factory:
            fn = obj(**options)
            if getattr(fn, "__name__", None) is None:
                fn.__name__ = spec
            return fn
        if options:
            raise ValueError(f"Reward {spec!r} takes no options, got {sorted(options)}.")
        return obj
    if "." in spec or ":" in spec:
        obj = _import_dotted(spec)
        # A class is built (with its options, or none); a function is the reward itself, or a factory with options.
        return obj(**options) if options or inspect.isclass(obj) else obj
    raise ValueError(
        f"Unknown reward {spec!r}. Known rewards: {', '.join(available_rewards())}; or give a dotted path."
    )


def resolve_reward_funcs(
    specs: Sequence[str | RewardFunc] | str | RewardFunc, reward_kwargs: dict[str, dict[str, Any]] | None = None
) -> list[RewardFunc]:
    """Resolve a list of reward specs; ``reward_kwargs`` maps a reward's name (as written in ``specs``) to its options."""
    if isinstance(specs, str) or callable(specs):
        specs = [specs]
    reward_kwargs = dict(reward_kwargs or {})
    funcs = []
    for spec in specs:
        options = reward_kwargs.pop(spec, {}) if isinstance(spec, str) else {}
        funcs.append(get_reward(spec, **options))
    if reward_kwargs:
        raise ValueError(f"reward_kwargs names rewards that are not in reward_funcs: {sorted(reward_kwargs)}.")
    return funcs
