"""TRL GRPO's reward conventions: bool ``scale_rewards``, the ``trainer_state`` / ``log_extra`` / ``log_metric``
kwargs, async rewards run concurrently, and reward signatures checked at construction (docs/coming-from-grpo.md)."""

from __future__ import annotations

import asyncio
import functools
import math
import threading
import time

import pytest
import torch
from datasets import Dataset
from tiny import brightness
from tiny import trainer_args as trainer_tiny_args

from marble_trl import MarbleDiffusionNFTConfig, MarbleDiffusionNFTTrainer
from marble_trl.rewards import (
    TRAINER_KWARGS,
    RewardError,
    RewardLogs,
    accepted_trainer_kwargs,
    check_reward_funcs,
    check_reward_signature,
    dataset_columns,
    get_reward,
    is_async_reward,
    reward_name,
    score_rewards,
)

PROMPTS = ["a cat", "a dog"]
IMAGES = torch.zeros(2, 3, 4, 4)


def tiny_args(tmp_path, **overrides) -> MarbleDiffusionNFTConfig:
    """test_trainer's fast tiny config with 2 sampler steps (these tests check rewards, not images)."""
    return trainer_tiny_args(tmp_path, **{"num_sample_steps": 2, **overrides})


def dataset() -> Dataset:
    return Dataset.from_dict({"prompt": ["a red square", "a blue circle"], "level": [1, 2]})


# ---------------------------------------------------------------------------------------------------------------------
# scale_rewards: GRPOConfig's True / False


@pytest.mark.parametrize(
    "value,expected", [(True, "group"), (False, "none"), ("true", "group"), ("False", "none"), ("batch", "batch")]
)
def test_scale_rewards_bools_map_as_in_grpo(tmp_path, value, expected):
    assert tiny_args(tmp_path, scale_rewards=value).scale_rewards == expected


def test_scale_rewards_bools_from_cli_and_yaml(tmp_path):
    from trl import TrlParser

    parser = TrlParser((MarbleDiffusionNFTConfig,))
    base = ["--output_dir", str(tmp_path), "--prompts_per_step", "1"]
    for flag, expected in (("true", "group"), ("false", "none"), ("True", "group"), ("none", "none")):
        (cfg,) = parser.parse_args_and_config(args=[*base, "--scale_rewards", flag])
        assert cfg.scale_rewards == expected, flag
    config = tmp_path / "c.yaml"
    for yaml_value, expected in (("false", "none"), ("true", "group")):
        config.write_text(f"output_dir: {tmp_path}\nprompts_per_step: 1\nscale_rewards: {yaml_value}\n")
        (cfg,) = parser.parse_args_and_config(args=["--config", str(config)])
        assert cfg.scale_rewards == expected


def test_scale_rewards_other_values_still_fail(tmp_path):
    with pytest.raises(ValueError, match="scale_rewards must be one of"):
        tiny_args(tmp_path, scale_rewards="yes")


# ---------------------------------------------------------------------------------------------------------------------
# trainer_state / log_extra / log_metric


def test_trainer_kwargs_reach_rewards_that_accept_them():
    seen: dict[str, dict] = {}

    def with_kwargs(prompts, images, **kwargs):
        seen["with_kwargs"] = kwargs
        return [0.0] * len(prompts)

    def named(prompts, images, level, trainer_state, log_metric):
        seen["named"] = {"level": level, "trainer_state": trainer_state, "log_metric": log_metric}
        return [0.0] * len(prompts)

    def keyword_only(prompts, images, *, log_extra=None, **columns):
        seen["keyword_only"] = {"log_extra": log_extra, **columns}
        return [0.0] * len(prompts)

    def columns_only(prompts, images, level):  # an existing reward without **kwargs: gets only the columns
        seen["columns_only"] = {"level": level}
        return [0.0] * len(prompts)

    state = object()
    score_rewards(
        [with_kwargs, named, keyword_only, columns_only],
        PROMPTS,
        IMAGES,
        {"level": [1, 2]},
        trainer_state=state,
        logs=RewardLogs(),
    )
    assert set(seen["with_kwargs"]) == {"level", *TRAINER_KWARGS} and seen["with_kwargs"]["trainer_state"] is state
    assert callable(seen["with_kwargs"]["log_extra"]) and callable(seen["with_kwargs"]["log_metric"])
    assert seen["named"]["trainer_state"] is state and callable(seen["named"]["log_metric"])
    assert callable(seen["keyword_only"]["log_extra"]) and set(seen["keyword_only"]) == set(TRAINER_KWARGS) | {"level"}
    assert seen["columns_only"] == {"level": [1, 2]}
    assert dataset_columns(seen["with_kwargs"]) == {"level": [1, 2]}


