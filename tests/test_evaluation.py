"""Evaluation: the trainer's deterministic ``evaluate`` (held-out rewards, parameter EMA, image grid, training left
untouched) and ``marble-trl evaluate`` (base model and LoRAs on a prompt set, tables, resume)."""

from __future__ import annotations

import csv
import json
import math

import numpy as np
import pytest
import torch
from datasets import Dataset
from PIL import Image
from tiny import brightness, redness

from marble_trl import MarbleDiffusionNFTConfig, MarbleDiffusionNFTTrainer
from marble_trl.cli import main
from marble_trl.evaluation.images import generate_eval_images, sample_seed
from marble_trl.evaluation.results import summarize_scores
from marble_trl.evaluation.samples import GAP, LABEL_WIDTH, MIN_CELL, PAD
from marble_trl.evaluation.text_layout import caption_font, line_height
from marble_trl.policy.lora import TRAIN_ADAPTER, lora_parameters
from marble_trl.rollout.solvers import make_scheduler

TRAIN = Dataset.from_dict({"prompt": ["a red apple", "a blue car", "a green frog", "a white cat"]})
EVAL = Dataset.from_dict({"prompt": ["a boat on a lake", "a tree", "a red apple"], "source": ["a", "b", "b"]})


def only_b(prompts, images, source, **_):  # a held-out reward that applies to one source only
    return [float(images[i].std()) if s == "b" else None for i, s in enumerate(source)]


def args_for(output_dir, **overrides) -> MarbleDiffusionNFTConfig:
    kwargs = dict(
        output_dir=str(output_dir), report_to="none", save_strategy="no", disable_tqdm=True, logging_steps=1,
        max_steps=2, learning_rate=3e-2, per_device_train_batch_size=4, num_generations=2, prompts_per_step=2,
        resolution=16, num_sample_steps=2, sample_scheduler="euler", max_sequence_length=8, lora_r=2, lora_alpha=4,
        use_cpu=True, seed=0, eval_num_sample_steps=2, eval_num_images_per_prompt=2, per_device_eval_batch_size=4,
    )  # fmt: skip
    kwargs.update(overrides)
    return MarbleDiffusionNFTConfig(**kwargs)


def caption_drawn(image, box) -> bool:
    """Some dark pixel in ``box`` of a white caption band: text was drawn there."""
    return np.asarray(image.crop(box).convert("L")).min() < 128


def lora_state(trainer) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in lora_parameters(trainer.transformer, TRAIN_ADAPTER).items()}


# ---------------------------------------------------------------------------------------------- building blocks
def test_eval_images_depend_only_on_their_seed(tiny_pipeline):
    scheduler = make_scheduler("euler", tiny_pipeline.scheduler)
    prompts = ["a cat", "a dog", "a cat"]
    seeds = [sample_seed(0, p, 0) for p in range(3)]
    kwargs = dict(num_steps=2, resolution=16, max_sequence_length=8)
    batch = generate_eval_images(tiny_pipeline, scheduler, prompts, seeds, **kwargs)
    alone = generate_eval_images(tiny_pipeline, scheduler, prompts[1:2], seeds[1:2], **kwargs)
    torch.testing.assert_close(batch[1:2], alone, atol=1e-5, rtol=0)
    assert (batch[0] - batch[2]).abs().max() > 1e-4  # same prompt, other seed: another image
    assert sample_seed(0, 1, 2) == sample_seed(0, 1, 2) != sample_seed(1, 1, 2)


def test_summarize_scores_skips_none_and_splits_by_source():
    rows = [{"r": 1.0}, {"r": 3.0}, {"r": None}, {"r": 5.0}]
    out = summarize_scores(["r"], rows, ["a", "a", "b", "b"])
    assert out["r/mean"] == 3.0 and out["r/count"] == 3.0
    assert out["r/sem"] == pytest.approx(2.0 / math.sqrt(3))
    assert out["r/std"] == pytest.approx(math.sqrt(8 / 3))
    assert out["r/a/mean"] == 2.0 and out["r/b/mean"] == 5.0


