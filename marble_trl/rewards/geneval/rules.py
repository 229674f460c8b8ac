"""GenEval's scoring rules, in plain Python and numpy: no model is needed to run or test them.

Written from the specification of GenEval (Ghosh et al., 2023, github.com/djghosh13/geneval,
``evaluation/evaluate_images.py``) and of the RL reward built on it by flow_grpo's reward-server and DiffusionNFT
(``flow_grpo/gen_eval.py``, which MARBLE imports); docs/rewards.md lists the rules. Three values per image:

- :func:`evaluate`: GenEval's binary ``correct`` (the published benchmark metric);
- :func:`evaluate_reward`: the RL reward's ``strict_correct`` and its partial-credit ``score``, the value MARBLE
  trains on, with the reference's quirks kept on purpose (an unclipped count term that goes negative, the ``1.0``
  appended after a failed position check, ``exclude`` ignored).

Detections come per class, each a :class:`Detection` ``(box, score, mask)`` (plain tuples work too) with ``box``
``[x1, y1, x2, y2]`` in pixels. Colours come from a ``colour_of(objects, classname) -> list[str]`` callable, so that
the rules can be tested with a stub instead of CLIP.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

import numpy as np

COLORS = ("red", "orange", "yellow", "green", "blue", "purple", "pink", "brown", "black", "white")
RELATIONS = ("left of", "right of", "above", "below")
THRESHOLD = 0.3  # detection score threshold, every tag but counting
COUNTING_THRESHOLD = 0.9  # detection score threshold of the counting prompts
MAX_OBJECTS = 16  # detections kept per class, after the threshold
POSITION_THRESHOLD = 0.1  # the relative-position margin, a fraction of the two boxes' summed sizes


class Detection(NamedTuple):
    """One detected object: ``box`` ``[x1, y1, x2, y2]``, ``score`` in ``[0, 1]``, ``mask`` (anything the colour
    classifier reads; ``None`` when there is none)."""

    box: Sequence[float]
    score: float
    mask: Any = None


Objects = dict[str, list[Detection]]
ColourOf = Callable[[Sequence[Detection], str], list[str]]


def threshold_for(tag: str | None) -> float:
    """The score threshold of a prompt: it depends on the prompt's tag, not on the detected class."""
    return COUNTING_THRESHOLD if tag == "counting" else THRESHOLD


def filter_detections(detections: Mapping[str, Sequence[Any]], tag: str | None) -> Objects:
    """Keep the detections scoring strictly above the tag's threshold, best first, at most 16 per class.

    There is no NMS (GenEval's overlap threshold is 1.0): two detections of one object count as two objects.
    Scores are compared and sorted in float32, as the reference does with mmdet's float32 score arrays, so a score of
    exactly 0.3 (as a float32) is dropped. Equal scores keep their given order (the reference's order for exact ties
    is numpy's unstable argsort; it changes no ``score`` or ``strict_correct``, only which of two equally scored
    objects GenEval's ``correct`` looks at first). Classes with nothing kept are absent from the result.
    """
    threshold = np.float32(threshold_for(tag))
    out: Objects = {}
    for classname, found in detections.items():
        items = [Detection(*d) for d in found]
        scores = [np.float32(d.score) for d in items]
        kept = sorted((i for i, s in enumerate(scores) if s > threshold), key=lambda i: -scores[i])
        if kept:
            out[classname] = [items[i] for i in kept[:MAX_OBJECTS]]
    return out


def relative_position(box_a: Sequence[float], box_b: Sequence[float]) -> set[str]:
    """The relations of box A to box B among ``"left of"``, ``"right of"``, ``"above"``, ``"below"`` (y grows down).

    The centre offset A - B is shrunk towards 0 on each axis by a margin of 0.1 x (A's size + B's size) on that axis,
    then divided by the length of the unshrunk offset: a relation holds when its axis' component passes 0.5 (strictly).
    Two relations can hold at once; a shrunk offset under 1e-3 on both axes (identical centres included) gives the
    empty set. Computed in the boxes' own dtype (float32 for detector boxes), as the reference does.
    """
    boxes = np.stack([np.asarray(box_a)[:4], np.asarray(box_b)[:4]])
    low, high = boxes[:, :2], boxes[:, 2:]
    centres = (low + high) / 2
    sizes = np.abs(high - low)
    offset = centres[0] - centres[1]
    revised = np.sign(offset) * np.maximum(np.abs(offset) - POSITION_THRESHOLD * (sizes[0] + sizes[1]), 0)
    if np.all(np.abs(revised) < 1e-3):
        return set()
    dx, dy = revised / np.linalg.norm(offset)
    relations = set()
    if dx < -0.5:
        relations.add("left of")
    if dx > 0.5:
        relations.add("right of")
    if dy < -0.5:
        relations.add("above")
    if dy > 0.5:
        relations.add("below")
    return relations


