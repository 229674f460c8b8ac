"""The memory savers (docs/distributed.md#memory-savers; offloaded rewards: tests/test_rewards_builtin.py).

- The prompt-embedding cache (``cache_prompt_embeddings``): cached rows joined back equal the family's own batch
  encoding for every family (Qwen-Image's padding and mask included); a cached run trains as the uncached one, the text
  encoders never called after the cache is built and moved off the accelerator; a prompt outside the cache is encoded
  once, with a warning.
- Offloaded text encoders (``offload_text_encoders``): the run is the plain run, the encoders stay on the CPU and
  visit the device only inside each encoding (also when it fails).
- 8-bit AdamW (``optim="adamw_8bit"``, bitsandbytes): the moments are stored in 8 bits, training moves the LoRA, and a
  run resumed from its checkpoint equals the uninterrupted one.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from datasets import Dataset
from tiny import brightness, contrast, tiny_args

from marble_trl import MarbleDiffusionNFTTrainer
from marble_trl.data.prompts import load_prompt_dataset
from marble_trl.models import FAMILIES, load_model
from marble_trl.models.prompt_cache import PromptEmbeddingCache, dataset_prompts, encoders_visiting, text_encoders

pytestmark = pytest.mark.filterwarnings("ignore:Already found a `peft_config`:UserWarning")

CPU = torch.device("cpu")
# Lengths differ in tokens, so Qwen-Image pads all but the longest and gives a mask.
MAX_LEN = 48  # tokens: the tiny Qwen-Image tokenizer has one per byte, so no prompt is truncated
PROMPTS = ["a red apple", "a small blue boat on a quiet lake at dawn", "two cats", "a red apple"]


def _fields(cond) -> dict:
    return dict(vars(cond))


def _assert_same(a, b, atol: float) -> None:
    assert type(a) is type(b)
    for name, x in _fields(a).items():
        y = getattr(b, name)
        if x is None or y is None:
            assert x is None and y is None, name
        elif isinstance(x, list):
            assert len(x) == len(y), name
            for u, v in zip(x, y):
                torch.testing.assert_close(u, v, rtol=0, atol=atol, msg=name)
        else:
            assert x.shape == y.shape and x.dtype == y.dtype, name
            torch.testing.assert_close(x, y, rtol=0, atol=atol, msg=name)


def _sources(adapter) -> dict:
    """An editing family's source images for :data:`PROMPTS` (the repeated prompt with another image)."""
    if not adapter.editing:
        return {}
    side = adapter.source_resolution
    return {"source_images": torch.rand(len(PROMPTS), 3, side, side, generator=torch.Generator().manual_seed(0))}


# Qwen-Image-Edit's prompt rows depend on their image: it refuses the cache (tests/test_editing.py)
CACHEABLE = [f.tiny_name for f in FAMILIES if not getattr(f, "prompt_sees_image", False)]


@pytest.mark.parametrize("name", CACHEABLE)
def test_cached_rows_join_into_the_familys_batch_encoding(name):
    adapter = load_model(name)
    guidance = 3.5 if adapter.guidance == "embedded" else 1.0
    sources = _sources(adapter)
    direct = adapter.encode(PROMPTS, MAX_LEN, CPU, guidance, **sources)
    cache = PromptEmbeddingCache(adapter)
    cache.add(PROMPTS[::-1], MAX_LEN, CPU, guidance, batch_size=1)  # other batches, other order: one at a time
    adapter.prompt_cache = cache
    cached = adapter.encode(PROMPTS, MAX_LEN, CPU, guidance, **sources)
    # Encoded one at a time instead of in one batch: equal up to float rounding of the encoders' products.
    _assert_same(direct, cached, atol=1e-5)
    assert len(cache) == 3 and cache.misses == 0 and cache.nbytes > 0
    if adapter.family == "qwen-image":
        assert direct.mask is not None  # the test exercises the padded, masked case
        assert cached.index([2]).prompt_embeds.shape == direct.index([2]).prompt_embeds.shape


class _Calls:
    def __init__(self, modules):
        self.count = 0
        self.handles = [m.register_forward_hook(self._hook) for m in modules]

    def _hook(self, *_):
        self.count += 1


SAVER_RUNS = [("tiny", 1.0, s) for s in ("cache_prompt_embeddings", "offload_text_encoders")]
SAVER_RUNS += [(f.tiny_name, "on", "offload_text_encoders") for f in FAMILIES]
SAVER_RUNS += [(f.tiny_name, "on", "cache_prompt_embeddings") for f in FAMILIES if f.tiny_name in CACHEABLE]


