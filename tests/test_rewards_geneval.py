"""The in-process GenEval reward: its rules on synthetic detections (expected values derived by hand from the
specification's tables, not from running the code), and its models (Mask2Former detector, CLIP colours) as tiny
random-weight models of the real architectures, saved locally and loaded through the real code paths."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from PIL import Image

from marble_trl.rewards import RewardLogs, check_reward_signature, get_reward, score_rewards
from marble_trl.rewards.geneval import GenEvalReward
from marble_trl.rewards.geneval.colour import NO_COLOUR, ColourClassifier, clip_pixels, object_crop
from marble_trl.rewards.geneval.detector import (
    GENEVAL_CLASSES,
    Mask2FormerDetector,
    geneval_labels,
    mask2bbox,
    rescaled_size,
)
from marble_trl.rewards.geneval.metadata import row_metadata
from marble_trl.rewards.geneval.rules import (
    COLORS,
    Detection,
    evaluate,
    evaluate_reward,
    filter_detections,
    geneval_value,
    relative_position,
)
from marble_trl.rewards.http import HTTPReward

transformers = pytest.importorskip("transformers")
pytest.importorskip("scipy")  # transformers' Mask2Former needs it (the `geneval` extra)
from test_rewards_builtin import save_tiny_clip  # noqa: E402
from transformers import AutoTokenizer, CLIPModel  # noqa: E402

# ---------------------------------------------------------------------------------------------------------------------
# Synthetic detections. A detection's mask field holds its colour, read back by the stub colour classifier.


def det(score: float, box: tuple[float, ...] = (0, 0, 10, 10), colour: str | None = None) -> Detection:
    return Detection(box, score, colour)


class StubColours:
    """``colour_of`` for the rules: each object's colour is its mask field; the calls are recorded."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, int]] = []

    def __call__(self, objects, classname):
        self.calls.append((classname, len(objects)))
        return [o.mask for o in objects]


def all_three(detections, metadata) -> tuple[bool, bool, float]:
    """(GenEval correct, strict_correct, score) of unfiltered detections."""
    objects = filter_detections(detections, metadata.get("tag"))
    strict, score = evaluate_reward(objects, metadata, StubColours())
    return evaluate(objects, metadata, StubColours()), strict, score


def cats(n: int, score: float = 0.8) -> list[Detection]:
    return [det(score, (i, 0, i + 10, 10)) for i in range(n)]


# ---------------------------------------------------------------------------------------------------------------------
# Filtering: threshold, order, cap, no NMS


def test_threshold_is_strict_and_depends_on_the_tag() -> None:
    found = {"cat": [det(0.3), det(0.3 + 1e-6), det(0.95), det(0.9), det(0.9 + 1e-6), det(0.2)]}
    # Non-counting tags: keep score > 0.3 -> 0.3+1e-6, 0.95, 0.9, 0.9+1e-6 (4), best first.
    kept = filter_detections(found, "single_object")["cat"]
    assert [d.score for d in kept] == [0.95, 0.9 + 1e-6, 0.9, 0.3 + 1e-6]
    # Counting: keep score > 0.9 -> 0.95, 0.9+1e-6.
    assert [d.score for d in filter_detections(found, "counting")["cat"]] == [0.95, 0.9 + 1e-6]
    # No tag: the ordinary threshold.
    assert len(filter_detections(found, None)["cat"]) == 4


def test_scores_are_compared_in_float32_as_mmdets_scores_are() -> None:
    # float32(0.3) = 0.3000000119 and the next float32 is 3e-8 above: 0.30000001 rounds to float32(0.3), which is
    # not > float32(0.3): dropped, though > 0.3 in float64. float32(0.9) = 0.8999999762 (spacing 6e-8): 0.900000005
    # rounds down to it.
    assert filter_detections({"cat": [det(0.30000001)]}, "colors") == {}
    assert filter_detections({"cat": [det(0.900000005)]}, "counting") == {}


def test_at_most_16_per_class_best_first_and_classes_with_nothing_are_absent() -> None:
    found = {"cat": [det(0.31 + 0.01 * i) for i in range(20)], "dog": [det(0.1)], "cow": []}
    kept = filter_detections(found, "two_object")
    assert set(kept) == {"cat"}
    # The 16 best of 0.31..0.50 are 0.35..0.50, descending.
    assert [round(d.score, 2) for d in kept["cat"]] == [round(0.50 - 0.01 * i, 2) for i in range(16)]


def test_no_nms_duplicates_are_kept() -> None:
    same = det(0.8, (5, 5, 20, 20))
    assert len(filter_detections({"cat": [same, same, same]}, "single_object")["cat"]) == 3


