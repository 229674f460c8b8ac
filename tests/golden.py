"""The golden runs: fixed-seed tiny trainings whose final LoRA is recorded, so that a refactor that changes what a
step computes (even in the last bit) is caught. ``python tests/golden.py`` re-records them (only for a deliberate
change of behaviour: say why in the commit).

Each run covers a different path of the step: MARBLE (refresh, amortised and cosine-diagnostic steps, two
micro-batches, KL on, parameter EMA) and the weighted sum (plain steps, three micro-batches).
"""

from __future__ import annotations

import hashlib
import json
import platform
import sys
from pathlib import Path

import torch
from datasets import Dataset
from tiny import brightness, contrast, redness

from marble_trl import MarbleDiffusionNFTConfig, MarbleDiffusionNFTTrainer
from marble_trl.models import DEFAULT_LORA_TARGETS
from marble_trl.policy.lora import OLD_ADAPTER, TRAIN_ADAPTER, lora_parameters

HERE = Path(__file__).parent
RECORD = HERE / "data" / "golden_runs.json"
TENSORS = HERE / "data" / "golden_runs.safetensors"
PROMPTS = ["a red apple", "a blue car", "a green frog", "a white cat"]


RUNS = {
    "marble": dict(
        rewards=[brightness, contrast, redness],
        args=dict(
            multi_objective_aggregation="marble",
            marble_refresh_interval=2,
            log_update_cosines=True,
            max_steps=4,
            beta=1e-3,
            param_ema=True,
            per_device_train_batch_size=3,
        ),
    ),
    "weighted_sum": dict(
        rewards=[brightness, contrast],
        args=dict(multi_objective_aggregation="sum_then_normalize", max_steps=3, per_device_train_batch_size=2),
    ),
}


def golden_args(output_dir, **overrides) -> MarbleDiffusionNFTConfig:
    kwargs = dict(
        output_dir=str(output_dir),
        report_to="none",
        save_strategy="no",
        disable_tqdm=True,
        logging_steps=1,
        learning_rate=2e-2,
        num_generations=3,
        prompts_per_step=2,
        resolution=16,
        num_sample_steps=3,
        sample_scheduler="euler",
        max_sequence_length=8,
        lora_r=4,
        lora_alpha=8,
        lora_target_modules=[*DEFAULT_LORA_TARGETS, "proj_out"],
        use_cpu=True,
        seed=0,
        torch_num_threads=1,
    )
    kwargs.update(overrides)
    return MarbleDiffusionNFTConfig(**kwargs)


def train_golden(name: str, output_dir) -> dict[str, torch.Tensor]:
    """The final trained and old-policy LoRA tensors of one golden run, keyed ``{run}/{adapter}/{parameter}``."""
    spec = RUNS[name]
    trainer = MarbleDiffusionNFTTrainer(
        "tiny",
        list(spec["rewards"]),
        args=golden_args(output_dir, **spec["args"]),
        train_dataset=Dataset.from_dict({"prompt": PROMPTS}),
    )
    trainer.train()
    out = {}
    for adapter in (TRAIN_ADAPTER, OLD_ADAPTER):
        for param, tensor in lora_parameters(trainer.transformer, adapter).items():
            out[f"{name}/{adapter}/{param}"] = tensor.detach().cpu().clone().contiguous()
    return out


def digest(tensors: dict[str, torch.Tensor]) -> str:
    """SHA-256 over the names and the exact bytes of the tensors, in name order."""
    h = hashlib.sha256()
    for key in sorted(tensors):
        h.update(key.encode())
        h.update(tensors[key].numpy().tobytes())
    return h.hexdigest()


def platform_key() -> str:
    """What bit-identity depends on: the torch build and the CPU's kernel path (another machine may round
    differently, then only the tolerance check applies)."""
    return f"torch {torch.__version__}, {torch.backends.cpu.get_cpu_capability()}, {platform.machine()}"


if __name__ == "__main__":  # re-record
    import tempfile

    from safetensors.torch import save_file

    record, tensors = {"platform": platform_key(), "sha256": {}}, {}
    with tempfile.TemporaryDirectory() as tmp:
        for run in sys.argv[1:] or RUNS:
            result = train_golden(run, Path(tmp) / run)
            record["sha256"][run] = digest(result)
            tensors.update(result)
    TENSORS.parent.mkdir(exist_ok=True)
    save_file(tensors, TENSORS)
    RECORD.write_text(json.dumps(record, indent=2) + "\n")
    print(json.dumps(record, indent=2))