@pytest.mark.parametrize(("name", "guidance", "saver"), SAVER_RUNS)
def test_saver_trains_as_the_plain_run_with_the_text_encoders_on_the_cpu(tmp_path, saver, name, guidance):
    """Every family, with guidance on (CFG with the negative prompt; FLUX's embedded guidance) and, on SD3, off; an
    editing family on the ShapesBench edits (its rows' source images)."""
    family = next(f for f in FAMILIES if f.tiny_name == name)
    if family.editing:
        from marble_trl.data.sources import load_source

        dataset = load_source("shapes_edit").select(range(16))
        eval_set = load_source("shapes_edit_eval").select(range(1))
    else:
        dataset = load_prompt_dataset()
        eval_set = Dataset.from_dict({"prompt": ["a prompt only the evaluation uses"]})
    if guidance == "on":
        guidance = 3.5 if family.guidance == "embedded" else 2.0
    runs, logs, calls = {}, {}, {}
    for on in (False, True):
        args = tiny_args(
            tmp_path / str(on), max_steps=2, guidance_scale=guidance, lora_target_modules=None, **{saver: on}
        )
        trainer = MarbleDiffusionNFTTrainer(
            name, [brightness, contrast], args=args, train_dataset=dataset, eval_dataset=eval_set
        )
        calls[on] = _Calls(text_encoders(trainer.pipeline))
        trainer.train()
        runs[on] = {n: p.detach().clone() for n, p in trainer.trainable_parameters().items()}
        logs[on] = {
            k: torch.tensor([h[k] for h in trainer.state.log_history if k in h]) for k in ("loss", "grad_norm")
        }
        assert trainer.model_adapter.text_encoders_offloaded == on
    for module in text_encoders(trainer.pipeline):
        assert all(p.device == CPU for p in module.parameters())
    cache = trainer.model_adapter.prompt_cache
    if saver == "offload_text_encoders":
        assert cache is None and calls[True].count == calls[False].count > 0  # each step encodes, as without it
        tolerance = 0.0  # the same computation, on the same device here
    else:
        # Train and eval prompts, the negative prompt under CFG; FLUX's conditioning holds the guidance scale, so its
        # prompts are cached at the training scale and at the evaluation's (eval_guidance_scale 1.0).
        expected = len(dataset_prompts(dataset, eval_set))
        if family.guidance == "embedded" and guidance != 1.0:
            expected *= 2
        assert len(cache) == expected + int(trainer.model_adapter.needs_negative(guidance))
        assert calls[True].count == 0 and cache.misses == 0  # built before the hooks: never called while training
        # Rows encoded in other batches round differently (~1e-7), and Adam's normalised steps carry that into the
        # LoRA (measured: 1.5e-4 after 2 steps on one VM, 1.4e-3 on another, where a near-zero gradient's step
        # turned). atol = half of one step of lr 1e-2: a wrong row moves its parameters by whole steps.
        tolerance = 5e-3
    assert runs[False].keys() == runs[True].keys()
    for n in runs[False]:
        torch.testing.assert_close(runs[True][n], runs[False][n], rtol=0, atol=tolerance, msg=n)
    for key in ("loss", "grad_norm"):
        torch.testing.assert_close(logs[True][key], logs[False][key], rtol=1e-3 if tolerance else 0, atol=0, msg=key)


class _Recording(torch.nn.Linear):
    """Records where it is sent instead of going (this machine may have no second device)."""

    def __init__(self, moves: list) -> None:
        super().__init__(2, 2)
        self.moves = moves

    def to(self, device, *args, **kwargs):
        self.moves.append(str(device))
        return self


def test_encoders_visit_the_device_for_the_block_and_go_back_after_an_error():
    moves: list = []
    pipe = SimpleNamespace(text_encoder=_Recording(moves), text_encoder_2=None, text_encoder_3=_Recording(moves))
    with pytest.raises(RuntimeError, match="boom"), encoders_visiting(pipe, torch.device("cuda")):
        assert moves == ["cuda", "cuda"]
        raise RuntimeError("boom")
    assert moves == ["cuda", "cuda", "cpu", "cpu"]
    with encoders_visiting(pipe, CPU):  # already there: nothing moves
        pass
    assert len(moves) == 4


def test_a_prompt_outside_the_cache_is_encoded_once_with_a_warning():
    adapter = load_model("tiny")
    cache = PromptEmbeddingCache(adapter)
    cache.add(["a cached prompt"], 8, CPU)
    adapter.prompt_cache = cache
    with pytest.warns(UserWarning, match="not in the prompt-embedding cache"):
        first = adapter.encode(["a cached prompt", "a new prompt"], 8, CPU)
    calls = _Calls(text_encoders(adapter.pipeline))
    again = adapter.encode(["a new prompt"], 8, CPU)
    assert cache.misses == 1 and calls.count == 0 and len(cache) == 2
    _assert_same(first.index([1]), again, atol=0)


def test_8bit_adamw_keeps_8bit_moments_and_resumes_exactly(tmp_path):
    pytest.importorskip("bitsandbytes")
    # r=128 on the tiny model's 32-wide layers: 4096-element LoRA matrices, bitsandbytes' minimum for 8-bit state.
    settings = dict(optim="adamw_8bit", lora_r=128, lora_alpha=128, max_steps=2, save_strategy="steps", save_steps=1)
    rewards = [brightness, contrast]
    dataset = load_prompt_dataset()

    def run(name, resume=None):
        args = tiny_args(tmp_path / name, **settings)
        trainer = MarbleDiffusionNFTTrainer("tiny", rewards, args=args, train_dataset=dataset)
        trainer.train(resume_from_checkpoint=resume)
        return trainer, {n: p.detach().clone() for n, p in trainer.trainable_parameters().items()}

    trainer, full = run("full")
    assert type(trainer.optimizer.optimizer).__module__.startswith("bitsandbytes")
    state = trainer.optimizer.optimizer.state
    large = [state[p] for p in trainer.trainable_parameters().values() if p.numel() >= 4096]
    assert large and all(s["state1"].dtype == s["state2"].dtype == torch.uint8 for s in large)
    _, resumed = run("resumed", resume=str(tmp_path / "full" / "checkpoint-1"))
    for n in full:
        torch.testing.assert_close(resumed[n], full[n], rtol=0, atol=0, msg=n)