def test_plain_tuples_are_detections() -> None:
    kept = filter_detections({"cat": [((0, 0, 4, 4), 0.5), ((1, 1, 2, 2), 0.7, "mask")]}, "single_object")
    assert kept["cat"] == [Detection((1, 1, 2, 2), 0.7, "mask"), Detection((0, 0, 4, 4), 0.5, None)]


# ---------------------------------------------------------------------------------------------------------------------
# relative_position: centre offset A - B, shrunk per axis by 0.1 x (size A + size B), divided by |offset|, vs 0.5


def test_relative_position_worked_cases() -> None:
    # Centres (5,5) and (25,5): offset (-20, 0); margin x 0.1*(10+10)=2 -> revised (-18, 0); /20 -> dx=-0.9.
    assert relative_position([0, 0, 10, 10], [20, 0, 30, 10]) == {"left of"}
    assert relative_position([20, 0, 30, 10], [0, 0, 10, 10]) == {"right of"}
    # Offset (0, 20) (A lower in the image, y down): dy = 18/20 = 0.9 -> below.
    assert relative_position([0, 20, 10, 30], [0, 0, 10, 10]) == {"below"}
    assert relative_position([0, 0, 10, 10], [0, 20, 10, 30]) == {"above"}
    # Diagonal: offset (-20,-20), revised (-18,-18), |offset| = 28.28 -> dx = dy = -0.636: two relations.
    assert relative_position([0, 0, 10, 10], [20, 20, 30, 30]) == {"left of", "above"}
    # Offset (20, 5): revised (18, 3), |offset| = 20.6 -> dx = 0.87, dy = 0.15: right of only.
    assert relative_position([20, 5, 30, 15], [0, 0, 10, 10]) == {"right of"}


def test_relative_position_edges() -> None:
    # Identical centres: offset 0 -> the empty set (no division by zero).
    assert relative_position([0, 0, 10, 10], [0, 0, 10, 10]) == set()
    assert relative_position([0, 0, 0, 0], [0, 0, 0, 0]) == set()
    # Offset (-1, 0) inside the margin 0.1*(10+10)=2 -> revised 0 -> the empty set.
    assert relative_position([0, 0, 10, 10], [1, 0, 11, 10]) == set()
    # Offset -2.0005, margin 2 -> revised -0.0005 < 1e-3 -> the empty set.
    assert relative_position([0, 0, 10, 10], [2.0005, 0, 12.0005, 10]) == set()
    # Offset -2.01, margin 2 -> revised -0.01 (>= 1e-3), /2.01 -> dx = -0.005: not past 0.5 -> still no relation.
    assert relative_position([0, 0, 10, 10], [2.01, 0, 12.01, 10]) == set()
    # Exactly 0.5 is not enough: widths 5+5 -> margin 1; offset (6, 8) -> revised (5, 8), /10 -> dx = 0.5, dy = 0.8.
    assert relative_position([3.5, 8, 8.5, 8], [-2.5, 0, 2.5, 0]) == {"below"}
    # Widths 4.9+4.9 -> margin 0.98 -> revised x 5.02 -> dx = 0.502 > 0.5.
    assert relative_position([3.55, 8, 8.45, 8], [-2.45, 0, 2.45, 0]) == {"right of", "below"}


# ---------------------------------------------------------------------------------------------------------------------
# The rules per tag: (GenEval correct, strict_correct, score), from the specification's tables


def test_single_object() -> None:
    md = {"tag": "single_object", "include": [{"class": "cat", "count": 1}]}
    # score = 1 - |1 - n|; strict needs n == 1; GenEval correct needs n >= 1.
    assert all_three({"cat": cats(0)}, md) == (False, False, 0.0)
    assert all_three({"cat": cats(1)}, md) == (True, True, 1.0)
    assert all_three({"cat": cats(2)}, md) == (True, False, 0.0)
    assert all_three({"cat": cats(3)}, md) == (True, False, -1.0)  # negative, not clipped
    assert all_three({"cat": cats(16)}, md) == (True, False, -14.0)
    assert all_three({"cat": cats(40)}, md) == (True, False, -14.0)  # capped at 16 detections
    # Other classes never matter; below-threshold cats do not count.
    assert all_three({"dog": cats(3), "cat": cats(1) + cats(2, score=0.3)}, md) == (True, True, 1.0)


def test_two_object() -> None:
    md = {"tag": "two_object", "include": [{"class": "bench", "count": 1}, {"class": "sports ball", "count": 1}]}
    # terms [1 - |1 - n1|, 1 - |1 - n2|], mean.
    assert all_three({"bench": cats(1), "sports ball": cats(1)}, md) == (True, True, 1.0)
    assert all_three({"bench": cats(1)}, md) == (False, False, 0.5)  # [1, 0]
    assert all_three({"bench": cats(1), "sports ball": cats(2)}, md) == (True, False, 0.5)  # [1, 0]
    assert all_three({"bench": cats(4), "sports ball": cats(1)}, md) == (True, False, -0.5)  # [-2, 1]


