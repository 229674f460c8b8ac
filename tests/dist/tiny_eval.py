"""Worker for the multi-process evaluation test: one training step on a two-source mixture with an evaluation after
it, then dumps this rank's log history.

Run under `torchrun`: python tiny_eval.py OUT_DIR PER_DEVICE GRAD_ACCUM (or call :func:`run` in the test process
for the one-process reference).
"""

import sys

import torch
from datasets import Dataset

from marble_trl import MarbleDiffusionNFTConfig, MarbleDiffusionNFTTrainer


def brightness(prompts, images, **_):
    return images.float().mean(dim=(1, 2, 3)).tolist()


def texty(prompts, images, text, **_):  # applies to the 'ocr' source only
    return [None if t is None else float(images[i].std()) for i, t in enumerate(text)]


def run(out: str, per_device: int, grad_accum: int) -> dict:
    """Train, evaluate and return this rank's state (also saved as ``OUT_DIR/rank<i>.pt``)."""
    train = Dataset.from_dict(
        {
            "prompt": ["a red apple", "a blue car", "a sign HI", "a sign YO"],
            "text": [None, None, "HI", "YO"],
            "source": ["plain", "plain", "ocr", "ocr"],
        }
    )
    # 5 prompts x 2 images = 10 images: not a multiple of 2 processes x batch 4 (padding exercised)
    evaluation = Dataset.from_dict(
        {
            "prompt": ["a boat", "a tree", "a sign OK", "a cat", "a dog"],
            "text": [None, None, "OK", None, None],
            "source": ["plain", "plain", "ocr", "plain", "plain"],
        }
    )
    args = MarbleDiffusionNFTConfig(
        output_dir=out, report_to="none", save_strategy="no", disable_tqdm=True, logging_steps=1, max_steps=1,
        learning_rate=0.1, per_device_train_batch_size=int(per_device), gradient_accumulation_steps=int(grad_accum),
        num_generations=2, resolution=16, num_sample_steps=2, sample_scheduler="euler", max_sequence_length=8,
        lora_r=2, lora_alpha=4, use_cpu=True, seed=0, source_ratios={"plain": 0.5, "ocr": 0.5},
        eval_strategy="steps", eval_steps=1, eval_num_sample_steps=2, eval_num_images_per_prompt=2,
        per_device_eval_batch_size=4, eval_grid_prompts=2, param_ema=True,
    )  # fmt: skip
    trainer = MarbleDiffusionNFTTrainer(
        "tiny", [brightness, texty], args=args, train_dataset=train, eval_dataset=evaluation
    )
    trainer.train()
    state = {"history": trainer.state.log_history, "world": trainer.accelerator.num_processes}
    torch.save(state, f"{out}/rank{trainer.accelerator.process_index}.pt")
    return state


if __name__ == "__main__":
    run(*sys.argv[1:4])
