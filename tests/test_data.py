"""Tests of the prompt datasets and the group sampler."""

from __future__ import annotations

from collections import Counter

import pytest
from datasets import Dataset

from marble_trl.data.prompts import GroupSampler, bundled_prompts_path, check_prompt_dataset, load_prompt_dataset

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


# ---------------------------------------------------------------- GroupSampler with prompt sources and ratios


def mixed_sampler(ratios, sizes, pps=4, g=2, seed=0):
    sources = [k for k, n in enumerate(sizes) for _ in range(n)]
    return GroupSampler(len(sources), g, pps, seed=seed, sources=sources, ratios=ratios), sources


def test_mixing_ratios_hold_over_many_draws():
    sampler, sources = mixed_sampler([0.7, 0.2, 0.1], [5, 30, 3], pps=4)
    counts = Counter()
    steps = 0
    for epoch in range(200):
        sampler.set_epoch(epoch)
        order = prompt_order(sampler)  # also checks that every group is one prompt (hence one source)
        for s in range(0, len(order), 4):
            step = Counter(sources[i] for i in order[s : s + 4])
            # systematic sampling: every step holds floor or ceil of ratio * prompts_per_step of each source
            for k, r in enumerate([0.7, 0.2, 0.1]):
                assert int(r * 4) <= step[k] <= int(r * 4) + 1
            counts.update(step)
            steps += 1
    total = sum(counts.values())
    assert total == steps * 4
    for k, r in enumerate([0.7, 0.2, 0.1]):
        assert counts[k] / total == pytest.approx(r, abs=0.01)


def test_mixed_sampler_cycles_small_sources_and_skips_zero_ratios():
    sampler, sources = mixed_sampler([1.0, 0.0, 1.0], [2, 10, 20], pps=8)
    order = prompt_order(sampler)
    assert len(order) == 4 * 8  # 32 rows // 8 prompts per step: 4 steps
    assert all(sources[i] != 1 for i in order)
    small = [i for i in order if sources[i] == 0]
    assert set(small) == {0, 1} and len(small) == 16  # cycled
    first_small = small[:2]
    assert sorted(first_small) == [0, 1]  # whole permutations of the source before repeating


def test_mixed_sampler_is_deterministic_and_keeps_the_global_rng():
    import torch

    a, _ = mixed_sampler([0.5, 0.5], [7, 9], seed=3)
    b, _ = mixed_sampler([0.5, 0.5], [7, 9], seed=3)
    state = torch.random.get_rng_state()
    assert list(a) == list(b) == list(a)
    assert torch.equal(torch.random.get_rng_state(), state)
    first = list(a)
    a.set_epoch(1)
    assert list(a) != first
    assert list(mixed_sampler([0.5, 0.5], [7, 9], seed=4)[0]) != first


def test_single_source_order_is_unchanged_without_ratios():
    plain = GroupSampler(12, 2, 4, seed=5)
    assert plain.rows_by_source is None
    assert list(plain) == list(GroupSampler(12, 2, 4, seed=5, sources=None, ratios=None))


@pytest.mark.parametrize(
    "sources,ratios,match",
    [
        ([0, 1], None, "both"),
        ([0, 1, 1], [1, 1], "3 entries"),
        ([0, 0], [0, 0], "positive"),
        ([0, 0], [1, 1], "no rows"),
        ([0, 2], [1, 1], "source index 2"),
    ],
)
def test_mixed_sampler_rejects_bad_input(sources, ratios, match):
    with pytest.raises(ValueError, match=match):
        GroupSampler(2, 2, 2, sources=sources, ratios=ratios)


# ---------------------------------------------------------------- prompt sources (marble_trl.data.sources)


def write_sources(tmp_path):
    import json

    (tmp_path / "plain.txt").write_text("a cat\na dog\n", encoding="utf-8")
    rows = [{"caption": "a sign saying HI", "text": "HI"}, {"caption": "a sign saying YO", "text": "YO"}]
    (tmp_path / "ocr.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n", encoding="utf-8")
    (tmp_path / "geneval.csv").write_text("prompt,tag\ntwo red balls,counting\na cat left of a dog,position\n")
    return tmp_path