def test_counting_uses_0_9_and_exclude_only_in_correct() -> None:
    md = {
        "tag": "counting",
        "include": [{"class": "clock", "count": 2}],
        "exclude": [{"class": "clock", "count": 3}],
    }
    kept_two = [det(0.95), det(0.92), det(0.9), det(0.5)]  # 0.9 and 0.5 are not > 0.9: n = 2
    assert all_three({"clock": kept_two}, md) == (True, True, 1.0)
    # n = 3: score 1 - 1/2 = 0.5; GenEval: >= 2 passes but exclude (>= 3) fires.
    assert all_three({"clock": cats(3, 0.95)}, md) == (False, False, 0.5)
    # n = 5: 1 - 3/2 = -0.5 (the specification's example).
    assert all_three({"clock": cats(5, 0.95)}, md) == (False, False, -0.5)
    # n = 1: 1 - 1/2 = 0.5; GenEval fails the include.
    assert all_three({"clock": cats(1, 0.95)}, md) == (False, False, 0.5)
    assert all_three({}, md) == (False, False, 0.0)
    # exclude is ignored by the reward: an exclude of 2 fails GenEval's correct only.
    md2 = {**md, "exclude": [{"class": "clock", "count": 2}]}
    assert all_three({"clock": cats(2, 0.95)}, md2) == (False, True, 1.0)


def test_colors() -> None:
    md = {"tag": "colors", "include": [{"class": "car", "count": 1, "color": "blue"}]}
    blue, red = det(0.9, colour="blue"), det(0.8, colour="red")
    # n == 1: terms [1, 1 - |1 - k|] with k in {0, 1}.
    assert all_three({"car": [blue]}, md) == (True, True, 1.0)
    assert all_three({"car": [red]}, md) == (False, False, 0.5)  # [1, 0]
    # n == 2: terms [1 - |1 - 2| = 0, 0]: 0.0. GenEval looks at the best car only: blue -> correct.
    assert all_three({"car": [blue, red]}, md) == (True, False, 0.0)
    assert all_three({"car": [det(0.9, colour="red"), det(0.8, colour="blue")]}, md) == (False, False, 0.0)
    assert all_three({}, md) == (False, False, 0.0)  # [0, 0]
    assert all_three({"car": [blue, blue, blue]}, md) == (True, False, -0.5)  # [-1, 0]


def test_colour_is_asked_for_the_best_count_objects_in_correct_and_all_in_the_reward() -> None:
    md = {"tag": "colors", "include": [{"class": "car", "count": 1, "color": "blue"}]}
    objects = filter_detections({"car": [det(0.9, colour="blue"), det(0.8, colour="red")]}, "colors")
    correct_colours, reward_colours = StubColours(), StubColours()
    evaluate(objects, md, correct_colours)
    evaluate_reward(objects, md, reward_colours)
    assert correct_colours.calls == [("car", 1)]  # the top-1
    assert reward_colours.calls == []  # n != count: no colour asked, one 0.0 term instead
    one = filter_detections({"car": [det(0.9, colour="blue")]}, "colors")
    evaluate_reward(one, md, reward_colours)
    assert reward_colours.calls == [("car", 1)]


def test_colour_with_a_count_above_one() -> None:
    # Not in GenEval's data. n == 2, k == 1 red: terms [1, 1 - |2 - 1|/2 = 0.5] -> 0.75; GenEval needs 2 of the top 2.
    md = {"tag": "colors", "include": [{"class": "cat", "count": 2, "color": "red"}]}
    found = {"cat": [det(0.9, colour="red"), det(0.8, colour="blue")]}
    assert all_three(found, md) == (False, False, 0.75)


def test_color_attr() -> None:
    md = {
        "tag": "color_attr",
        "include": [
            {"class": "wine glass", "count": 1, "color": "purple"},
            {"class": "apple", "count": 1, "color": "black"},
        ],
    }
    glass, apple = det(0.9, colour="purple"), det(0.9, colour="black")
    assert all_three({"wine glass": [glass], "apple": [apple]}, md) == (True, True, 1.0)  # [1, 1, 1, 1]
    wrong = det(0.9, colour="white")
    assert all_three({"wine glass": [glass], "apple": [wrong]}, md) == (False, False, 0.75)  # [1, 1, 1, 0]
    assert all_three({"apple": [apple]}, md) == (False, False, 0.5)  # [0, 0, 1, 1]


