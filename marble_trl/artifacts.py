"""Every file and folder name the package writes or reads, and the LoRA key format: one home, so a writer and its
reader cannot disagree (docs/checkpoints.md and docs/publishing.md describe the folders).

A run's ``output_dir`` holds ``LORA_FILE`` (diffusers-format LoRA), ``TRAINING_ARGS_FILE``, ``EXPORT_CONFIG_FILE``,
``METRICS_FILE``, ``RUN_SUMMARY_FILE``, ``SAMPLES_GRID_FILE`` and ``checkpoint-N`` folders (``MANIFEST_FILE``, the
LoRA, ``OLD_POLICY_FILE``, ``EMA_FILE``, ``BALANCER_FILE`` and the Trainer's own files); an export folder holds the
LoRA in diffusers (``LORA_FILE``) or peft (``PEFT_WEIGHTS_FILE`` + ``PEFT_CONFIG_FILE``) format, ``README.md``,
``EXPORT_CONFIG_FILE`` and ``SAMPLES_DIR``.
"""

from __future__ import annotations

from pathlib import Path

# the LoRA
LORA_FILE = "pytorch_lora_weights.safetensors"  # diffusers' LORA_WEIGHT_NAME_SAFE
LORA_KEY_PREFIX = "transformer."  # diffusers' keys: transformer.<module>.lora_A.weight
PEFT_WEIGHTS_FILE = "adapter_model.safetensors"
PEFT_CONFIG_FILE = "adapter_config.json"

# a run's output_dir
TRAINING_ARGS_FILE = "training_args.bin"  # the pickled config, as transformers writes it
EXPORT_CONFIG_FILE = "marble_trl.json"  # sampling settings and provenance; read by `marble-trl generate` / `export`
METRICS_FILE = "metrics.jsonl"
RUN_SUMMARY_FILE = "run_summary.json"
SAMPLES_GRID_FILE = "samples_before_after.png"
TRAINER_STATE_FILE = "trainer_state.json"
LOCK_FILE = ".marble_trl.lock"

# a checkpoint-N folder
OLD_POLICY_FILE = "old_policy_lora.safetensors"
# full fine-tuning (use_peft=False): the trained transformer as a diffusers model folder, the old policy and the EMA
# as safetensors keyed by the transformer's parameter names
TRANSFORMER_DIR = "transformer"
FULL_OLD_POLICY_FILE = "old_policy.safetensors"
EMA_FILE = "param_ema.safetensors"
BALANCER_FILE = "marble_balancer.json"
MANIFEST_FILE = "marble_checkpoint.json"
MANIFEST_FORMAT = "marble_trl.checkpoint"  # a format name written into every manifest: never renamed
MANIFEST_VERSION = 1
STAGING_PREFIX = "tmp-"  # "tmp-checkpoint-N" does not match the Trainer's "checkpoint-*" glob nor its regex

# an export / Hub folder
SAMPLES_DIR = "samples"
MODEL_CARD_FILE = "README.md"
# Never pushed: checkpoints (and interrupted saves), private files, the pickled TrainingArguments.
PUSH_IGNORE = ["_*", "checkpoint-*", f"{STAGING_PREFIX}*", TRAINING_ARGS_FILE, LOCK_FILE]

# an evaluation folder
EVAL_SETTINGS_FILE = "settings.json"

# weights shipped in the package (the `shapes` model and the ShapesBench judges)
SHIPPED_WEIGHTS = Path(__file__).parent / "shapesbench" / "weights"


def lora_key(param_name: str, adapter: str) -> str:
    """diffusers' key of a peft LoRA parameter: ``a.lora_A.<adapter>.weight`` -> ``transformer.a.lora_A.weight``."""
    return LORA_KEY_PREFIX + param_name.replace(f".{adapter}.", ".")