def test_direct_score_rewards_calls_pass_only_columns():
    seen = {}

    def fn(prompts, images, **columns):
        seen.update(columns)
        return [0.0] * len(prompts)

    score_rewards([fn], PROMPTS, IMAGES, {"level": [1, 2]})
    assert seen == {"level": [1, 2]}


def test_accepted_trainer_kwargs():
    assert accepted_trainer_kwargs(lambda prompts, images, **kw: None) == TRAINER_KWARGS
    assert accepted_trainer_kwargs(lambda prompts, images, trainer_state: None) == ("trainer_state",)
    assert accepted_trainer_kwargs(lambda prompts, images: None) == ()


def test_log_metric_and_log_extra_collect_and_validate():
    def logger(prompts, images, log_metric, log_extra, **_):
        log_metric("my/metric", 2.0)
        log_metric("my/metric", torch.tensor(4.0))
        log_extra("answer", ["x", "y"])
        log_extra("score", torch.tensor([1.0, 3.0]))
        return [0.0] * len(prompts)

    logs = RewardLogs()
    score_rewards([logger], PROMPTS, IMAGES, logs=logs)
    assert logs.metrics == {"my/metric": [2.0, 4.0]}
    assert logs.extras == {"answer": ["x", "y"], "score": [1.0, 3.0]}

    def bad_value(prompts, images, log_metric, **_):
        log_metric("m", "high")
        return [0.0] * len(prompts)

    def bad_length(prompts, images, log_extra, **_):
        log_extra("answer", ["only one"])
        return [0.0] * len(prompts)

    with pytest.raises(RewardError, match=r"'bad_value' called log_metric\('m', 'high'\)"):
        score_rewards([bad_value], PROMPTS, IMAGES, logs=RewardLogs())
    with pytest.raises(RewardError, match=r"'bad_length' called log_extra\('answer', \.\.\.\) with 1 values for 2"):
        score_rewards([bad_length], PROMPTS, IMAGES, logs=RewardLogs())


# ---------------------------------------------------------------------------------------------------------------------
# async rewards


def _sleeper(name: str, spans: dict[str, tuple[float, float]], seconds: float = 0.5, value: float = 1.0):
    async def fn(prompts, images, **_):
        start = time.monotonic()
        await asyncio.sleep(seconds)
        spans[name] = (start, time.monotonic())
        return [value] * len(prompts)

    fn.__name__ = name
    return fn


def _overlap(a: tuple[float, float], b: tuple[float, float]) -> float:
    return min(a[1], b[1]) - max(a[0], b[0])


def test_async_rewards_run_concurrently():
    spans: dict[str, tuple[float, float]] = {}
    timings: dict[str, float] = {}

    def sync(prompts, images, **_):
        return [0.5] * len(prompts)

    out = score_rewards(
        [_sleeper("a", spans, value=1.0), sync, _sleeper("b", spans, value=2.0)], PROMPTS, IMAGES, timings=timings
    )
    assert out.tolist() == [[1.0, 1.0], [0.5, 0.5], [2.0, 2.0]]  # rows in reward order, whatever finished first
    # Run one after the other they would not overlap at all; concurrently, ~0.5 s (generous slack for a loaded CPU).
    assert _overlap(spans["a"], spans["b"]) > 0.25, spans
    assert set(timings) == {"a", "sync", "b"} and timings["a"] >= 0.45