POSITION = {
    "tag": "position",
    "include": [{"class": "teddy bear", "count": 1}, {"class": "dog", "count": 1, "position": ["right of", 0]}],
}
TEDDY = det(0.9, (0, 0, 10, 10))
DOG_RIGHT = det(0.9, (20, 0, 30, 10))  # dx = +0.9: right of the teddy
DOG_LEFT = det(0.8, (-20, 0, -10, 10))


def test_position_worked_values() -> None:
    # B = teddy (entry 0), A = dog (entry 1, "right of" B).
    # Both present, relation holds: [1] + [1, 1] -> 1.0.
    assert all_three({"teddy bear": [TEDDY], "dog": [DOG_RIGHT]}, POSITION) == (True, True, 1.0)
    # Both present, wrong relation: [1] + [1, 0, 1] (the 1.0 appended after a failure) -> 3/4.
    assert all_three({"teddy bear": [TEDDY], "dog": [DOG_LEFT]}, POSITION) == (False, False, 0.75)
    # Target missing: [0] + [1, 0] -> 1/3.
    correct, strict, score = all_three({"dog": [DOG_RIGHT]}, POSITION)
    assert (correct, strict) == (False, False) and score == pytest.approx(1 / 3)
    # Subject missing: [1] + [0, 0] -> 1/3.
    correct, strict, score = all_three({"teddy bear": [TEDDY]}, POSITION)
    assert (correct, strict) == (False, False) and score == pytest.approx(1 / 3)
    # Two dogs: [1] + [1 - |1 - 2| = 0, 0] -> 1/3, while GenEval checks the best dog only: correct.
    correct, strict, score = all_three({"teddy bear": [TEDDY], "dog": [DOG_RIGHT, DOG_LEFT]}, POSITION)
    assert (correct, strict) == (True, False) and score == pytest.approx(1 / 3)
    # Two teddies: [0] and the target fails -> [1, 0] -> 1/3; GenEval uses the best teddy: correct.
    teddies = [TEDDY, det(0.5, (100, 100, 110, 110))]
    correct, strict, score = all_three({"teddy bear": teddies, "dog": [DOG_RIGHT]}, POSITION)
    assert (correct, strict) == (True, False) and score == pytest.approx(1 / 3)


def test_colour_failure_skips_the_position_term() -> None:
    # Not in GenEval's data: colour and position on one entry. Blue dog: [1] + [1, 0], no position term -> 2/3.
    md = {
        "tag": "position",
        "include": [
            {"class": "teddy bear", "count": 1},
            {"class": "dog", "count": 1, "color": "red", "position": ["right of", 0]},
        ],
    }
    blue_dog = det(0.9, (20, 0, 30, 10), "blue")
    correct, strict, score = all_three({"teddy bear": [TEDDY], "dog": [blue_dog]}, md)
    assert (correct, strict) == (False, False) and score == pytest.approx(2 / 3)


def test_zero_detections_and_empty_include() -> None:
    # Nothing detected: every count term 1 - c/c = 0, plus a 0 per colour/position entry -> 0.
    assert all_three({}, POSITION) == (False, False, 0.0)
    # An empty include: GenEval correct, strict True, score 0 (the mean of no terms is taken as 0).
    assert all_three({"cat": cats(2)}, {"tag": "single_object", "include": []}) == (True, True, 0.0)


def test_arrow_struct_nones_count_as_absent_keys() -> None:
    # datasets may give every requirement every key, None where the JSON had none.
    md = {"tag": "single_object", "include": [{"class": "cat", "count": 1, "color": None, "position": None}]}
    assert all_three({"cat": cats(1)}, md) == (True, True, 1.0)


def test_malformed_requirements_are_refused() -> None:
    with pytest.raises(ValueError, match="'count' must be a positive integer"):
        all_three({}, {"tag": "single_object", "include": [{"class": "cat"}]})
    with pytest.raises(ValueError, match="'count' must be a positive integer"):
        all_three({}, {"tag": "single_object", "include": [{"class": "cat", "count": 0}]})
    bad = {"tag": "position", "include": [{"class": "dog", "count": 1, "position": ["left of", 1]}]}
    with pytest.raises(ValueError, match="not an earlier include entry"):
        all_three({"dog": cats(1)}, bad)


def test_geneval_value_metrics() -> None:
    found = {"cat": cats(3)}
    md = {"tag": "single_object", "include": [{"class": "cat", "count": 1}]}
    values = {m: geneval_value(found, md, StubColours(), m) for m in ("score", "correct", "strict")}
    assert values == {"score": -1.0, "correct": 1.0, "strict": 0.0}
    with pytest.raises(ValueError, match="metric"):
        geneval_value(found, md, StubColours(), "accuracy")


