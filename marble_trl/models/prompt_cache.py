"""Text encoders off the accelerator: offloaded between encodings (``offload_text_encoders``), or not needed at all
after every prompt is encoded once before training (the prompt-embedding cache, ``cache_prompt_embeddings``).

SD3.5's text encoders are 10.4 GiB in bf16 (T5-XXL alone 8.9 GiB, docs/distributed.md) and the trainer uses them only
to turn a step's prompts into conditioning. With the cache, :func:`build_prompt_cache` encodes the train and eval
prompts (and the negative prompt) in batches on the accelerator, keeps each prompt's conditioning row in CPU memory,
and moves the text encoders to the CPU. During training :meth:`PromptEmbeddingCache.lookup` joins the cached rows
(:meth:`~marble_trl.models.base.RowConditioning.concat`, as the family's pipeline batches them) and moves them to the
device. A prompt that was not cached (a prompt source the datasets do not list) is encoded once, with a warning, by the
text encoders visiting the device (:func:`encoders_visiting`), as every step's encoding does with
``offload_text_encoders`` alone: the encoders live in CPU memory and visit the device for each step's prompts (two
host-device copies of their weights per step, no cache in RAM).

A row is what the family's encoder gives for the prompt; cached rows are encoded in other batches than the step's, so
they can differ from a per-step encoding by the batch-size dependence of the encoders' matrix products (float
rounding); everything else is identical (tests/test_memory_savers.py).
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable
from contextlib import contextmanager
from typing import Any

import torch

TEXT_ENCODERS = ("text_encoder", "text_encoder_2", "text_encoder_3")


def text_encoders(pipeline) -> list[torch.nn.Module]:
    """The pipeline's text encoders that exist."""
    return [m for m in (getattr(pipeline, name, None) for name in TEXT_ENCODERS) if m is not None]


def text_encoder_device(pipeline, default: torch.device) -> torch.device:
    """Where the pipeline's text encoders are (the first one's parameters), else ``default``."""
    for module in text_encoders(pipeline):
        for p in module.parameters():
            return p.device
    return default


def offload_text_encoders(pipeline, device: torch.device | str = "cpu") -> int:
    """Move the text encoders to ``device``; returns the bytes of their parameters and buffers moved."""
    moved = 0
    for module in text_encoders(pipeline):
        moved += sum(t.numel() * t.element_size() for t in [*module.parameters(), *module.buffers()])
        module.to(device)
    if torch.device(device).type == "cpu" and torch.cuda.is_available():
        torch.cuda.empty_cache()
    return moved


@contextmanager
def encoders_visiting(pipeline, device: torch.device):
    """The text encoders on ``device`` inside the block, back where they were after it (also on an error)."""
    home = text_encoder_device(pipeline, device)
    if home == torch.device(device):
        yield
        return
    offload_text_encoders(pipeline, device)
    try:
        yield
    finally:
        offload_text_encoders(pipeline, home)


class PromptEmbeddingCache:
    """Each prompt's conditioning row, keyed by ``(prompt, max_sequence_length, guidance_scale)``, in CPU memory (the
    guidance scale only for families that embed it in the conditioning, FLUX.1-dev; the others' rows do not depend
    on it)."""

    def __init__(self, adapter, storage: torch.device | str = "cpu") -> None:
        self.adapter = adapter
        self.storage = torch.device(storage)
        self._rows: dict[tuple[str, int, float], Any] = {}
        self.misses = 0  # prompts encoded after the cache was built (lookups that found no row)
        self._warned = False

    def __len__(self) -> int:
        return len(self._rows)

    def key(self, prompt: str, max_sequence_length: int, guidance_scale: float) -> tuple[str, int, float]:
        embedded = getattr(self.adapter, "guidance", "cfg") == "embedded"
        return prompt, int(max_sequence_length), float(guidance_scale) if embedded else 0.0

    @property
    def nbytes(self) -> int:
        """The bytes of the cached rows' tensors."""
        total = 0
        for row in self._rows.values():
            for value in vars(row).values():
                tensors = value if isinstance(value, list) else [value]
                total += sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))
        return total

    def add(self, prompts: list[str], max_sequence_length: int, device: torch.device, guidance_scale: float = 1.0,
            batch_size: int = 32) -> None:  # fmt: skip
        """Encode the distinct ``prompts`` not cached yet, ``batch_size`` at a time on ``device``, and store them."""
        todo = [
            p for p in dict.fromkeys(prompts) if self.key(p, max_sequence_length, guidance_scale) not in self._rows
        ]
        for start in range(0, len(todo), batch_size):
            chunk = todo[start : start + batch_size]
            with torch.no_grad():
                cond = self.adapter._encode(chunk, max_sequence_length, device, guidance_scale)
            for i, prompt in enumerate(chunk):
                self._rows[self.key(prompt, max_sequence_length, guidance_scale)] = cond.row(i).to(self.storage)

    def lookup(self, prompts: list[str], max_sequence_length: int, device: torch.device, guidance_scale: float = 1.0):
        """The conditioning of the distinct ``prompts`` on ``device``; missing prompts are encoded by the text
        encoders visiting ``device``, and cached (with a warning the first time)."""
        keys = [self.key(p, max_sequence_length, guidance_scale) for p in prompts]
        missing = [p for p, k in zip(prompts, keys) if k not in self._rows]
        if missing:
            self.misses += len(missing)
            if not self._warned:
                self._warned = True
                warnings.warn(
                    f"{len(missing)} prompt(s) (e.g. {missing[0]!r}) were not in the prompt-embedding cache "
                    "(cache_prompt_embeddings): the text encoders visit the device to encode them, which needs "
                    "their memory free there for a moment. Put every prompt the run uses in the train or eval "
                    "dataset so the cache holds them.",
                    stacklevel=3,
                )
            with encoders_visiting(self.adapter.pipeline, device):
                self.add(missing, max_sequence_length, device, guidance_scale)
        rows = [self._rows[k] for k in keys]
        return type(rows[0]).concat(rows).to(device)


def dataset_prompts(*datasets: Any) -> list[str]:
    """The distinct ``prompt`` values of the given datasets (a dataset, a dict of them, or ``None``), in order."""
    prompts: list[str] = []
    for dataset in datasets:
        for ds in dataset.values() if isinstance(dataset, dict) else [dataset]:
            if ds is not None and "prompt" in (getattr(ds, "column_names", None) or []):
                prompts.extend(ds["prompt"])
    return list(dict.fromkeys(prompts))


def build_prompt_cache(adapter, prompts: Iterable[str], args, device: torch.device) -> PromptEmbeddingCache:
    """Encode ``prompts`` (and the negative prompt when rollouts or evaluation use CFG) on ``device``, install the
    cache on the adapter and move the text encoders to the CPU."""
    cache = PromptEmbeddingCache(adapter)
    prompts, batch = list(prompts), args.per_device_train_batch_size
    for scale in dict.fromkeys([args.guidance_scale, args.eval_guidance_scale]):  # rollouts' and evaluation's
        cache.add(prompts, args.max_sequence_length, device, scale, batch)
        if adapter.needs_negative(scale):
            cache.add([args.negative_prompt], args.max_sequence_length, device)
    adapter.prompt_cache = cache
    offload_text_encoders(adapter.pipeline, "cpu")
    adapter.text_encoders_offloaded = True
    return cache
