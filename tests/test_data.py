"""Tests of the prompt datasets and the group sampler."""

from __future__ import annotations

from collections import Counter

import pytest
from datasets import Dataset

from marble_trl.data import GroupSampler, bundled_prompts_path, check_prompt_dataset, load_prompt_dataset

# ---------------------------------------------------------------- GroupSampler


def prompt_order(sampler: GroupSampler) -> list[int]:
    """The prompt sequence of one epoch, after checking that each prompt comes as G consecutive copies."""
    indices = list(sampler)
    g = sampler.num_generations
    assert len(indices) == len(sampler)
    assert len(indices) % g == 0
    groups = [indices[i : i + g] for i in range(0, len(indices), g)]
    for grp in groups:
        assert grp == [grp[0]] * g, grp
    return [grp[0] for grp in groups]


@pytest.mark.parametrize(
    "num_prompts,g,pps,steps",
    [(10, 3, 4, 2), (8, 2, 4, 2), (16, 24, 16, 1), (7, 5, 7, 1), (100, 4, 9, 11)],
)
def test_sampler_yields_whole_steps_of_groups(num_prompts, g, pps, steps):
    sampler = GroupSampler(num_prompts, g, pps, seed=3)
    assert len(sampler) == steps * pps * g
    order = prompt_order(sampler)
    assert len(order) == steps * pps
    assert len(set(order)) == len(order)  # no prompt twice within an epoch
    assert set(order) <= set(range(num_prompts))


def test_sampler_epoch_is_a_permutation_when_steps_divide_the_dataset():
    sampler = GroupSampler(12, 3, 4, seed=0)
    for epoch in range(3):
        sampler.set_epoch(epoch)
        assert sorted(prompt_order(sampler)) == list(range(12))


def test_sampler_cycles_a_dataset_smaller_than_one_step():
    sampler = GroupSampler(3, 2, 8, seed=1)
    assert len(sampler) == 8 * 2
    order = prompt_order(sampler)
    assert len(order) == 8
    counts = Counter(order)
    assert set(counts) == {0, 1, 2}
    assert max(counts.values()) - min(counts.values()) <= 1  # whole permutations, then a partial one
    assert sorted(order[:3]) == [0, 1, 2] and sorted(order[3:6]) == [0, 1, 2]


def test_single_prompt_dataset():
    sampler = GroupSampler(1, 4, 2, seed=0)
    assert list(sampler) == [0] * 8


def test_sampler_is_deterministic_per_seed_and_epoch():
    a, b = GroupSampler(50, 2, 10, seed=7), GroupSampler(50, 2, 10, seed=7)
    assert list(a) == list(b)
    assert list(a) == list(a)  # iterating again does not advance any state
    first = list(a)
    a.set_epoch(1)
    assert list(a) != first
    b.set_epoch(1)
    assert list(a) == list(b)
    a.set_epoch(0)
    assert list(a) == first
    assert list(GroupSampler(50, 2, 10, seed=8)) != first


def test_sampler_does_not_touch_the_global_rng():
    import torch

    state = torch.random.get_rng_state()
    list(GroupSampler(20, 3, 5, seed=0))
    assert torch.equal(torch.random.get_rng_state(), state)


# ---------------------------------------------------------------- load_prompt_dataset


def expected_lines(text: str) -> list[str]:
    return [ln.strip() for ln in text.splitlines() if ln.strip() and not ln.strip().startswith("#")]


@pytest.mark.parametrize("path", [None, "bundled"])
def test_load_bundled_prompts(path):
    ds = load_prompt_dataset(path)
    assert ds.column_names == ["prompt"]
    assert ds["prompt"] == expected_lines(bundled_prompts_path().read_text(encoding="utf-8"))
    assert len(ds) >= 8
    assert all(p and not p.startswith("#") and p == p.strip() for p in ds["prompt"])


def test_load_prompt_file_skips_comments_and_blank_lines(tmp_path):
    file = tmp_path / "prompts.txt"
    file.write_text(
        '# a header comment\n\na cat\n   \n  a dog on a sofa  \n\t# indented comment\nsay "hi" # not a comment\n',
        encoding="utf-8",
    )
    ds = load_prompt_dataset(str(file))
    assert ds["prompt"] == ["a cat", "a dog on a sofa", 'say "hi" # not a comment']


def test_load_missing_file_names_the_path(tmp_path):
    missing = tmp_path / "nope" / "prompts.txt"
    with pytest.raises(FileNotFoundError, match="nope"):
        load_prompt_dataset(str(missing))


def test_load_directory_is_not_a_prompt_file(tmp_path):
    with pytest.raises(FileNotFoundError):
        load_prompt_dataset(str(tmp_path))


@pytest.mark.parametrize("text", ["", "\n\n   \n", "# only\n#comments\n"])
def test_load_empty_file_raises(tmp_path, text):
    file = tmp_path / "empty.txt"
    file.write_text(text, encoding="utf-8")
    with pytest.raises(ValueError, match="no prompt"):
        load_prompt_dataset(str(file))


# ---------------------------------------------------------------- check_prompt_dataset


def test_check_accepts_a_prompt_dataset_with_extra_columns():
    check_prompt_dataset(Dataset.from_dict({"prompt": ["a"], "target": ["b"]}))


def test_check_none():
    with pytest.raises(ValueError, match="eval_dataset is required"):
        check_prompt_dataset(None, name="eval_dataset")


def test_check_empty():
    with pytest.raises(ValueError, match="empty"):
        check_prompt_dataset(Dataset.from_dict({"prompt": []}))


def test_check_missing_prompt_column_names_columns_and_fix():
    with pytest.raises(ValueError) as info:
        check_prompt_dataset(Dataset.from_dict({"text": ["a cat"], "label": [1]}))
    message = str(info.value)
    assert "'prompt'" in message and "text" in message and "label" in message
    assert "rename_column" in message


def test_check_rejects_non_datasets():
    with pytest.raises(TypeError, match="datasets.Dataset"):
        check_prompt_dataset(["a cat", "a dog"])