# ---------------------------------------------------------------------------------------------------------------------
# Metadata columns


def test_row_metadata_from_columns_or_a_metadata_column() -> None:
    md = {"tag": "counting", "include": [{"class": "cat", "count": 2}], "exclude": [{"class": "cat", "count": 3}]}
    separate = {k: [md[k], None, None] for k in ("tag", "include", "exclude")}
    separate["log_metric"] = print  # a trainer keyword that **columns also holds
    assert row_metadata(separate, 3) == [md, None, None]
    one = {"metadata": [md, json.dumps(md), {"source": "ocr"}]}
    assert row_metadata(one, 3) == [md, md, None]
    with pytest.raises(ValueError, match="'include' must be a list"):
        row_metadata({"include": [{"class": "cat"}]}, 1)


# ---------------------------------------------------------------------------------------------------------------------
# Detector pieces


def test_labels_map_by_name_and_other_label_sets_are_refused() -> None:
    hf = {i: {"computer mouse": "mouse", "tv remote": "remote", "computer keyboard": "keyboard"}.get(n, n) for i, n in
          enumerate(GENEVAL_CLASSES)}  # fmt: skip
    assert geneval_labels(hf) == list(GENEVAL_CLASSES)
    assert geneval_labels({str(k): v.replace(" ", "_").upper() for k, v in hf.items()}) == list(GENEVAL_CLASSES)
    with pytest.raises(ValueError, match="do not map"):
        geneval_labels({i: f"c{i}" for i in range(80)})
    with pytest.raises(ValueError, match="do not map"):  # a panoptic checkpoint: things plus stuff
        geneval_labels({**hf, 80: "wall-other-merged"})
    with pytest.raises(ValueError, match="do not map"):
        geneval_labels({i: n for i, n in hf.items() if i < 79})


def test_rescaled_size_follows_mmcv() -> None:
    # 512x512 into (1333, 800): factor min(1333/512, 800/512) = 1.5625 -> 800x800.
    assert rescaled_size(512, 512) == (800, 800)
    # 512x768: factor min(1333/768 = 1.736, 800/512 = 1.5625) -> (800, 1200).
    assert rescaled_size(512, 768) == (800, 1200)
    # 48x40 into (64, 48): factor min(64/48, 48/40) = 1.2 -> (57.6 + 0.5 -> 58, 48).
    assert rescaled_size(48, 40, (64, 48)) == (58, 48)


def test_mask2bbox() -> None:
    masks = torch.zeros(3, 5, 7, dtype=torch.bool)
    masks[0, 1:3, 2:6] = True  # rows 1-2, columns 2-5 -> [2, 1, 6, 3]
    masks[1, 4, 0] = True  # one pixel at (x=0, y=4) -> [0, 4, 1, 5]
    # masks[2] is empty -> [0, 0, 0, 0]
    assert mask2bbox(masks).tolist() == [[2, 1, 6, 3], [0, 4, 1, 5], [0, 0, 0, 0]]
    assert mask2bbox(masks).dtype == torch.float32


# ---------------------------------------------------------------------------------------------------------------------
# Colour pieces


def test_object_crop_composites_over_grey_and_crops_to_the_box() -> None:
    image = np.arange(4 * 6 * 3, dtype=np.uint8).reshape(4, 6, 3)
    mask = np.zeros((4, 6), dtype=bool)
    mask[1, 2] = mask[2, 3] = True
    crop = np.asarray(object_crop(image, [2, 1, 4, 3], mask))
    expected = np.full((2, 2, 3), 153, dtype=np.uint8)  # #999 outside the mask
    expected[0, 0], expected[1, 1] = image[1, 2], image[2, 3]
    assert crop.shape == (2, 2, 3) and np.array_equal(crop, expected)
    assert np.array_equal(np.asarray(object_crop(image, [0, 0, 6, 4])), image)  # no mask: the image itself
    assert object_crop(image, [0, 0, 0, 0], mask) is None and object_crop(image, [3, 1, 3, 4]) is None