def test_async_rewards_inside_a_running_event_loop():
    spans: dict[str, tuple[float, float]] = {}

    async def caller():  # e.g. a notebook, whose thread already runs a loop: asyncio.run() would fail there
        return score_rewards([_sleeper("a", spans, 0.05), _sleeper("b", spans, 0.05)], PROMPTS, IMAGES)

    out = asyncio.run(caller())
    assert out.tolist() == [[1.0, 1.0], [1.0, 1.0]]


def test_async_callable_class_and_partial():
    class AsyncScorer:
        __name__ = "async_scorer"

        async def __call__(self, prompts, images, scale=1.0, **_):
            await asyncio.sleep(0)
            return [scale] * len(prompts)

    async def scaled(prompts, images, scale, **_):
        return [scale] * len(prompts)

    part = functools.partial(scaled, scale=3.0)
    assert is_async_reward(AsyncScorer()) and is_async_reward(part) and not is_async_reward(brightness)
    assert reward_name(part) == "scaled"
    out = score_rewards([AsyncScorer(), part], PROMPTS, IMAGES)
    assert out.tolist() == [[1.0, 1.0], [3.0, 3.0]]


def test_async_reward_errors_name_the_reward():
    async def broken(prompts, images, **_):
        raise ValueError("server down")

    async def short(prompts, images, **_):
        return [1.0]

    with pytest.raises(RewardError, match=r"'broken' raised ValueError: server down"):
        score_rewards([broken], PROMPTS, IMAGES)
    with pytest.raises(RewardError, match=r"'short' returned 1 values for 2 samples"):
        score_rewards([short], PROMPTS, IMAGES)


def test_async_rewards_run_on_one_daemon_loop_thread():
    threads = []

    async def where(prompts, images, **_):
        threads.append(threading.current_thread())
        return [0.0] * len(prompts)

    score_rewards([where], PROMPTS, IMAGES)
    score_rewards([where], PROMPTS, IMAGES)
    assert threads[0] is threads[1] and threads[0].daemon and threads[0] is not threading.current_thread()


# ---------------------------------------------------------------------------------------------------------------------
# signatures checked at construction


def test_check_reward_signature_accepts_the_contract_and_builtins():
    for fn in (brightness, get_reward("brightness"), get_reward("jpeg_compressibility")):
        check_reward_signature(fn, columns=["prompt", "level"])
    check_reward_signature(lambda prompts, images, level: None, "uses_level", columns=["prompt", "level"])
    check_reward_signature(lambda prompts, images, level: None, "unknown_columns", columns=None)


@pytest.mark.parametrize(
    "fn,match",
    [
        (lambda completions, **kw: None, "unexpected keyword argument 'prompts'|missing a required argument"),
        (lambda prompts, images: None, "unexpected keyword argument 'level'"),
        (lambda prompts, images, text, **kw: None, "missing a required argument: 'text'"),
        (lambda p, i, **kw: None, "missing a required argument"),
    ],
)
def test_check_reward_signature_names_the_reward(fn, match):
    with pytest.raises(TypeError, match=rf"Reward 'mine' cannot be called as the trainer calls it \(.*({match})"):
        check_reward_signature(fn, "mine", columns=["prompt", "level"])


def test_a_class_is_not_a_reward_and_dotted_classes_are_built():
    class Scorer:
        def __call__(self, prompts, images, **_):
            return [0.0] * len(prompts)

    with pytest.raises(TypeError, match="is a class"):
        check_reward_signature(Scorer, "Scorer")
    check_reward_signature(Scorer(), "Scorer")
    assert not isinstance(get_reward("test_grpo_conventions:_DottedScorer"), type)


