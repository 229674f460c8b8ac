"""Fault injection on the inputs (issue 13, item 6 and "Input checks at load"): each test feeds the input that used
to be accepted silently or to fail with an error naming nothing, and asserts the error (type and message) now raised.

- a reward returning a dict / set / string (a dict used to train on its keys);
- a reward value beyond float32 (``1e39`` failed with torch's "cannot be converted to type float without overflow",
  naming no reward) and a NaN value (used to be taken as "not applicable");
- ``lora_alpha 0`` / all-zero ``reward_weights`` (trained with grad_norm 0.0, no warning), ``max_steps 0`` (trained one
  step);
- null / numeric / empty prompts (crashed mid-run naming no row);
- empty prompt files (``.jsonl``: a bare ``StopIteration``).
"""

from __future__ import annotations

import json
import logging
import math

import numpy as np
import pytest
import torch
from datasets import Dataset
from tiny import brightness, tiny_args
from transformers import HfArgumentParser

from marble_trl import MarbleDiffusionNFTConfig, MarbleDiffusionNFTTrainer
from marble_trl.data.prompts import check_prompt_dataset
from marble_trl.data.sources import PromptSource, load_prompt_sources, load_source
from marble_trl.rewards import RewardError, score_rewards

PROMPTS = ["a cat", "a dog", "a bird"]
FLOAT32_MAX = torch.finfo(torch.float32).max


@pytest.fixture
def images() -> torch.Tensor:
    torch.manual_seed(0)
    return torch.rand(3, 3, 8, 8)


def returning(value: object, name: str = "scorer"):
    def fn(prompts: list[str], images: torch.Tensor, **_: object) -> object:
        return value(len(prompts)) if callable(value) else value

    fn.__name__ = name
    return fn


# ---------------------------------------------------------------- rewards: the shape of the return value


def test_dict_return_is_rejected_not_trained_on_its_keys(images: torch.Tensor) -> None:
    # Three numeric keys for three samples: list() of it is [0, 1, 2], which used to be trained on as the scores.
    fn = returning({0: 0.9, 1: 0.1, 2: 0.5}, name="multi_score")
    with pytest.raises(RewardError, match=r"'multi_score' returned a mapping \(dict\).*one float.*per sample") as info:
        score_rewards([fn], PROMPTS, images)
    assert "one reward per score" in str(info.value)  # the fix


@pytest.mark.parametrize(
    "value,kind",
    [({"a": 1.0, "b": 2.0, "c": 3.0}, "mapping"), ({0.1, 0.2, 0.3}, "set"), (frozenset({1.0, 2.0, 3.0}), "frozenset"),
     ("abc", "str"), (b"abc", "bytes")],
    ids=["dict", "set", "frozenset", "str", "bytes"],
)  # fmt: skip
def test_mapping_set_and_string_returns_are_rejected(images: torch.Tensor, value: object, kind: str) -> None:
    with pytest.raises(RewardError, match=rf"'odd' returned a {kind}.*list with one float"):
        score_rewards([returning(value, name="odd")], PROMPTS, images)


@pytest.mark.parametrize(
    "value",
    [[0.1, 0.2, 0.3], (0.1, 0.2, 0.3), torch.tensor([0.1, 0.2, 0.3]), np.array([0.1, 0.2, 0.3])],
    ids=["list", "tuple", "tensor", "ndarray"],
)
def test_sequences_are_still_accepted(images: torch.Tensor, value: object) -> None:
    out = score_rewards([returning(value)], PROMPTS, images)
    assert torch.allclose(out[0], torch.tensor([0.1, 0.2, 0.3]))


# ---------------------------------------------------------------- rewards: values beyond float32, NaN, None


@pytest.mark.parametrize(
    "big", [1e39, -1e39, np.float64(1e39), torch.tensor(1e39, dtype=torch.float64), 1e300], ids=str
)
def test_value_overflowing_float32_names_the_reward_and_sample(images: torch.Tensor, big: object) -> None:
    fn = returning([0.5, big, 0.5], name="huge")
    with pytest.raises(RewardError, match=r"'huge' returned .* for sample 1 \(prompt 'a dog'\).*float32") as info:
        score_rewards([fn], PROMPTS, images)
    assert "without overflow" not in str(info.value)  # torch's error, naming no reward, is gone
    assert not isinstance(info.value.__cause__, RuntimeError)


