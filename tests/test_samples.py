"""Captioned image sheets: text layout (wrap, truncate, scores), grid geometry, the before/after sheet of
`marble-trl train`, the side-by-side comparison sheet and the reward chart of `marble-trl evaluate`."""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from marble_trl.evaluation.samples import (
    GAP,
    LABEL_WIDTH,
    MIN_CELL,
    captioned_grid,
    comparison_sheet,
    save_before_after,
    score_images,
)
from marble_trl.evaluation.text_layout import caption_font, line_height, score_lines, text_width, wrap_text

LONG = "a red apple on a wooden table in the soft morning light, highly detailed photograph, 85 mm lens, bokeh"
PROMPTS = [LONG, "a blue car", "a green frog"]


def band_is_drawn(sheet: Image.Image, box: tuple[int, int, int, int]) -> bool:
    """Some pixel in ``box`` differs from the background: text was drawn there."""
    region = np.asarray(sheet.crop(box).convert("L"))
    return region.min() < 128


def test_wrap_text_wraps_long_prompts_and_truncates_with_an_ellipsis():
    font = caption_font()
    lines = wrap_text(LONG, 120, font, max_lines=3)
    assert len(lines) == 3 and all(text_width(line, font) <= 120 for line in lines)
    assert lines[0].startswith("a red apple") and lines[-1].endswith("…")
    assert wrap_text("a  blue\ncar", 120, font) == ["a blue car"]  # whitespace collapsed, short text unchanged
    broken = wrap_text("x" * 80, 60, font)  # a word wider than a line is broken, not dropped
    assert "".join(broken) == "x" * 80 and all(text_width(line, font) <= 60 for line in broken)


def test_score_lines_pack_scores_and_mark_missing_ones():
    font = caption_font()
    assert score_lines({"brightness": 0.4712, "jpeg": -1.5634}, 200, font) == ["brightness 0.471 · jpeg -1.56"]
    narrow = score_lines({"brightness": 0.4712, "jpeg": -1.5634, "ocr": None}, 90, font)
    assert narrow[0] == "brightness 0.471" and narrow[-1].endswith("ocr n/a")
    long = score_lines({"a_very_long_reward_name_indeed": 12.345}, 90, font)
    assert "".join(long) == "a_very_long_reward_name_indeed 12.3"  # broken at underscores, never cut
    assert len(long) > 1 and all(text_width(line, font) <= 90 for line in long)
    # the shared prefix of the names goes (ShapesBench's "shapes_preference" was drawn "shapes_prefere...")
    shapes = {"shapes_preference": 0.41, "shapes_alignment": 0.63, "shapes_count": 0.62}
    lines = score_lines(shapes, 128 - 8, font)  # a 32 px image's cell in the before/after sheet
    assert " ".join(lines).split(" · ")[0].startswith("preference 0.41") and "shapes_" not in "".join(lines)
    assert all(text_width(line, font) <= 120 for line in lines)