def requirements(metadata: Mapping[str, Any], key: str = "include") -> list[dict[str, Any]]:
    """The ``include`` (or ``exclude``) requirements of one prompt, checked.

    A ``color`` or ``position`` of ``None`` counts as absent: datasets stored as Arrow structs give every requirement
    every key, ``None`` where the JSON had none. ``count`` is required (the reference has no default either) and must
    be a positive integer; the reward divides by it.
    """
    out = []
    for req in metadata.get(key) or []:
        if not isinstance(req, Mapping) or "class" not in req:
            raise ValueError(f"GenEval {key} entry {req!r} must be a mapping with 'class' and 'count'.")
        count = req.get("count")
        if isinstance(count, bool) or not isinstance(count, (int, np.integer)) or count < 1:
            raise ValueError(f"GenEval {key} entry {dict(req)!r}: 'count' must be a positive integer, got {count!r}.")
        clean = {"class": req["class"], "count": int(count)}
        if req.get("color") is not None:
            clean["color"] = req["color"]
        if req.get("position") is not None:
            relation, target = req["position"]
            clean["position"] = (relation, int(target))
        out.append(clean)
    return out


def _target(groups: list[list[Detection] | None], index: int, req: Mapping[str, Any]) -> list[Detection] | None:
    try:
        return groups[index]
    except IndexError:
        raise ValueError(
            f"GenEval requirement {dict(req)!r}: position target {index} is not an earlier include entry."
        ) from None


def _relation_holds(found: Sequence[Detection], targets: Sequence[Detection], relation: str) -> bool:
    return all(relation in relative_position(o.box, t.box) for o in found for t in targets)


def evaluate(objects: Mapping[str, Sequence[Detection]], metadata: Mapping[str, Any], colour_of: ColourOf) -> bool:
    """GenEval's ``correct``: every include requirement met by its ``count`` best detections, no exclude one hit.

    For each include entry: at least ``count`` detections of the class (more are fine); the ``count`` best must all
    be classified as ``color``; for ``position``, the target entry must have passed and every (object, target) pair of
    their ``count`` best detections must hold the relation. An exclude entry fails the image when the class has at
    least ``count`` kept detections. ``objects`` is the output of :func:`filter_detections`.
    """
    correct = True
    groups: list[list[Detection] | None] = []
    for req in requirements(metadata):
        classname, count = req["class"], req["count"]
        found = list(objects.get(classname, []))[:count]
        matched = len(found) >= count
        if matched and "color" in req:
            matched = colour_of(found, classname).count(req["color"]) >= count
        if matched and "position" in req:
            relation, index = req["position"]
            targets = _target(groups, index, req)
            matched = targets is not None and _relation_holds(found, targets, relation)
        correct = correct and matched
        groups.append(found if matched else None)
    for req in requirements(metadata, "exclude"):
        if len(objects.get(req["class"], [])) >= req["count"]:
            correct = False
    return correct


def evaluate_reward(
    objects: Mapping[str, Sequence[Detection]], metadata: Mapping[str, Any], colour_of: ColourOf
) -> tuple[bool, float]:
    """The RL reward's ``(strict_correct, score)`` (reward-server / DiffusionNFT ``evaluate_reward``).

    ``score`` is the mean of a variable-length list of terms, appended per include entry (n = the class's kept
    detections, at most 16):

    - always ``1 - |count - n| / count``, not clipped: 3 detections for a count of 1 give -1;
    - when ``n != count`` and the entry has a colour or a position: one ``0.0``;
    - when ``n == count`` and a colour: ``1 - |count - k| / count``, k = objects classified as the colour;
    - when ``n == count``, the colour (if any) matched and a position: ``0.0`` if the target entry failed; otherwise
      ``1.0`` when every pair holds the relation, and ``0.0, 1.0`` when one does not (the reference appends the 1.0
      after its loop whatever happened, a quirk kept here).

    ``score`` is 0 for an empty ``include``. ``exclude`` is ignored: exactness comes from ``n == count``.
    ``strict_correct`` needs every entry to have exactly ``count`` detections, all of the colour and the relation.
    """
    strict = True
    terms: list[float] = []
    groups: list[list[Detection] | None] = []
    for req in requirements(metadata):
        classname, count = req["class"], req["count"]
        found = list(objects.get(classname, []))
        terms.append(1 - abs(count - len(found)) / count)
        matched = len(found) == count
        if not matched:
            if "color" in req or "position" in req:
                terms.append(0.0)
        else:
            if "color" in req:
                hits = colour_of(found, classname).count(req["color"])
                terms.append(1 - abs(count - hits) / count)
                matched = hits == count
            if matched and "position" in req:
                relation, index = req["position"]
                targets = _target(groups, index, req)
                if targets is None:
                    matched = False
                    terms.append(0.0)
                else:
                    matched = _relation_holds(found, targets, relation)
                    terms.extend([1.0] if matched else [0.0, 1.0])
        strict = strict and matched
        groups.append(found if matched else None)
    return strict, (sum(terms) / len(terms) if terms else 0.0)


METRICS = ("score", "correct", "strict")


def geneval_value(
    detections: Mapping[str, Sequence[Any]], metadata: Mapping[str, Any], colour_of: ColourOf, metric: str = "score"
) -> float:
    """One image's value: the partial-credit ``score`` (default), GenEval's ``correct`` or ``strict`` (the RL
    reward's ``strict_correct``), the last two as 1.0 / 0.0. ``detections`` are unfiltered (all the detector's)."""
    objects = filter_detections(detections, metadata.get("tag"))
    if metric == "score":
        return float(evaluate_reward(objects, metadata, colour_of)[1])
    if metric == "strict":
        return float(evaluate_reward(objects, metadata, colour_of)[0])
    if metric == "correct":
        return float(evaluate(objects, metadata, colour_of))
    raise ValueError(f"GenEval metric must be one of {METRICS}, got {metric!r}.")