def test_float32_max_itself_is_accepted(images: torch.Tensor) -> None:
    out = score_rewards([returning([FLOAT32_MAX, -FLOAT32_MAX, 0.0])], PROMPTS, images)
    assert out[0, 0].item() == FLOAT32_MAX and out[0, 1].item() == -FLOAT32_MAX


@pytest.mark.parametrize("bad", [math.inf, -math.inf], ids=str)
def test_infinite_value_names_the_reward_and_sample(images: torch.Tensor, bad: float) -> None:
    with pytest.raises(RewardError, match=r"'inf_reward' returned -?inf for sample 2 \(prompt 'a bird'\); .*finite"):
        score_rewards([returning([0.0, 0.0, bad], name="inf_reward")], PROMPTS, images)


@pytest.mark.parametrize(
    "nan", [float("nan"), np.float32("nan"), torch.tensor(float("nan"))], ids=["float", "numpy", "tensor"]
)
def test_nan_value_is_an_error_not_not_applicable(images: torch.Tensor, nan: object) -> None:
    with pytest.raises(RewardError, match=r"'aesthetic' returned NaN for sample 0 \(prompt 'a cat'\)") as info:
        score_rewards([returning([nan, 0.5, None], name="aesthetic")], PROMPTS, images)
    assert "return None" in str(info.value)  # how to say "not applicable"


def test_nan_images_give_an_error_naming_the_reward(images: torch.Tensor) -> None:
    """A diverged model decodes NaN images; a reward computed from them returns NaN, which must stop the run."""
    images = images.clone()
    images[1] = float("nan")
    with pytest.raises(RewardError, match=r"'brightness' returned NaN for sample 1.*NaN images"):
        score_rewards([brightness], PROMPTS, images)


def test_none_is_still_not_applicable(images: torch.Tensor) -> None:
    out = score_rewards([returning([None, 0.25, None]), returning([0.5, None, 1.0], name="other")], PROMPTS, images)
    assert math.isnan(out[0, 0]) and math.isnan(out[0, 2]) and out[0, 1].item() == 0.25
    assert math.isnan(out[1, 1]) and out[1, 0].item() == 0.5 and out[1, 2].item() == 1.0


def test_overflow_in_the_trainer_names_the_reward(tmp_path) -> None:
    """End to end: the tiny trainer's first step stops with the reward's name (was torch's bare RuntimeError)."""

    def huge(prompts, images, **_):
        return [1e39] * len(prompts)

    ds = Dataset.from_dict({"prompt": ["red", "blue"]})
    trainer = MarbleDiffusionNFTTrainer("tiny", huge, args=tiny_args(tmp_path), train_dataset=ds)
    with pytest.raises(RewardError, match=r"'huge' returned 1e\+39 for sample 0 .*float32"):
        trainer.train()
    assert trainer.state.global_step == 0


# ---------------------------------------------------------------- config: settings that train nothing


@pytest.fixture
def make(tmp_path):
    def _make(**overrides):
        kwargs = dict(output_dir=str(tmp_path), report_to="none", num_generations=4, per_device_train_batch_size=4)
        kwargs.update(overrides)
        return MarbleDiffusionNFTConfig(**kwargs)

    return _make


def test_lora_alpha_zero_is_an_error(make) -> None:
    with pytest.raises(ValueError, match=r"lora_alpha must not be 0.*never changes the model.*grad_norm 0"):
        make(lora_alpha=0)
    assert make(lora_alpha=1).lora_alpha == 1


def test_max_steps_zero_is_an_error(make) -> None:
    with pytest.raises(ValueError, match=r"max_steps must not be 0.*one optimizer step.*-1.*num_train_epochs"):
        make(max_steps=0)
    assert make(max_steps=-1).max_steps == -1  # the default: num_train_epochs decides
    assert make(max_steps=1).max_steps == 1