def test_clip_pixels_is_openclips_eval_transform() -> None:
    mean, std = np.array([0.48145466, 0.4578275, 0.40821073]), np.array([0.26862954, 0.26130258, 0.27577711])
    grey = clip_pixels(Image.new("RGB", (10, 20), (153, 153, 153)), 8)
    assert grey.shape == (3, 8, 8)
    torch.testing.assert_close(grey, torch.tensor((153 / 255 - mean) / std, dtype=torch.float32).view(3, 1, 1)
                               .expand(3, 8, 8))  # fmt: skip
    rng = np.random.default_rng(0)
    crop = Image.fromarray(rng.integers(0, 256, (13, 8, 3), dtype=np.uint8))  # w 8, h 13
    # torchvision Resize(4): short side 8 -> 4, long int(4 * 13 / 8) = 6; CenterCrop(4): top round(1.0) = 1, left 0.
    manual = np.asarray(crop.resize((4, 6), Image.BICUBIC).crop((0, 1, 4, 5)), dtype=np.float32) / 255
    expected = torch.tensor(((manual - mean) / std).transpose(2, 0, 1), dtype=torch.float32)
    torch.testing.assert_close(clip_pixels(crop, 4), expected)


@pytest.fixture(scope="module")
def tiny_clip_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_clip(tmp_path_factory.mktemp("geneval_clip"))


def test_colour_classifier_equals_a_direct_zero_shot_computation(tiny_clip_path: Path) -> None:
    model = CLIPModel.from_pretrained(tiny_clip_path).eval()
    tokenizer = AutoTokenizer.from_pretrained(tiny_clip_path)
    colours = ColourClassifier(model, tokenizer)
    rng = np.random.default_rng(1)
    image = rng.integers(0, 256, (24, 20, 3), dtype=np.uint8)
    masks = [rng.random((24, 20)) > 0.5 for _ in range(3)]
    objects = [
        Detection([1, 2, 15, 20], 0.9, masks[0]),
        Detection([0, 0, 20, 24], 0.8, masks[1]),
        Detection([5, 5, 5, 9], 0.7, masks[2]),
    ]  # fmt: skip  (the last crop is empty)
    got = colours(image, objects, "fire hydrant")
    with torch.no_grad():
        rows = []
        for colour in COLORS:
            texts = [f"a photo of a {colour} fire hydrant", f"a photo of a {colour}-colored fire hydrant",
                     f"a photo of a {colour} object"]  # fmt: skip
            out = model.get_text_features(**tokenizer(texts, padding=True, return_tensors="pt"))
            emb = F.normalize(out if isinstance(out, torch.Tensor) else out.pooler_output, dim=-1).mean(0)
            rows.append(emb / emb.norm())
        classifier = torch.stack(rows)
        pixels = torch.stack([clip_pixels(object_crop(image, o.box, o.mask), 32) for o in objects[:2]])
        out = model.get_image_features(pixel_values=pixels)
        image_emb = F.normalize(out if isinstance(out, torch.Tensor) else out.pooler_output, dim=-1)
        expected = [COLORS[i] for i in (100 * image_emb @ classifier.T).argmax(1).tolist()]
    assert got == [*expected, NO_COLOUR]
    assert set(colours._classifiers) == {"fire hydrant"}  # cached per class


# ---------------------------------------------------------------------------------------------------------------------
# The reward on a tiny random Mask2Former (Swin backbone) and a tiny CLIP

# The labels as transformers' COCO checkpoints name them (mmdet/detectron2 names: mouse, remote, keyboard).
HF_LABELS = {
    i: {"computer mouse": "mouse", "tv remote": "remote", "computer keyboard": "keyboard"}.get(n, n)
    for i, n in enumerate(GENEVAL_CLASSES)
}
SCALE = (64, 48)  # the detector's resize target in the tests (GenEval's is (1333, 800))


def tiny_mask2former_config(id2label: dict[int, str]):
    from transformers import Mask2FormerConfig, SwinConfig

    swin = SwinConfig(
        image_size=64, patch_size=4, embed_dim=16, depths=[1, 1, 1, 1], num_heads=[1, 1, 2, 2], window_size=4,
        out_features=["stage1", "stage2", "stage3", "stage4"], drop_path_rate=0.0,
    )  # fmt: skip
    return Mask2FormerConfig(
        backbone_config=swin, feature_size=32, mask_feature_size=32, hidden_dim=32, encoder_feedforward_dim=64,
        encoder_layers=1, decoder_layers=2, num_attention_heads=2, dim_feedforward=64, num_queries=4,
        id2label=id2label,
    )  # fmt: skip


