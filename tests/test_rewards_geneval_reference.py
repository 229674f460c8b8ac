"""The GenEval rules (marble_trl.rewards.geneval.rules) against GenEval's own code, run on synthetic detections.

The references are vendored byte for byte (tests/_vendor/geneval, MIT, hashes checked below): GenEval's
``evaluation/evaluate_images.py`` (the benchmark's ``correct``) and flow_grpo's reward-server ``gen_eval.py`` (the RL
reward's ``score`` and ``strict_correct``, which DiffusionNFT and MARBLE train on). Both import mmdet, open_clip and
CUDA at the top, so their functions are taken out of the files with ``ast`` and run as written, end to end from the
detector's raw output (``evaluate_image``: threshold, ordering, cap, NMS, rules), with the detector and the CLIP colour
classifier replaced by stubs that return the synthetic detections and each object's given colour.

The cases cover every task type (single_object, two_object, counting, colors, position, color_attr) with random
detections, scores at and next to both thresholds, more than 16 detections of a class, and boxes on both sides of the
position margin.
"""

from __future__ import annotations

import ast
import hashlib
import types
from pathlib import Path

import numpy as np
import pytest

from marble_trl.rewards.geneval.rules import COLORS, Detection, geneval_value

VENDOR = Path(__file__).parent / "_vendor" / "geneval"
SHA256 = {  # the files as published (README.md gives the commits)
    "evaluate_images.py": "c0fdeb8315f7d3ed72b56f466652afba5216f854109c6eeea339f9982474ea46",
    "gen_eval.py": "bf0c3bedaeba00bd9099f301155e159c0dc170bf154c2d7b7e00dd6a442f3276",
    "LICENSE-geneval": "e6082bfcbdf460dd19f8c55cc261055414df2a278768b4991c5382d65be2b52a",
    "LICENSE-reward-server": "40ff7f245fee2c6a1922306ad76dbad5671b76f75cbd376aaa4213a6246753df",
}
CLASSES = ["cat", "dog", "cup", "kite"]
TAGS = ["single_object", "two_object", "counting", "colors", "position", "color_attr"]
PALETTE = COLORS[:3]  # few colours, so that colour requirements pass often enough to reach the position rule


def _functions(source: str, names: set[str], inside: str | None = None) -> ast.Module:
    tree = ast.parse(source)
    body = tree.body
    if inside is not None:
        body = next(n for n in body if isinstance(n, ast.FunctionDef) and n.name == inside).body
    found = [n for n in body if isinstance(n, ast.FunctionDef) and n.name in names]
    assert {n.name for n in found} == names
    return ast.Module(body=found, type_ignores=[])


def _namespace(detector_output) -> dict:
    """What the references' functions read from their module: the constants as their entry points set them, the
    detector (returning ``detector_output``), the colour classifier (each object's colour rides in its mask) and a
    stand-in image."""
    return {
        "np": np,
        "json": __import__("json"),
        "COLORS": list(COLORS),
        "THRESHOLD": 0.3,
        "COUNTING_THRESHOLD": 0.9,
        "MAX_OBJECTS": 16,
        "NMS_THRESHOLD": 1.0,
        "POSITION_THRESHOLD": 0.1,
        "classnames": CLASSES,
        "object_detector": None,
        "inference_detector": lambda detector, images: detector_output(images),
        "color_classification": lambda image, objects, classname: [mask for _, mask in objects],
        "Image": types.SimpleNamespace(open=lambda path: "image"),
        "ImageOps": types.SimpleNamespace(exif_transpose=lambda image: image),
    }


def _load(file: str, names: set[str], inside: str | None = None):
    code = compile(_functions((VENDOR / file).read_text(), names, inside), str(VENDOR / file), "exec")

    def run(detector_output) -> dict:
        ns = _namespace(detector_output)
        exec(code, ns)  # noqa: S102 (the vendored reference, as published)
        return ns

    return run


GENEVAL = _load("evaluate_images.py", {"compute_iou", "relative_position", "evaluate", "evaluate_image"})
REWARD_SERVER = _load(
    "gen_eval.py",
    {"compute_iou", "relative_position", "evaluate", "evaluate_reward", "evaluate_image"},
    "load_geneval",
)