def test_max_steps_zero_on_the_command_line_is_an_error(tmp_path) -> None:
    parser = HfArgumentParser(MarbleDiffusionNFTConfig)
    argv = ["--output_dir", str(tmp_path), "--report_to", "none", "--num_generations", "4"]
    argv += ["--per_device_train_batch_size", "4", "--max_steps", "0"]
    with pytest.raises(ValueError, match="max_steps must not be 0"):
        parser.parse_args_into_dataclasses(argv)


@pytest.mark.parametrize("aggregation", ["sum_then_normalize", "normalize_then_sum"])
def test_all_zero_weights_are_an_error_for_weighted_sums(make, aggregation: str) -> None:
    with pytest.raises(ValueError, match=r"reward_weights are all 0.*every advantage would be 0") as info:
        make(reward_weights=[0.0, 0.0], multi_objective_aggregation=aggregation)
    message = str(info.value)
    assert aggregation in message and "sum_then_normalize and normalize_then_sum" in message  # which use weights


@pytest.mark.parametrize("aggregation", ["auto", "marble", "sum_then_normalize", "normalize_then_sum"])
def test_one_zero_weight_is_an_error_whatever_the_aggregation(make, aggregation: str) -> None:
    # One reward is always plain DiffusionNFT (a weighted sum): a weight of 0 zeroes every advantage.
    with pytest.raises(ValueError, match=r"reward_weights are all 0.*single-reward"):
        make(reward_weights=[0.0], multi_objective_aggregation=aggregation)


@pytest.mark.parametrize("aggregation", ["auto", "marble"])
def test_all_zero_weights_warn_with_marble(make, caplog, aggregation: str) -> None:
    with caplog.at_level(logging.WARNING, logger="marble_trl.nft_config"):
        cfg = make(reward_weights=[0.0, 0.0], multi_objective_aggregation=aggregation)
    assert cfg.reward_weights == [0.0, 0.0]
    warned = [r.getMessage() for r in caplog.records if r.name == "marble_trl.nft_config"]
    assert len(warned) == 1 and "reward_weights are all 0" in warned[0] and "logged reward" in warned[0]


def test_some_zero_weights_are_fine(make, caplog) -> None:
    with caplog.at_level(logging.WARNING, logger="marble_trl.nft_config"):
        make(reward_weights=[0.0, 1.0], multi_objective_aggregation="sum_then_normalize")
        make(reward_weights=[0.0, 1.0])
    assert not [r for r in caplog.records if r.name == "marble_trl.nft_config"]


# ---------------------------------------------------------------- prompts checked at load


BAD_PROMPTS = [None, 3, 2.5, "", "   ", ["a", "list"]]


@pytest.mark.parametrize("bad", BAD_PROMPTS, ids=repr)
def test_bad_prompt_names_its_row_and_column(bad: object) -> None:
    if bad is None or isinstance(bad, str):
        ds, row = Dataset.from_dict({"prompt": ["a cat", "a dog", bad]}), 2
    else:  # an Arrow column has one type: a numeric or list column is bad from row 0
        ds, row = Dataset.from_dict({"prompt": [bad, bad]}), 0
    with pytest.raises(ValueError) as info:
        check_prompt_dataset(ds)
    message = str(info.value)
    assert message.startswith("train_dataset: every prompt must be a non-empty string")
    assert "of column 'prompt'" in message and f"row {row} holds {bad!r}" in message


def test_bad_prompt_message_counts_rows_and_names_the_source() -> None:
    ds = Dataset.from_dict(
        {"prompt": ["a", None, "b", "", None, " ", None], "source": ["x", "y", "x", "y", "x", "y", "x"]}
    )
    with pytest.raises(ValueError) as info:
        check_prompt_dataset(ds)
    message = str(info.value)
    assert "5 row(s) of column 'prompt'" in message
    assert "row 1 holds None (source 'y')" in message and "row 3 holds '' (source 'y')" in message
    assert "and 2 more" in message