# ---------------------------------------------------------------------------------------------- trainer.evaluate
def test_evaluate_is_deterministic_uses_held_out_rewards_and_saves_a_grid(tmp_path):
    args = args_for(tmp_path, eval_reward_funcs=["contrast"])
    trainer = MarbleDiffusionNFTTrainer(
        "tiny", [brightness], args=args, train_dataset=TRAIN, eval_dataset=EVAL, eval_reward_funcs=[brightness, only_b]
    )
    assert trainer.eval_reward_names == ["brightness", "only_b"]  # the trainer argument wins over the config
    assert trainer.eval_reward_funcs[0] is trainer.reward_funcs[0]  # a training reward is reused
    first = trainer.evaluate()
    assert first["eval_samples"] == 6.0
    assert first["eval_rewards/brightness/count"] == 6.0 and first["eval_rewards/only_b/count"] == 4.0
    assert "eval_rewards/only_b/b/mean" in first and "eval_rewards/only_b/a/mean" not in first
    assert {"eval_rewards/brightness/std", "eval_rewards/brightness/sem", "eval_runtime"} <= set(first)
    # same seed, same scores, whatever the batch size
    trainer.args.per_device_eval_batch_size = 1
    second = trainer.evaluate()
    for key, value in first.items():
        if "runtime" not in key:
            assert second[key] == pytest.approx(value, abs=1e-6), key
    trainer.args.eval_seed = 1
    assert trainer.evaluate()["eval_rewards/brightness/mean"] != pytest.approx(first["eval_rewards/brightness/mean"])
    assert (tmp_path / "eval" / "step-0.png").is_file()
    grid = Image.open(tmp_path / "eval" / "step-0.png")  # 3 prompts x 2 images, 16 px shown at 128 px, captioned
    assert grid.width == 2 * (MIN_CELL + GAP) - GAP and (grid.height + GAP) % 3 == 0
    assert (grid.height + GAP) // 3 > MIN_CELL + 3 * line_height(caption_font())  # prompt + score lines
    assert caption_drawn(grid, (0, MIN_CELL, MIN_CELL, (grid.height + GAP) // 3 - GAP))
    logged = [r for r in trainer.state.log_history if "eval_rewards/brightness/mean" in r]
    assert len(logged) == 3
    named = trainer.evaluate({"held": EVAL.select([0])})
    assert named["eval_held_samples"] == 2.0 and (tmp_path / "eval" / "held-step-0.png").is_file()


def test_evaluation_during_training_does_not_change_training(tmp_path):
    plain = MarbleDiffusionNFTTrainer(
        "tiny", [brightness, redness], args=args_for(tmp_path / "a"), train_dataset=TRAIN
    )
    plain.train()
    evaluated = MarbleDiffusionNFTTrainer(
        "tiny",
        [brightness, redness],
        args=args_for(
            tmp_path / "b", eval_strategy="steps", eval_steps=1, param_ema=True, eval_num_images_per_prompt=1
        ),
        train_dataset=TRAIN,
        eval_dataset=EVAL,
    )
    evaluated.train()
    for name, value in lora_state(plain).items():
        assert torch.equal(value, lora_state(evaluated)[name]), name
    history = evaluated.state.log_history
    assert [r["step"] for r in history if "eval_rewards/redness/mean" in r] == [1, 2]
    train_logs = [r for r in history if "loss" in r]
    assert len(train_logs) == 2 and not any(k.startswith("eval_") for r in train_logs for k in r)
    assert sorted(p.name for p in (tmp_path / "b" / "eval").iterdir()) == ["step-1.png", "step-2.png"]


def test_evaluate_uses_the_parameter_ema_and_restores_the_weights(tmp_path):
    trainer = MarbleDiffusionNFTTrainer(
        "tiny",
        [brightness],
        args=args_for(tmp_path, param_ema=True, max_steps=1, eval_num_images_per_prompt=1),
        train_dataset=TRAIN,
        eval_dataset=EVAL,
    )
    trainer.train()
    before = lora_state(trainer)
    ema = trainer.evaluate()
    assert all(torch.equal(v, lora_state(trainer)[n]) for n, v in before.items())
    trainer.args.eval_use_param_ema = False
    raw = trainer.evaluate()
    with trainer.param_ema.swapped_in(trainer.transformer):
        trainer.param_ema = None  # the EMA weights loaded by hand: must give what evaluate gave with the EMA
        by_hand = trainer.evaluate()
    assert by_hand["eval_rewards/brightness/mean"] == pytest.approx(ema["eval_rewards/brightness/mean"], abs=1e-7)
    assert raw["eval_rewards/brightness/mean"] != pytest.approx(ema["eval_rewards/brightness/mean"], abs=1e-7)


def test_bad_evaluation_input_is_rejected(tmp_path):
    with pytest.raises(ValueError, match="Unknown reward 'no_such_reward'"):
        MarbleDiffusionNFTTrainer(
            "tiny", [brightness], args=args_for(tmp_path, eval_reward_funcs=["no_such_reward"]), train_dataset=TRAIN
        )
    with pytest.raises(ValueError, match="eval_dataset has no 'prompt' column"):
        MarbleDiffusionNFTTrainer(
            "tiny",
            [brightness],
            args=args_for(tmp_path),
            train_dataset=TRAIN,
            eval_dataset=Dataset.from_dict({"x": [1]}),
        )
    with pytest.raises(ValueError, match="eval_num_sample_steps"):
        args_for(tmp_path, eval_num_sample_steps=0)


# ---------------------------------------------------------------------------------------------- marble-trl evaluate
@pytest.fixture(scope="module")
def lora_dir(tmp_path_factory):
    """A diffusers LoRA folder from a trainer whose LoRA was moved by hand (no training needed)."""
    out = tmp_path_factory.mktemp("lora")
    args = args_for(out, resolution=16, max_sequence_length=8)
    trainer = MarbleDiffusionNFTTrainer("tiny", [brightness], args=args, train_dataset=TRAIN)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in lora_parameters(trainer.transformer, TRAIN_ADAPTER).values():
            p.add_(0.5 * torch.randn(p.shape, generator=gen))
    trainer.save_model(str(out / "run-a"))
    return out / "run-a"


def evaluate_argv(output, prompts, lora_dir, *extra):
    return [
        "evaluate", "--model", "tiny", "--lora", str(lora_dir), "--prompts", str(prompts), "--reward_funcs",
        "brightness", "contrast", "--num_images_per_prompt", "2", "--num_sample_steps", "2", "--batch_size", "3",
        "--grid_prompts", "2", "--output", str(output), "--no_progress", *extra,
    ]  # fmt: skip


def test_evaluate_command_scores_base_and_lora_and_resumes(tmp_path, lora_dir, monkeypatch):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a red apple\na blue car\na green frog\n", encoding="utf-8")
    out = tmp_path / "eval"
    assert main(evaluate_argv(out, prompts, lora_dir)) == 0
    rows = list(csv.DictReader((out / "results.csv").open()))
    assert [r["model"] for r in rows] == ["base", "run-a"]
    assert set(rows[0]) >= {"brightness/mean", "brightness/sem", "contrast/mean", "contrast/sem", "composite"}
    means = {r["model"]: [float(r["brightness/mean"]), float(r["contrast/mean"])] for r in rows}
    assert means["base"] != means["run-a"]  # the LoRA is loaded
    composite = [float(r["composite"]) for r in rows]
    assert sum(composite) == pytest.approx(0.0, abs=1e-9)  # z-scores over the compared models
    md = (out / "results.md").read_text()
    assert "| base |" in md and "| run-a |" in md and "composite" in md
    for model in ("base", "run-a"):
        lines = [json.loads(x) for x in (out / model / "scores.jsonl").read_text().splitlines()]
        assert sorted((x["prompt_index"], x["image_index"]) for x in lines) == [
            (p, i) for p in range(3) for i in (0, 1)
        ]
        grid = Image.open(out / model / "grid.png")  # 2 prompts x 2 images, 16 px shown at 128 px, captioned
        assert grid.width == 2 * (MIN_CELL + GAP) - GAP and (grid.height + GAP) % 2 == 0
        assert caption_drawn(grid, (0, MIN_CELL, MIN_CELL, (grid.height + GAP) // 2 - GAP))
    # comparison.png: one column per model, one row per (prompt, image), headed by the model names
    sheet = Image.open(out / "comparison.png")
    top = line_height(caption_font()) + PAD  # one line of headers
    assert sheet.width == LABEL_WIDTH + 2 * (MIN_CELL + GAP) - GAP
    assert (sheet.height - top + GAP) % 4 == 0 and (sheet.height - top + GAP) // 4 > MIN_CELL + GAP
    assert caption_drawn(sheet, (LABEL_WIDTH, 0, sheet.width, top))  # model names
    assert caption_drawn(sheet, (0, top, LABEL_WIDTH, top + MIN_CELL))  # the first row's prompt and seed
    assert caption_drawn(sheet, (LABEL_WIDTH, top + MIN_CELL, sheet.width, top + MIN_CELL + PAD + 12))  # scores
    try:
        import matplotlib  # noqa: F401

        chart = Image.open(out / "rewards.png")
        assert chart.width > chart.height > 100
    except ImportError:
        assert not (out / "rewards.png").exists()

    # resume: drop one row, rerun; only that (prompt, image) is generated again
    scores = out / "run-a" / "scores.jsonl"
    kept = scores.read_text().splitlines()
    scores.write_text("\n".join(kept[:-1]) + "\n")
    import marble_trl.evaluation.run as evaluation

    calls = []
    real = evaluation.generate_eval_images

    def counting(pipeline, scheduler, prompts, seeds, **kw):
        calls.append(len(prompts))
        return real(pipeline, scheduler, prompts, seeds, **kw)

    monkeypatch.setattr(evaluation, "generate_eval_images", counting)
    assert main(evaluate_argv(out, prompts, lora_dir)) == 0
    assert calls == [1]
    again = list(csv.DictReader((out / "results.csv").open()))
    assert [r["model"] for r in again] == ["base", "run-a"]
    assert float(again[0]["brightness/mean"]) == float(rows[0]["brightness/mean"])  # base: all rows reused
    # the regenerated image was in a batch of 1, not 3: equal up to float rounding
    assert float(again[1]["brightness/mean"]) == pytest.approx(float(rows[1]["brightness/mean"]), abs=1e-6)
    rescored = [json.loads(x) for x in scores.read_text().splitlines()]
    assert len(rescored) == 6 and rescored[:5] == [json.loads(x) for x in kept[:5]]
    assert rescored[5]["scores"] == pytest.approx(json.loads(kept[5])["scores"], abs=1e-6)
    with pytest.raises(ValueError, match="other settings.*seed"):
        main(evaluate_argv(out, prompts, lora_dir, "--seed", "3"))


def test_evaluate_command_reports_each_reward_on_each_prompt_source(tmp_path):
    """Several prompt sources (the papers read PickScore on DrawBench, GenEval on its test split...): results.csv and
    results.md hold each reward's mean on each source, equal to the mean of that source's rows in scores.jsonl."""
    general, quoted = tmp_path / "general.txt", tmp_path / "quoted.txt"
    general.write_text("a red apple\na blue car\n", encoding="utf-8")
    quoted.write_text('a sign that says "hi"\n', encoding="utf-8")
    out = tmp_path / "eval"
    argv = ["evaluate", "--model", "tiny", "--prompts", str(general), str(quoted), "--reward_funcs", "brightness",
            "--num_images_per_prompt", "2", "--num_sample_steps", "2", "--grid_prompts", "0", "--output", str(out),
            "--no_progress"]  # fmt: skip
    assert main(argv) == 0
    (row,) = list(csv.DictReader((out / "results.csv").open()))
    lines = [json.loads(x) for x in (out / "base" / "scores.jsonl").read_text().splitlines()]
    for source, prompts in (("general", {0, 1}), ("quoted", {2})):
        values = [x["scores"]["brightness"] for x in lines if x["prompt_index"] in prompts]
        assert float(row[f"brightness/{source}/mean"]) == pytest.approx(sum(values) / len(values), rel=1e-6)
    assert "## By prompt source" in (out / "results.md").read_text()


def test_evaluate_command_matches_trainer_evaluation(tmp_path):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a boat on a lake\na tree\n", encoding="utf-8")
    out = tmp_path / "eval"
    argv = [
        "evaluate", "--prompts", str(prompts), "--reward_funcs", "brightness", "--num_images_per_prompt", "2",
        "--num_sample_steps", "3", "--resolution", "16", "--max_sequence_length", "8", "--output", str(out),
        "--grid_prompts", "0", "--no_progress",
    ]  # fmt: skip
    assert main(argv) == 0
    base = float(next(csv.DictReader((out / "results.csv").open()))["brightness/mean"])
    args = args_for(tmp_path / "t", eval_num_sample_steps=3, eval_grid_prompts=0)
    trainer = MarbleDiffusionNFTTrainer(
        "tiny", "brightness", args=args, train_dataset=TRAIN, eval_dataset=EVAL.select([0, 1])
    )
    from marble_trl.policy.lora import use_reference

    with use_reference(trainer.transformer):  # the base model, as `marble-trl evaluate` without --lora
        metrics = trainer.evaluate()
    assert metrics["eval_rewards/brightness/mean"] == pytest.approx(base, abs=1e-5)


def test_evaluate_command_bad_input(tmp_path, lora_dir):
    out = tmp_path / "eval"
    with pytest.raises(ValueError, match="Unknown reward 'nope'"):
        main(["evaluate", "--reward_funcs", "nope", "--output", str(out)])
    with pytest.raises(FileNotFoundError, match="missing.txt"):
        main(
            [
                "evaluate",
                "--reward_funcs",
                "brightness",
                "--prompts",
                str(tmp_path / "missing.txt"),
                "--output",
                str(out),
            ]
        )
    with pytest.raises(FileNotFoundError, match="is not a folder"):
        main(["evaluate", "--reward_funcs", "brightness", "--lora", str(tmp_path / "none"), "--output", str(out)])
    assert not (out / "base" / "scores.jsonl").exists()  # nothing generated before the input was checked


def test_train_command_with_a_mixture_and_evaluation(tmp_path):
    from pathlib import Path

    recipe = Path(__file__).resolve().parents[1] / "recipes" / "tiny-random.yaml"
    (tmp_path / "plain.txt").write_text("a red apple\na blue car\n", encoding="utf-8")
    rows = [{"caption": "a sign HI", "text": "HI"}, {"caption": "a sign YO", "text": "YO"}]
    (tmp_path / "ocr.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n", encoding="utf-8")
    (tmp_path / "held.txt").write_text("a boat\n", encoding="utf-8")
    config = tmp_path / "mix.yaml"
    config.write_text(
        recipe.read_text()
        + f"""
dataset_mixture:
  - {{path: {tmp_path / "plain.txt"}, ratio: 1}}
  - {{path: {tmp_path / "ocr.jsonl"}, name: ocr, prompt_column: caption, ratio: 1}}
eval_dataset_name: {tmp_path / "held.txt"}
eval_strategy: steps
eval_steps: 1
eval_num_sample_steps: 2
eval_reward_funcs: [brightness, contrast]
"""
    )
    out = tmp_path / "run"
    argv = ["train", "--config", str(config), "--output_dir", str(out), "--max_steps", "1", "--disable_tqdm", "true"]
    argv += ["--num_sample_steps", "2", "--num_generations", "2", "--per_device_train_batch_size", "4"]
    argv += ["--sample_grid_prompts", "0"]
    assert main(argv) == 0
    logs = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    train = next(r for r in logs if "loss" in r)
    assert {"rewards/brightness/plain/mean", "rewards/brightness/ocr/mean"} <= set(train)
    evaluation = next(r for r in logs if "eval_samples" in r)
    assert evaluation["eval_samples"] == 1.0 and "eval_rewards/contrast/mean" in evaluation
    assert (out / "eval" / "step-1.png").is_file()


def test_eval_grid_reaches_wandb_and_tensorboard_callbacks(tmp_path):
    """Trackers are found by type: subclasses of transformers' callbacks (here with fake clients) get the grid."""
    from transformers import TrainerCallback
    from transformers.integrations import TensorBoardCallback as RealTensorBoard
    from transformers.integrations import WandbCallback as RealWandb

    class FakeWandb:
        run = object()
        logged: list = []

        @staticmethod
        def Image(image, caption=None):  # noqa: N802 (wandb's name)
            return ("wandb-image", image.size)

        def log(self, data):
            self.logged.append(data)

    class WandbCallback(RealWandb):
        def __init__(self):  # no wandb client: the fake one
            self._wandb = FakeWandb()
            self._initialized = True

        def on_log(self, *args, **kwargs):
            return None

    class Writer:
        images: list = []

        def add_image(self, tag, array, step, dataformats):
            self.images.append((tag, array.shape, step, dataformats))

        def add_text(self, *args, **kwargs):
            pass

        def flush(self):
            pass

    class TensorBoardCallback(RealTensorBoard):
        def __init__(self):
            self.tb_writer = Writer()

        def on_log(self, *args, **kwargs):
            return None

    class LookAlike(TrainerCallback):  # same name as a tracker, not one: gets nothing
        tb_writer = Writer()

    LookAlike.__name__ = "TensorBoardCallback"

    trainer = MarbleDiffusionNFTTrainer(
        "tiny",
        [brightness],
        args=args_for(tmp_path, eval_num_images_per_prompt=1),
        train_dataset=TRAIN,
        eval_dataset={"held": EVAL},
        callbacks=[WandbCallback(), TensorBoardCallback(), LookAlike()],
    )
    trainer.evaluate()
    ((tag, size),) = [(k, v[1]) for d in FakeWandb.logged for k, v in d.items() if k != "train/global_step"]
    assert tag == "eval/held/images" and size[0] > 0
    assert Writer.images == [("eval/held/images", (size[1], size[0], 3), 0, "HWC")]