def test_the_vendored_references_are_the_published_files():
    for name, digest in SHA256.items():
        assert hashlib.sha256((VENDOR / name).read_bytes()).hexdigest() == digest, name
    assert (VENDOR / "LICENSE-geneval").read_text().startswith("MIT License")
    assert (VENDOR / "LICENSE-reward-server").read_text().startswith("MIT License")


# ---------------------------------------------------------------------------------------------------------------------
# Synthetic cases

EDGE_SCORES = [
    np.float32(0.3),
    np.nextafter(np.float32(0.3), np.float32(1)),
    np.float32(0.9),
    np.nextafter(np.float32(0.9), np.float32(1)),
    np.nextafter(np.float32(0.9), np.float32(0)),
]


def _metadata(rng: np.random.Generator, tag: str) -> dict:
    a, b = rng.choice(CLASSES, 2, replace=False).tolist()
    colour = lambda: str(rng.choice(PALETTE))  # noqa: E731
    if tag == "single_object":
        include = [{"class": a, "count": 1}]
    elif tag == "two_object":
        include = [{"class": a, "count": 1}, {"class": b, "count": 1}]
    elif tag == "counting":
        n = int(rng.integers(1, 5))
        return {"tag": tag, "include": [{"class": a, "count": n}], "exclude": [{"class": a, "count": n + 1}]}
    elif tag == "colors":
        include = [{"class": a, "count": 1, "color": colour()}]
    elif tag == "position":
        relation = str(rng.choice(["left of", "right of", "above", "below"]))
        include = [{"class": b, "count": 1}, {"class": a, "count": 1, "position": [relation, 0]}]
    else:  # color_attr
        include = [{"class": a, "count": 1, "color": colour()}, {"class": b, "count": 1, "color": colour()}]
    return {"tag": tag, "include": include}


def _detections(rng: np.random.Generator, tag: str) -> tuple[list[np.ndarray], list[list[str]]]:
    """Per class: an [n, 5] float32 array (box, score) as mmdet returns, and each object's colour. Scores are distinct
    within a class (the reference's order for exact ties is numpy's unstable argsort)."""
    bboxes, colours = [], []
    for _ in CLASSES:
        n = int(rng.choice([0, 1, 1, 2, 3, 5, 18])) if tag == "counting" else int(rng.choice([0, 1, 1, 1, 2, 3, 18]))
        pool = list(rng.uniform(0.0, 1.0, size=n))
        for i in range(min(n, 2)):
            if rng.random() < 0.5:
                pool[i] = EDGE_SCORES[int(rng.integers(len(EDGE_SCORES)))]
        scores = np.unique(np.asarray(pool, dtype=np.float32))
        rng.shuffle(scores)
        n = len(scores)
        x1 = rng.uniform(0, 400, n)
        y1 = rng.uniform(0, 400, n)
        w = rng.uniform(5, 200, n)
        h = rng.uniform(5, 200, n)
        box = np.stack([x1, y1, x1 + w, y1 + h, scores], axis=1).astype(np.float32).reshape(n, 5)
        bboxes.append(box)
        colours.append([str(rng.choice(PALETTE)) for _ in range(n)])
    return bboxes, colours


# Centre offsets of two 50 x 50 boxes along an axis: a relation holds past 20 (0.2 x the summed sizes), none at all
# up to 10 (the margin swallows the offset), with and without a cross-axis offset.
OFFSETS = [0.0, 9.9, 10.0, 10.5, 19.5, 20.0, 20.5, 21.0, 21.5, 22.5, 30.0, 60.0]


def _place_pair(rng: np.random.Generator, bboxes, colours, metadata) -> None:
    """One detection each of the position prompt's two classes (so the reference reaches its position rule), the
    object's centre offset from the target's by values next to the margin's boundaries."""
    target, obj = (CLASSES.index(req["class"]) for req in metadata["include"])
    dx, dy = (float(rng.choice([-1, 1]) * rng.choice(OFFSETS)) for _ in range(2))
    if rng.random() < 0.5:
        dy = 0.0
    for index, (x, y) in ((target, (200.0, 200.0)), (obj, (200.0 + dx, 200.0 + dy))):
        bboxes[index] = np.asarray([[x - 25, y - 25, x + 25, y + 25, 0.8]], dtype=np.float32)
        colours[index] = ["red"]