def test_load_prompt_sources_mixes_columns_and_labels_sources(tmp_path):
    from marble_trl.data.sources import load_prompt_sources, mixture_ratios

    write_sources(tmp_path)
    specs = [
        str(tmp_path / "plain.txt"),
        {"path": str(tmp_path / "ocr.jsonl"), "prompt_column": "caption", "name": "ocr"},
        {"path": str(tmp_path / "geneval.csv")},
    ]
    ds = load_prompt_sources(specs)
    assert ds.column_names == ["prompt", "text", "tag", "source"]
    assert ds["source"] == ["plain", "plain", "ocr", "ocr", "geneval", "geneval"]
    assert ds["prompt"][2] == "a sign saying HI"
    assert ds["text"] == [None, None, "HI", "YO", None, None]  # missing columns become None
    assert ds["tag"] == [None, None, None, None, "counting", "position"]
    assert mixture_ratios(specs) is None  # no ratio anywhere: rows drawn uniformly
    check_prompt_dataset(ds)


def test_prompt_source_strings_parquet_and_ratios(tmp_path):
    from marble_trl.data.sources import PromptSource, load_prompt_sources, mixture_ratios

    Dataset.from_dict({"prompt": ["p1", "p2", "p3"], "n": [1, 2, 3]}).to_parquet(str(tmp_path / "set.parquet"))
    (tmp_path / "b.txt").write_text("q1\n", encoding="utf-8")
    specs = [f"{tmp_path / 'set.parquet'}=3", f"{tmp_path / 'b.txt'}=1"]
    assert PromptSource.from_spec(specs[0]).ratio == 3.0
    assert mixture_ratios(specs) == {"set": 0.75, "b": 0.25}
    ds = load_prompt_sources(specs)
    assert ds["n"] == [1, 2, 3, None] and ds["source"] == ["set", "set", "set", "b"]
    one = load_prompt_sources(str(tmp_path / "set.parquet"))  # one source: no source column
    assert one.column_names == ["prompt", "n"]
    picked = load_prompt_sources({"path": str(tmp_path / "set.parquet"), "columns": [], "max_prompts": 2})
    assert picked.column_names == ["prompt"] and len(picked) == 2


def test_missing_source_file_names_the_source_and_path(tmp_path):
    from marble_trl.data.sources import load_prompt_sources

    with pytest.raises(FileNotFoundError, match=r"'ocr'.*nope\.jsonl"):
        load_prompt_sources({"path": str(tmp_path / "nope.jsonl"), "name": "ocr"})
    with pytest.raises(FileNotFoundError, match="nope"):
        load_prompt_sources(str(tmp_path / "nope.txt"))
    with pytest.raises(FileNotFoundError, match="neither"):
        load_prompt_sources(str(tmp_path / "folder" / "data"))


def test_source_without_prompt_column_says_how_to_fix(tmp_path):
    from marble_trl.data.sources import load_prompt_sources

    write_sources(tmp_path)
    with pytest.raises(ValueError) as info:
        load_prompt_sources({"path": str(tmp_path / "ocr.jsonl"), "name": "ocr"})
    message = str(info.value)
    assert "'ocr'" in message and "'prompt'" in message and "caption" in message and "prompt_column" in message


@pytest.mark.parametrize(
    "ratios,match",
    [([0, 0], "positive"), ([1, None], "every source"), ([-1, 2], ">= 0"), (["x", 1], "number")],
)
def test_bad_ratios_are_rejected(tmp_path, ratios, match):
    from marble_trl.data.sources import load_prompt_sources

    write_sources(tmp_path)
    specs = [
        {"path": str(tmp_path / "plain.txt"), "ratio": ratios[0]},
        {"path": str(tmp_path / "geneval.csv"), "ratio": ratios[1]},
    ]
    with pytest.raises(ValueError, match=match):
        load_prompt_sources(specs)


def test_bad_source_specs(tmp_path):
    from marble_trl.data.sources import load_prompt_sources

    write_sources(tmp_path)
    with pytest.raises(ValueError, match="distinct 'name'"):
        load_prompt_sources([str(tmp_path / "plain.txt"), str(tmp_path / "plain.txt")])
    with pytest.raises(ValueError, match="unknown keys"):
        load_prompt_sources({"path": str(tmp_path / "plain.txt"), "fraction": 0.5})
    with pytest.raises(ValueError, match="'columns' names"):
        load_prompt_sources({"path": str(tmp_path / "geneval.csv"), "columns": ["nope"]})
    Dataset.from_dict({"prompt": ["a"], "source": ["web"]}).to_json(str(tmp_path / "has_source.jsonl"))
    with pytest.raises(ValueError, match="already has a 'source' column"):
        load_prompt_sources([str(tmp_path / "plain.txt"), str(tmp_path / "has_source.jsonl")])
    Dataset.from_dict({"prompt": ["a"], "tag": [3]}).to_json(str(tmp_path / "int_tag.jsonl"))
    with pytest.raises(ValueError, match="Column 'tag'"):
        load_prompt_sources([str(tmp_path / "geneval.csv"), str(tmp_path / "int_tag.jsonl")])