def test_captioned_grid_upscales_small_images_and_draws_prompts_and_scores():
    images = torch.rand(6, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    scores = [{"brightness": 0.1 * k, "contrast": -k} for k in range(6)]
    grid = captioned_grid(images, 3, captions=PROMPTS * 2, scores=scores)
    layout = grid.info["layout"]
    assert layout["image"] == (MIN_CELL, MIN_CELL)  # 32 px -> 128 px, nearest neighbour
    cell_w, cell_h = layout["cell"]
    assert cell_h > MIN_CELL  # a caption band under each image
    assert grid.size == (3 * (cell_w + GAP) - GAP, 2 * (cell_h + GAP) - GAP)
    up = np.asarray(grid.crop((0, 0, MIN_CELL, MIN_CELL)))
    assert (up[:4, :4] == up[0, 0]).all()  # one source pixel -> a 4 x 4 block
    drawn = grid.info["captions"]
    assert "a blue car" in drawn and "brightness 0.1" in drawn and "contrast -1" in drawn
    assert any(line.startswith("a red apple") for line in drawn) and any(line.endswith("…") for line in drawn)
    for col in range(3):
        x = col * (cell_w + GAP)
        assert band_is_drawn(grid, (x, MIN_CELL, x + cell_w, cell_h))


def test_captioned_grid_without_captions_is_a_plain_grid():
    grid = captioned_grid(torch.rand(4, 3, 16, 16), 2, scale=2)
    assert grid.size == (2 * (MIN_CELL + GAP) - GAP, 2 * (32 + GAP) - GAP) and grid.info["captions"] == []


def test_before_after_sheet_captions_each_image_and_gives_the_mean_scores(tmp_path):
    before, after = torch.zeros(6, 3, 32, 32), torch.ones(6, 3, 32, 32)
    b = [{"brightness": 0.0, "jpeg": -1.0}] * 6
    a = [{"brightness": 1.0, "jpeg": None}] * 6
    path = save_before_after(
        before, after, 3, tmp_path / "ba.png", scale=4, prompts=PROMPTS, before_scores=b, after_scores=a
    )
    sheet = Image.open(path)
    ref = captioned_grid(before, 3, captions=PROMPTS * 2, scores=b, title="before", scale=4)
    assert sheet.width == 3 * (MIN_CELL + GAP) - GAP
    assert sheet.height == 2 * ref.height + 3 * GAP  # two halves (3 prompts x 2 seeds each), one title line each
    tiny = captioned_grid(before, 3, scale=4)
    assert sheet.height > 2 * tiny.height + 3 * GAP  # captions make it taller than the bare grids
    assert band_is_drawn(sheet, (0, 0, sheet.width, line_height(caption_font())))  # the title band
    assert band_is_drawn(sheet, (0, ref.height // 2, MIN_CELL, ref.height))  # prompt + scores under an image


def test_before_after_sheet_records_what_it_drew(tmp_path, monkeypatch):
    from marble_trl.evaluation import samples

    seen = {}
    real = samples.stack_sheets

    def spy(sheets):
        out = real(sheets)
        seen["captions"] = out.info["captions"]
        return out

    monkeypatch.setattr(samples, "stack_sheets", spy)
    samples.save_before_after(
        torch.zeros(2, 3, 32, 32), torch.ones(2, 3, 32, 32), 2, tmp_path / "ba.png", prompts=["cat", "dog"],
        before_scores=[{"b": 0.0}, {"b": 0.5}], after_scores=[{"b": 1.0}, None],
    )  # fmt: skip
    drawn = seen["captions"]
    assert drawn[0] == "before training (LoRA off), mean: b 0.25" and "after training, mean: b 1" in drawn
    assert drawn.count("cat") == 2 and drawn.count("dog") == 2 and "b 0.5" in drawn and "b 1" in drawn


def test_comparison_sheet_puts_models_side_by_side():
    rows, models = 4, ["base", "run-a", "checkpoint-1000"]
    tiles = [[Image.new("RGB", (32, 32), (40 * m, 80, 200)) for m in range(3)] for _ in range(rows)]
    labels = [[PROMPTS[r // 2], f"prompt {r // 2}, image {r % 2}, seed {r}"] for r in range(rows)]
    scores = [[{"brightness": 0.5, "contrast": 0.25}] * 3 for _ in range(rows)]
    sheet = comparison_sheet(models, tiles, labels, scores)
    layout = sheet.info["layout"]
    cell_w, cell_h = layout["cell"]
    assert (layout["rows"], layout["columns"]) == (rows, 3)
    assert sheet.size == (LABEL_WIDTH + 3 * (cell_w + GAP) - GAP, layout["top"] + rows * (cell_h + GAP) - GAP)
    drawn = sheet.info["captions"]
    assert drawn[:3] == models  # the column headers
    assert "a blue car" in drawn and "prompt 1, image 1, seed 3" in drawn
    assert drawn.count("brightness 0.5") == drawn.count("contrast 0.25") == rows * 3
    assert band_is_drawn(sheet, (LABEL_WIDTH, 0, sheet.width, layout["top"]))  # headers
    assert band_is_drawn(sheet, (0, layout["top"], LABEL_WIDTH, layout["top"] + cell_h))  # a row label


def test_large_images_are_scaled_down_in_the_comparison_sheet():
    tiles = [[Image.new("RGB", (1024, 1024), "gray")] * 2]
    sheet = comparison_sheet(["a", "b"], tiles, ["p"], max_cell=256)
    assert sheet.info["layout"]["image"] == (256, 256)


def test_score_images_scores_every_image_and_survives_a_failing_reward(caplog):
    def bright(prompts, images, **_):
        return images.float().mean(dim=(1, 2, 3)).tolist()

    def picky(prompts, images, kind, **_):
        return [1.0 if k == "x" else None for k in kind]

    images = torch.stack([torch.zeros(3, 8, 8), torch.ones(3, 8, 8)])
    out = score_images([bright, picky], ["bright", "picky"], ["a", "b"], images, {"kind": ["x", "y"]})
    assert out == [{"bright": 0.0, "picky": 1.0}, {"bright": 1.0, "picky": None}]

    def broken(prompts, images, **_):
        raise RuntimeError("no model")

    with caplog.at_level(logging.WARNING, logger="marble_trl.evaluation.samples"):
        assert score_images([broken], ["broken"], ["a", "b"], images) is None
    assert "without scores" in caplog.text


def test_reward_chart_is_written_or_skipped_with_a_note(tmp_path, monkeypatch, caplog):
    pytest.importorskip("matplotlib")
    from marble_trl.evaluation.results import save_reward_chart

    results = [
        {"model": "base", "r/mean": 0.2, "r/sem": 0.05, "s/mean": -1.0, "s/sem": 0.1},
        {"model": "run-a", "r/mean": 0.6, "r/sem": 0.04, "s/mean": float("nan"), "s/sem": float("nan")},
    ]
    path = save_reward_chart(results, ["r", "s"], tmp_path / "rewards.png")
    chart = Image.open(path)
    assert chart.width > chart.height > 100 and np.asarray(chart.convert("L")).min() < 64
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # as if not installed
    with caplog.at_level(logging.WARNING, logger="marble_trl.evaluation.results"):
        assert save_reward_chart(results, ["r"], tmp_path / "none.png") is None
    assert "matplotlib is not installed" in caplog.text and not (tmp_path / "none.png").exists()


def test_train_command_captions_the_before_after_sheet(tmp_path):
    from marble_trl.cli import main

    recipe = Path(__file__).resolve().parents[1] / "recipes" / "tiny-random.yaml"
    (tmp_path / "p.txt").write_text("a red apple\na blue car\n", encoding="utf-8")
    out = tmp_path / "run"
    argv = ["train", "--config", str(recipe), "--output_dir", str(out), "--max_steps", "1", "--disable_tqdm", "true"]
    argv += ["--dataset_name", str(tmp_path / "p.txt"), "--num_sample_steps", "2", "--num_generations", "2"]
    argv += ["--per_device_train_batch_size", "4", "--sample_grid_prompts", "2", "--sample_grid_seeds", "2"]
    assert main(argv) == 0
    sheet = Image.open(out / "samples_before_after.png")
    half = (sheet.height - 3 * GAP) // 2
    assert sheet.width == 2 * (MIN_CELL + GAP) - GAP  # 2 prompts, 32 px images shown at 128 px
    assert half > 2 * MIN_CELL + 2 * 2 * line_height(caption_font())  # 2 seeds, each with prompt + score lines
    assert band_is_drawn(sheet, (0, MIN_CELL, MIN_CELL, MIN_CELL + 3 * line_height(caption_font())))
    assert json.loads((out / "run_summary.json").read_text())["global_step"] == 1