def test_selection_is_checked_in_its_own_order() -> None:
    ds = Dataset.from_dict({"prompt": ["a", None, "b", "c"]})
    check_prompt_dataset(ds.select([0, 2, 3]))  # the bad row is not selected: fine
    with pytest.raises(ValueError, match="row 2 holds None"):
        check_prompt_dataset(ds.select([3, 0, 1]))


def test_trainer_rejects_bad_prompts_before_loading_the_model(tmp_path) -> None:
    with pytest.raises(ValueError, match=r"train_dataset: every prompt .*row 1 holds None"):
        MarbleDiffusionNFTTrainer(
            "tiny", brightness, args=tiny_args(tmp_path), train_dataset=Dataset.from_dict({"prompt": ["a", None]})
        )
    with pytest.raises(ValueError, match=r"eval_dataset: every prompt .*row 0 holds 7 \(int\)"):
        MarbleDiffusionNFTTrainer(
            "tiny",
            brightness,
            args=tiny_args(tmp_path),
            train_dataset=Dataset.from_dict({"prompt": ["a", "b"]}),
            eval_dataset=Dataset.from_dict({"prompt": [7]}),
        )


def write_jsonl(path, rows) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return str(path)


def test_jsonl_null_and_numeric_prompts_name_file_row_and_column(tmp_path) -> None:
    file = write_jsonl(tmp_path / "prompts.jsonl", [{"prompt": "a cat"}, {"prompt": None}, {"prompt": 3}])
    with pytest.raises(ValueError) as info:
        load_source(file)
    message = str(info.value)
    assert "prompt source 'prompts'" in message and file in message
    assert "column 'prompt'" in message and "row 1 holds None" in message and "row 2 holds 3 (int)" in message


def test_renamed_prompt_column_is_named_as_in_the_file(tmp_path) -> None:
    file = write_jsonl(tmp_path / "caps.jsonl", [{"caption": "a cat"}, {"caption": None}])
    with pytest.raises(ValueError, match=r"column 'caption' \(prompt_column, renamed 'prompt'\).*row 1 holds None"):
        load_source(PromptSource(path=file, prompt_column="caption"))


def test_csv_empty_cell_is_a_bad_prompt(tmp_path) -> None:
    file = tmp_path / "p.csv"
    file.write_text("prompt,tag\na cat,x\n,y\n", encoding="utf-8")
    with pytest.raises(ValueError, match=r"p\.csv.*row 1 holds None"):
        load_source(str(file))


def test_mixture_names_the_source_file_with_the_bad_row(tmp_path) -> None:
    good = write_jsonl(tmp_path / "good.jsonl", [{"prompt": "a"}, {"prompt": "b"}])
    bad = write_jsonl(tmp_path / "bad.jsonl", [{"prompt": "c"}, {"prompt": "d"}, {"prompt": None}])
    with pytest.raises(ValueError, match=r"prompt source 'bad' \(.*bad\.jsonl\).*row 2 holds None"):
        load_prompt_sources([good, bad])


# ---------------------------------------------------------------- empty prompt files


def _empty_parquet(path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"prompt": pa.array([], pa.string())}), path)


EMPTY_FILES = {
    "empty.txt": b"",
    "comments.txt": b"# only a comment\n\n",
    "empty.json": b"",
    "list.json": b"[]\n",
    "empty.jsonl": b"",
    "blank.jsonl": b"\n  \n\n",
    "empty.csv": b"",
    "header.csv": b"prompt,tag\n",
    "empty.parquet": b"",
    "rows0.parquet": None,  # a valid Parquet file with a prompt column and no rows
}


@pytest.mark.parametrize("filename", list(EMPTY_FILES))
def test_empty_file_names_the_file(tmp_path, filename: str) -> None:
    file = tmp_path / filename
    content = EMPTY_FILES[filename]
    if content is None:
        _empty_parquet(file)
    else:
        file.write_bytes(content)
    with pytest.raises(ValueError) as info:
        load_source(str(file))
    message = str(info.value)
    assert filename in message
    assert "empty" in message or "no prompt" in message
    with pytest.raises(ValueError, match=filename.replace(".", r"\.")):  # in a mixture too
        load_prompt_sources([str(file), write_jsonl(tmp_path / "ok.jsonl", [{"prompt": "a"}])])


