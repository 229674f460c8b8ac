"""The files of a fully fine-tuned run (``use_peft=False``): the trained transformer as a diffusers model folder
(``transformer/``, sharded safetensors, loadable with ``<Transformer class>.from_pretrained``), and the old policy and
the parameter EMA as safetensors keyed by the transformer's parameter names. The LoRA run's files are
:mod:`.checkpoint`'s; the manifest says which kind a checkpoint holds (``"policy"``)."""

from __future__ import annotations

import os
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from ..artifacts import TRANSFORMER_DIR
from ..distributed import copy_full_

MAX_SHARD_SIZE = "5GB"  # diffusers' default shard size


def save_transformer(
    transformer: nn.Module, folder: str | os.PathLike, state_dict: dict[str, torch.Tensor] | None = None
) -> Path:
    """Write the whole transformer (trained and frozen weights, each in its own dtype) to ``folder/transformer``;
    ``state_dict``: its whole tensors when the module holds shards (FSDP2, :func:`~marble_trl.distributed.
    whole_state_dict`), written by diffusers' own ``save_pretrained`` (which reads ``state_dict()``)."""
    out = Path(folder) / TRANSFORMER_DIR
    if state_dict is not None:
        transformer.__dict__["state_dict"] = lambda *args, **kwargs: state_dict  # shadows the method, this call only
    try:
        transformer.save_pretrained(str(out), safe_serialization=True, max_shard_size=MAX_SHARD_SIZE)
    finally:
        transformer.__dict__.pop("state_dict", None)
    return out


def read_transformer_weights(folder: str | os.PathLike, names: list[str]) -> dict[str, torch.Tensor]:
    """The tensors ``names`` of a saved ``transformer/`` folder (every shard read, only ``names`` kept)."""
    files = sorted((Path(folder) / TRANSFORMER_DIR).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{Path(folder) / TRANSFORMER_DIR} holds no safetensors file: not a full fine-tune.")
    wanted, out = set(names), {}
    for file in files:
        out.update({k: v for k, v in load_file(str(file)).items() if k in wanted})
    missing = sorted(wanted - set(out))
    if missing:
        raise KeyError(f"{folder}: the saved transformer lacks {len(missing)} trained tensors, e.g. {missing[0]!r}.")
    return out


@torch.no_grad()
def load_trained_weights(params: dict[str, nn.Parameter], folder: str | os.PathLike) -> None:
    """Copy a saved transformer's values into the trained ``params`` (by name; FSDP2 shards take their shard)."""
    state = read_transformer_weights(folder, list(params))
    for name, param in params.items():
        copy_full_(param, state[name])


def save_named(tensors: dict[str, torch.Tensor], path: str | os.PathLike) -> None:
    save_file({n: t.detach().cpu().contiguous() for n, t in tensors.items()}, str(path))


def is_full_finetune(folder: str | os.PathLike) -> bool:
    """A folder with a fully fine-tuned transformer (a full run's output folder, checkpoint or export)."""
    return (Path(folder) / TRANSFORMER_DIR / "config.json").is_file()


def load_full_transformer(pipe, folder: str | os.PathLike, weight_name: str | None = None) -> nn.Module:
    """The fine-tuned transformer of ``folder`` as ``pipe``'s transformer class, dtype and device; ``weight_name``
    (e.g. a checkpoint's ``param_ema.safetensors``) overwrites the trained weights it names."""
    base = pipe.transformer
    model = type(base).from_pretrained(str(Path(folder) / TRANSFORMER_DIR), torch_dtype=base.dtype)
    if weight_name is not None:
        overwrite_from_file(model, Path(folder) / weight_name)
    return model.to(base.device)


@torch.no_grad()
def overwrite_from_file(model: nn.Module, path: str | os.PathLike) -> None:
    """Copy the tensors of ``path`` (by parameter name: a full run's EMA or old policy) into ``model``'s parameters;
    a name the model lacks is an error (another run's weights)."""
    state = load_file(str(path))
    unknown = sorted(set(state) - set(model.state_dict()))
    if unknown:
        raise KeyError(f"{path} holds {len(unknown)} tensors the transformer lacks, e.g. {unknown[0]!r}: not this "
                       "run's weights.")  # fmt: skip
    for name, param in model.named_parameters():
        if name in state:
            param.copy_(state[name])