def test_script_arguments_take_a_mixture(tmp_path):
    from marble_trl.cli import MarbleScriptArguments
    from marble_trl.data.sources import PromptSource

    write_sources(tmp_path)
    script = MarbleScriptArguments(dataset_mixture=[f"{tmp_path / 'plain.txt'}=1", {"path": "bundled", "ratio": 2}])
    assert [s.name for s in script.dataset_mixture] == ["plain", "bundled"]
    assert isinstance(script.dataset_mixture[0], PromptSource)
    with pytest.raises(ValueError, match="drop dataset_name"):
        MarbleScriptArguments(dataset_name="x.txt", dataset_mixture=["bundled"])
    with pytest.raises(ValueError, match="every source"):
        MarbleScriptArguments(dataset_mixture=[{"path": "bundled", "ratio": 1}, str(tmp_path / "plain.txt")])


# ---------------------------------------------------------------- the trainer on a mixture


def tiny_args(output_dir, **overrides):
    """tests/tiny.py's fastest config, 4 prompts per step, the default LoRA targets."""
    from tiny import tiny_args as fast_args

    from marble_trl.models import DEFAULT_LORA_TARGETS

    return fast_args(
        output_dir, **{"max_steps": 2, "prompts_per_step": 4, "lora_target_modules": DEFAULT_LORA_TARGETS, **overrides}
    )


def test_trainer_mixture_columns_reach_rewards_groups_stay_in_one_source(tmp_path):
    from marble_trl import MarbleDiffusionNFTTrainer
    from marble_trl.data.sources import load_prompt_sources

    write_sources(tmp_path)
    specs = [
        {"path": str(tmp_path / "plain.txt"), "ratio": 0.5},
        {"path": str(tmp_path / "ocr.jsonl"), "prompt_column": "caption", "name": "ocr", "ratio": 0.5},
    ]
    dataset = load_prompt_sources(specs)
    calls = []

    def ocr_like(prompts, images, text, source, **_):
        calls.append((list(prompts), list(text), list(source)))
        return [None if t is None else 1.0 + float(images[i].mean()) for i, t in enumerate(text)]

    def bright(prompts, images, **_):
        return images.float().mean(dim=(1, 2, 3)).tolist()

    args = tiny_args(tmp_path / "out", source_ratios={"plain": 0.5, "ocr": 0.5}, max_steps=1)
    trainer = MarbleDiffusionNFTTrainer("tiny", [bright, ocr_like], args=args, train_dataset=dataset)
    trainer.train()
    by_prompt = {r["prompt"]: r for r in dataset.to_list()}
    for prompts, texts, sources in calls:
        for prompt, text, source in zip(prompts, texts, sources):
            assert text == by_prompt[prompt]["text"] and source == by_prompt[prompt]["source"]
        for g in range(0, len(prompts), 2):  # num_generations = 2: a group is one prompt, one source
            assert prompts[g] == prompts[g + 1] and sources[g] == sources[g + 1]
        assert sorted(sources).count("ocr") == 4  # ratio 0.5 of 4 prompts x 2 images, every step
    logs = [r for r in trainer.state.log_history if "loss" in r]
    assert all("rewards/bright/plain/mean" in r and "rewards/bright/ocr/mean" in r for r in logs)
    assert all("rewards/ocr_like/ocr/mean" in r and "rewards/ocr_like/plain/mean" not in r for r in logs)
    assert all(r["rewards/ocr_like/ocr/mean"] == pytest.approx(r["rewards/ocr_like/mean"]) for r in logs)


def test_trainer_rejects_inconsistent_source_ratios(tmp_path):
    from marble_trl import MarbleDiffusionNFTTrainer

    ds = Dataset.from_dict({"prompt": ["a", "b", "c", "d"], "source": ["x", "x", "y", "y"]})
    plain = Dataset.from_dict({"prompt": ["a", "b", "c", "d"]})
    cases = [
        (plain, {"x": 1.0}, "no 'source' column"),
        (ds, {"x": 1.0}, r"no ratio for the source\(s\) \['y'\]"),
        (ds, {"x": 1.0, "y": 1.0, "z": 1.0}, r"source\(s\) \['z'\] that have no row"),
    ]
    for dataset, ratios, match in cases:
        with pytest.raises(ValueError, match=match):
            MarbleDiffusionNFTTrainer(
                "tiny", "brightness", args=tiny_args(tmp_path, source_ratios=ratios), train_dataset=dataset
            )