def test_unreadable_file_names_the_file_and_format(tmp_path) -> None:
    file = tmp_path / "broken.jsonl"
    file.write_text("this is not json\n", encoding="utf-8")
    with pytest.raises(ValueError, match=r"'broken'.*could not read .*broken\.jsonl.* as jsonl"):
        load_source(str(file))


@pytest.mark.parametrize("suffix", ["txt", "jsonl", "json", "csv"])
def test_a_prompt_file_that_is_not_utf8_is_named_with_its_line_and_byte(tmp_path, suffix):
    from marble_trl.data.sources import load_source

    body = {
        "txt": b"a red apple\nun caf\xe9 au lait\n",
        "jsonl": b'{"prompt": "a red apple"}\n{"prompt": "un caf\xe9"}\n',
        "json": b'[{"prompt": "a red apple"},\n {"prompt": "un caf\xe9"}]\n',
        "csv": b"prompt\na red apple\nun caf\xe9\n",
    }[suffix]
    path = tmp_path / f"prompts.{suffix}"
    path.write_bytes(body)
    with pytest.raises(ValueError, match=rf"prompts.{suffix}'.*line (2|3), column \d+ is not UTF-8 \(byte 0xe9"):
        load_source(str(path))


def test_a_reward_that_writes_into_the_images_is_named(images: torch.Tensor) -> None:
    def brighten(prompts, images, **_):
        images.mul_(2.0)  # in place: the next reward would score doubled images
        return images.mean(dim=(1, 2, 3)).tolist()

    with pytest.raises(RewardError, match="Reward 'brighten' modified the images it was given in place"):
        score_rewards([brighten, brightness], PROMPTS[: len(images)], images.clone())
    kept = images.clone()
    score_rewards([brightness], PROMPTS[: len(images)], kept)  # reading them is fine
    assert torch.equal(kept, images)


def test_a_reward_returning_a_tensor_of_values_is_read_value_by_value(images: torch.Tensor) -> None:
    def as_tensor(prompts, images, **_):
        return images.mean(dim=(1, 2, 3))  # a [B] tensor (of any device: each value is read with .item())

    out = score_rewards([as_tensor], PROMPTS[: len(images)], images)
    torch.testing.assert_close(out[0], images.mean(dim=(1, 2, 3)))


def test_a_column_changing_type_between_rows_is_warned_about_naming_the_file_and_rows(tmp_path, caplog) -> None:
    """datasets keeps a mixed column as JSON objects (2 then "two"); a GenEval-style column of None and lists is not
    mixed (None: not given)."""
    path = tmp_path / "mixed.jsonl"
    path.write_text(
        '{"prompt": "a cat", "count": 2, "include": null}\n{"prompt": "a dog", "count": "two", "include": [1]}\n'
    )
    with caplog.at_level("WARNING", logger="marble_trl.data.table_files"):
        dataset = load_source(str(path))
    assert dataset["count"] == [2, "two"]
    assert "mixed.jsonl: column 'count' holds values of several types: int (first at row 0), str (first at row 1)" in (
        caplog.text
    )
    assert "'include'" not in caplog.text


def test_an_output_dir_that_is_a_file_is_refused_naming_it(tmp_path) -> None:
    path = tmp_path / "out"
    path.write_text("not a folder")
    with pytest.raises(ValueError, match=f"output_dir '{path}' is a file, not a folder"):
        tiny_args(path)


def test_a_prompt_longer_than_the_encoder_limit_is_logged_once(caplog) -> None:
    """diffusers warns on every truncated encode, i.e. every step; the adapter lets the first one through."""
    from marble_trl.models import load_model

    adapter = load_model("tiny-flux")
    long = "a very long prompt " * 20
    with caplog.at_level("WARNING"):
        for _ in range(3):
            adapter.encode([long], 8, torch.device("cpu"))
    assert caplog.text.count("was truncated because") == 1 and "(logged once per run)" in caplog.text