class _DottedScorer:
    def __call__(self, prompts, images, **_):
        return [0.0] * len(prompts)


def test_reserved_column_names_are_refused():
    with pytest.raises(ValueError, match=r"column\(s\) \['trainer_state'\]"):
        check_reward_funcs([brightness], columns=["prompt", "trainer_state"])


def test_wrong_signature_fails_at_construction_not_at_the_first_rollout(tmp_path, monkeypatch):
    import marble_trl.trainer.trainer as nft_trainer

    def completions_reward(completions, **kwargs):  # a text GRPO reward
        return [0.0] * len(completions)

    def no_load(*args, **kwargs):
        raise AssertionError("the model was loaded before the reward was checked")

    monkeypatch.setattr(nft_trainer, "load_model", no_load)
    with pytest.raises(TypeError, match="Reward 'completions_reward' cannot be called"):
        MarbleDiffusionNFTTrainer(
            "tiny", [brightness, completions_reward], args=tiny_args(tmp_path), train_dataset=dataset()
        )

    def needs_text(prompts, images, text):  # the dataset has no "text" column
        return [0.0] * len(prompts)

    with pytest.raises(TypeError, match=r"Reward 'needs_text'.*missing a required argument: 'text'"):
        MarbleDiffusionNFTTrainer("tiny", needs_text, args=tiny_args(tmp_path), train_dataset=dataset())


def test_wrong_signature_of_a_dotted_reward_fails_at_construction(tmp_path):
    with pytest.raises(TypeError, match="Reward 'getcwd' cannot be called"):
        MarbleDiffusionNFTTrainer("tiny", "os.getcwd", args=tiny_args(tmp_path), train_dataset=dataset())


# ---------------------------------------------------------------------------------------------------------------------
# The real trainer on the tiny model


def test_trainer_passes_grpo_kwargs_and_runs_async_rewards_concurrently(tmp_path):
    steps_seen: list[int] = []
    spans: dict[str, list[tuple[float, float]]] = {"slow_a": [], "slow_b": []}

    def scheduled(prompts, images, trainer_state, log_metric, log_extra, **columns):
        steps_seen.append(trainer_state.global_step)
        values = images.float().mean(dim=(1, 2, 3))
        log_metric("my/metric", 10.0 + trainer_state.global_step)
        log_extra("level_seen", [float(v) for v in columns["level"]])
        log_extra("note", [f"step {trainer_state.global_step}"] * len(prompts))
        return values.tolist()

    def slow(name):
        async def fn(prompts, images, **_):
            start = time.monotonic()
            await asyncio.sleep(0.5)
            spans[name].append((start, time.monotonic()))
            return images.float().std(dim=(1, 2, 3)).tolist()

        fn.__name__ = name
        return fn

    args = tiny_args(tmp_path, multi_objective_aggregation="sum_then_normalize")
    trainer = MarbleDiffusionNFTTrainer(
        "tiny", [scheduled, slow("slow_a"), slow("slow_b")], args=args, train_dataset=dataset()
    )
    trainer.train()

    assert steps_seen == [0, 1]  # the optimizer step being trained, as GRPO's trainer_state.global_step
    logged = [entry for entry in trainer.state.log_history if "my/metric" in entry]
    assert [entry["my/metric"] for entry in logged] == [10.0, 11.0]
    assert all(math.isclose(entry["extra/level_seen"], 1.5) for entry in logged)  # 8 of level 1, 8 of level 2
    assert all("extra/note" not in entry for entry in logged)  # strings are not averaged...
    assert trainer.reward_extras["note"] == ["step 1"] * 16  # ...but kept per sample for the last step
    assert all(f"rewards/{name}/mean" in logged[0] for name in ("scheduled", "slow_a", "slow_b"))
    for a, b in zip(spans["slow_a"], spans["slow_b"]):
        assert _overlap(a, b) > 0.25, spans  # concurrent: sequential runs would not overlap at all
