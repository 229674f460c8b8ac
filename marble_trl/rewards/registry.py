"""Reward lookup: callables, registered names, or dotted import paths (for YAML configs)."""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable, Sequence
from typing import Any

from .base import RewardFunc

# name -> factory. A factory is either a reward function itself (options not accepted) or a class/function that
# takes the per-reward options as keyword arguments and returns a reward function.
_REGISTRY: dict[str, tuple[Callable[..., Any], bool]] = {}


def register_reward(name: str, *, factory: bool = False) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Register a reward under ``name``. With ``factory=True`` the object is called with the per-reward options
    (model path, device, dtype, batch size, ...) to build the reward; otherwise it is the reward itself."""

    def deco(obj: Callable[..., Any]) -> Callable[..., Any]:
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
    """Sorted names of the registered rewards."""
    _import_builtins()
    return sorted(_REGISTRY)


def _import_builtins() -> None:
    # Importing the modules registers their rewards; heavy dependencies inside them are imported lazily.
    from . import jpeg, shapes, simple, video  # noqa: F401

    for optional in ("ocr", "clip_family", "hpsv2", "imagereward", "http", "geneval"):
        try:
            importlib.import_module(f"{__package__}.{optional}")
        except ModuleNotFoundError as err:
            if err.name != f"{__package__}.{optional}":
                raise


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
    _import_builtins()
    if spec in _REGISTRY:
        obj, is_factory = _REGISTRY[spec]
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