def _references(bboxes, colours, metadata) -> tuple[float, float, float, float]:
    """(GenEval's correct, the reward server's correct, strict_correct, score) of one image's raw detections."""
    geneval = GENEVAL(lambda path: (bboxes, colours))["evaluate_image"]("image.png", metadata)
    server = REWARD_SERVER(lambda images: [(bboxes, colours)] * len(images))["evaluate_image"](
        ["image"], [metadata], False
    )[0]
    return float(geneval["correct"]), float(server["correct"]), float(server["strict_correct"]), server["score"]


def _ours(bboxes, colours, metadata) -> tuple[float, float, float]:
    detections = {
        c: [Detection(row[:4], row[4], colour) for row, colour in zip(bboxes[i], colours[i])]
        for i, c in enumerate(CLASSES)
    }
    return tuple(geneval_value(detections, metadata, lambda objs, c: [o.mask for o in objs], m) for m in
                 ("correct", "strict", "score"))  # fmt: skip


@pytest.mark.parametrize("tag", TAGS)
def test_the_rules_equal_genevals_and_the_reward_servers_code(tag):
    rng = np.random.default_rng(TAGS.index(tag))
    seen = {"correct": set(), "strict": set(), "score": set()}
    for _ in range(300):
        metadata = _metadata(rng, tag)
        metadata["prompt"] = "a synthetic prompt"
        bboxes, colours = _detections(rng, tag)
        if tag == "position" and rng.random() < 0.6:
            _place_pair(rng, bboxes, colours, metadata)
        geneval_correct, server_correct, server_strict, server_score = _references(bboxes, colours, metadata)
        correct, strict, score = _ours(bboxes, colours, metadata)
        case = f"{metadata}, detections {[b.tolist() for b in bboxes]}, colours {colours}"
        assert correct == geneval_correct == server_correct, case
        assert strict == server_strict, case
        assert score == server_score, case  # the same terms summed in the same order: exactly equal
        seen["correct"].add(correct)
        seen["strict"].add(strict)
        seen["score"].add(round(score, 6))
    # the cases reach both verdicts and several partial scores
    assert seen["correct"] == {0.0, 1.0} and seen["strict"] == {0.0, 1.0} and len(seen["score"]) >= 3


def test_scores_at_the_thresholds_and_the_cap_are_handled_as_the_reference():
    """Hand-made: a score of exactly 0.3 / 0.9 (float32) is dropped, the next float32 kept; 18 detections are cut to
    16 for counting's exactness; both references agree."""
    for tag, edge, count in (("single_object", 0.3, 1), ("counting", 0.9, 2), ("counting", 0.9, 16)):
        for score, kept in ((np.float32(edge), False), (np.nextafter(np.float32(edge), np.float32(1)), True)):
            n = 18 if count == 16 else count
            rows = [[10 * i, 0, 10 * i + 8, 8, 0.95 - 0.001 * i] for i in range(n - 1)] + [[500, 0, 508, 8, score]]
            bboxes = [np.asarray(rows, dtype=np.float32)] + [np.zeros((0, 5), np.float32)] * (len(CLASSES) - 1)
            colours = [["red"] * n] + [[]] * (len(CLASSES) - 1)
            metadata = {"tag": tag, "prompt": "p", "include": [{"class": "cat", "count": count}]}
            geneval_correct, server_correct, server_strict, server_score = _references(bboxes, colours, metadata)
            correct, strict, score_ = _ours(bboxes, colours, metadata)
            assert (correct, strict, score_) == (geneval_correct, server_strict, server_score)
            assert server_correct == geneval_correct
            if count < 16:
                assert strict == float(kept)
            else:  # 18 above the threshold or 17: capped at 16 either way
                assert strict == 1.0