@pytest.fixture(scope="module")
def tiny_detector_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from transformers import Mask2FormerForUniversalSegmentation

    torch.manual_seed(0)
    model = Mask2FormerForUniversalSegmentation(tiny_mask2former_config(HF_LABELS)).eval()
    with torch.no_grad():
        # Every query about half "cat", half "dog" (random weights keep them apart: no exact ties), and sharp masks
        # (large logits: mean sigmoid inside ~1): scores ~0.5, kept at 0.3 but not at counting's 0.9.
        model.class_predictor.weight.mul_(0.1)
        model.class_predictor.bias.zero_()
        model.class_predictor.bias[GENEVAL_CLASSES.index("cat")] = 20.0
        model.class_predictor.bias[GENEVAL_CLASSES.index("dog")] = 20.0
        for module in model.model.transformer_module.decoder.mask_predictor.mask_embedder.modules():
            if isinstance(module, torch.nn.Linear):
                module.weight.mul_(4.0)
    path = tmp_path_factory.mktemp("geneval_m2f")
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def images() -> torch.Tensor:
    torch.manual_seed(1)
    # Smooth random images (48x40: resized to 58x48, padded to 64x64 by the detector's preprocessing).
    return F.interpolate(torch.rand(4, 3, 6, 5), size=(48, 40), mode="bilinear", align_corners=False)


@pytest.fixture(scope="module")
def reward(tiny_detector_path: Path, tiny_clip_path: Path) -> GenEvalReward:
    fn = get_reward(
        "geneval", detector_name_or_path=str(tiny_detector_path), clip_name_or_path=str(tiny_clip_path),
        detector_image_scale=SCALE, batch_size=3,
    )  # fmt: skip
    fn.load()
    return fn


def hand_detections(reward: GenEvalReward, image: torch.Tensor) -> dict[str, list[Detection]]:
    """One image's detections computed directly from the model's raw outputs, pair by pair (mmdet's rules)."""
    uint8 = (image[None] * 255).round().clamp(0, 255).to(torch.uint8)
    pixel_values, resized = reward.detector.preprocess(uint8)
    with torch.no_grad():
        out = reward.detector_model(pixel_values=pixel_values)
    probs = out.class_queries_logits[0].softmax(-1)[:, :-1]  # drop the no-object column
    pairs = sorted(((probs[q, c].item(), q, c) for q in range(probs.shape[0]) for c in range(probs.shape[1])),
                   reverse=True)[:100]  # fmt: skip
    found: dict[str, list[Detection]] = {}
    for prob, q, c in pairs:
        logits = out.masks_queries_logits[0, q][None, None]
        logits = F.interpolate(logits, size=pixel_values.shape[-2:], mode="bilinear", align_corners=False)
        logits = logits[..., : resized[0], : resized[1]]
        logits = F.interpolate(logits, size=image.shape[-2:], mode="bilinear", align_corners=False)[0, 0]
        mask = logits > 0
        mask_score = (logits.sigmoid() * mask).sum().item() / (mask.sum().item() + 1e-6)
        ys, xs = np.where(mask.numpy())
        box = [xs.min(), ys.min(), xs.max() + 1, ys.max() + 1] if len(xs) else [0, 0, 0, 0]
        found.setdefault(GENEVAL_CLASSES[c], []).append(Detection(box, prob * mask_score, mask))
    return found


def test_detector_loads_with_renamed_labels_and_matches_a_hand_computation(reward, images) -> None:
    assert reward.detector.class_names == list(GENEVAL_CLASSES)  # mouse/remote/keyboard renamed
    assert not any(p.requires_grad for p in reward.detector_model.parameters()) and not reward.detector_model.training
    uint8 = (images[:1] * 255).round().clamp(0, 255).to(torch.uint8)
    pixel_values, resized = reward.detector.preprocess(uint8)
    assert resized == (58, 48) and tuple(pixel_values.shape) == (1, 3, 64, 64)  # padded to a multiple of 32
    # reference_bgr: the network sees the channels swapped, as the RL reference's does.
    bgr = Mask2FormerDetector(reward.detector_model, SCALE, reference_bgr=True)
    assert torch.equal(bgr.preprocess(uint8)[0], reward.detector.preprocess(uint8.flip(1))[0])
    got = reward.detector(uint8)[0]
    expected = hand_detections(reward, images[0])
    assert set(got) == set(expected) and sum(map(len, got.values())) == 100

    def key(d: Detection) -> float:
        return -d.score

    for classname in expected:
        mine, theirs = sorted(got[classname], key=key), sorted(expected[classname], key=key)
        assert len(mine) == len(theirs)
        for a, b in zip(mine, theirs):
            assert a.score == pytest.approx(b.score, abs=1e-6)
            assert a.box.dtype == np.float32 and a.box.tolist() == [float(v) for v in b.box]
            assert torch.equal(a.mask, b.mask)
    # The fixture is meaningful: cats and dogs above 0.3, none above counting's 0.9.
    assert 0 < len(filter_detections(got, "single_object")["cat"]) and filter_detections(got, "counting") == {}


def test_reward_scores_a_batch_as_the_rules_on_hand_detections(reward, images) -> None:
    uint8 = (images * 255).round().clamp(0, 255).to(torch.uint8).permute(0, 2, 3, 1).numpy()
    hand = {i: hand_detections(reward, images[i]) for i in (0, 2, 3)}
    kept_cats = filter_detections(hand[0], "colors")["cat"]
    colours = reward.colours(uint8[0], kept_cats, "cat")
    colour = max(colours, key=colours.count)  # k >= 1 cats of this colour: a colour term above 0
    metadata = [
        {"tag": "colors", "include": [{"class": "cat", "count": len(kept_cats), "color": colour}]},  # the colour path
        None,
        {
            "tag": "position",
            "include": [{"class": "dog", "count": 1}, {"class": "cat", "count": 1, "position": ["left of", 0]}],
        },  # fmt: skip
        {"tag": "counting", "include": [{"class": "cat", "count": 2}], "exclude": [{"class": "cat", "count": 3}]},
    ]
    columns = {k: [m.get(k) if m else None for m in metadata] for k in ("tag", "include", "exclude")}
    prompts = ["a photo of red cats", "a plain prompt", "a cat left of a dog", "a photo of two cats"]
    got = reward(prompts, images, **columns)
    assert got[1] is None and all(isinstance(v, float) for i, v in enumerate(got) if i != 1)

    def expected(i: int, metric: str) -> float:
        def colour_of(objects, classname):
            return reward.colours(uint8[i], objects, classname)

        return geneval_value(hand[i], metadata[i], colour_of, metric)

    for i in (0, 2, 3):
        assert got[i] == pytest.approx(expected(i, "score"))
    assert got[3] == 0.0  # counting: nothing above 0.9 -> the count term 1 - 2/2 = 0
    # Row 0: n == count, so the terms are [1, k / n] with k >= 1: above 0.5 (the colour check counted).
    assert got[0] > 0.5
    # One `metadata` column: the same values (and a second call: deterministic).
    assert reward(prompts, images, metadata=metadata) == got
    for metric in ("correct", "strict"):  # the other metrics: the rules' value for them
        reward.metric = metric
        try:
            values = reward(prompts, images, metadata=metadata)
        finally:
            reward.metric = "score"
        assert values == [expected(0, metric), None, expected(2, metric), expected(3, metric)]


def test_reward_through_score_rewards_with_a_mixed_batch(reward, images) -> None:
    columns = {
        "tag": ["single_object", None, None, "two_object"],
        "include": [
            [{"class": "cat", "count": 1}],
            None,
            None,
            [{"class": "cat", "count": 1}, {"class": "dog", "count": 1}],
        ],  # fmt: skip
        "exclude": [None] * 4,
    }
    check_reward_signature(reward, columns=["prompt", *columns])
    prompts = ["a photo of a cat", "a sunset", "a poster", "a photo of a cat and a dog"]
    out = score_rewards([reward], prompts, images, columns, trainer_state=None, logs=RewardLogs())
    assert out.shape == (1, 4) and math.isnan(out[0, 1]) and math.isnan(out[0, 2])
    direct = reward(prompts, images, **columns)
    assert out[0, 0].item() == pytest.approx(direct[0]) and out[0, 3].item() == pytest.approx(direct[3])


def test_reward_without_geneval_rows_loads_nothing_and_nan_images_are_refused(reward, images) -> None:
    fn = get_reward("geneval", detector_name_or_path="/nonexistent/detector", clip_name_or_path="/nonexistent/clip")
    assert isinstance(fn, GenEvalReward) and fn.__name__ == "geneval"
    assert fn(["a", "b"], images[:2], include=[None, None]) == [None, None] and not fn._loaded
    bad = images[:1].clone()
    bad[0, 0, 0, 0] = float("nan")
    with pytest.raises(ValueError, match="NaN"):  # uint8 would hide it as a black pixel
        reward(["a"], bad, include=[[{"class": "cat", "count": 1}]])


def test_registry_options(tmp_path) -> None:
    assert isinstance(get_reward("geneval", url="http://127.0.0.1:9/score", timeout=5), HTTPReward)
    with pytest.raises(TypeError, match="give its `url`"):
        get_reward("geneval", timeout=5)
    with pytest.raises(ValueError, match="metric"):
        get_reward("geneval", metric="accuracy")
    fn = get_reward("geneval", name="geneval_strict", metric="strict", device="cpu", dtype="bfloat16", batch_size=2)
    assert fn.__name__ == "geneval_strict" and fn.dtype == torch.bfloat16 and fn.batch_size == 2
    # A checkpoint whose labels are not GenEval's is refused before its weights are read (only config.json here).
    tiny_mask2former_config({i: f"class_{i}" for i in range(80)}).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="do not map"):
        GenEvalReward(str(tmp_path), "/nonexistent/clip").load()
