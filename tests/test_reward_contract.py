"""The reward contract (score_rewards' validation), the registry, and the pixel/JPEG rewards."""

from __future__ import annotations

import math

import pytest
import torch

from marble_trl.rewards import (
    RewardError,
    available_rewards,
    get_reward,
    register_reward,
    resolve_reward_funcs,
    reward_name,
    score_rewards,
)

PROMPTS = ["a cat", "a dog", "a bird"]


@pytest.fixture
def images() -> torch.Tensor:
    torch.manual_seed(0)
    return torch.rand(3, 3, 16, 16)


def const(value: object, n: int | None = None):
    def fn(prompts: list[str], images: torch.Tensor, **_: object) -> list[object]:
        return [value] * (n if n is not None else len(prompts))

    return fn


# ---------------------------------------------------------------------------------------------------------------------
# score_rewards


def test_scores_stack_to_k_by_b(images: torch.Tensor) -> None:
    def by_index(prompts: list[str], images: torch.Tensor, **_: object) -> list[float]:
        return [float(i) for i in range(len(prompts))]

    out = score_rewards([by_index, const(0.5)], PROMPTS, images)
    assert out.shape == (2, 3) and out.dtype == torch.float32
    assert out[0].tolist() == [0.0, 1.0, 2.0] and out[1].tolist() == [0.5] * 3


def test_columns_reach_the_reward(images: torch.Tensor) -> None:
    seen = {}

    def fn(prompts: list[str], images: torch.Tensor, target: list[str], **rest: object) -> list[float]:
        seen.update(target=target, rest=rest)
        return [1.0] * len(prompts)

    score_rewards([fn], PROMPTS, images, columns={"target": ["x", "y", "z"], "level": [1, 2, 3]})
    assert seen == {"target": ["x", "y", "z"], "rest": {"level": [1, 2, 3]}}


def test_a_reward_that_raises_is_named_with_the_prompt(images: torch.Tensor) -> None:
    def broken(prompts: list[str], images: torch.Tensor, **_: object) -> list[float]:
        raise ValueError("model exploded")

    with pytest.raises(RewardError, match=r"'broken' raised ValueError: model exploded.*'a cat'") as info:
        score_rewards([const(1.0), broken], PROMPTS, images)
    assert isinstance(info.value.__cause__, ValueError)


def test_wrong_length(images: torch.Tensor) -> None:
    with pytest.raises(RewardError, match=r"returned 2 values for 3 samples"):
        score_rewards([const(1.0, n=2)], PROMPTS, images)


def test_not_a_list(images: torch.Tensor) -> None:
    with pytest.raises(RewardError, match=r"returned float"):
        score_rewards([lambda prompts, images, **_: 1.0], PROMPTS, images)


@pytest.mark.parametrize("bad", ["0.5", True, [1.0], {"a": 1}])
def test_non_numeric_values_name_the_reward_and_prompt(images: torch.Tensor, bad: object) -> None:
    fn = const(bad)
    fn.__name__ = "weird"
    with pytest.raises(RewardError, match=r"'weird' returned .*'a cat'.*real numbers or None"):
        score_rewards([fn], PROMPTS, images)


@pytest.mark.parametrize("bad", [math.inf, -math.inf])
def test_infinite_values_are_rejected(images: torch.Tensor, bad: float) -> None:
    with pytest.raises(RewardError, match=r"must be finite"):
        score_rewards([const(bad)], PROMPTS, images)


def test_none_means_not_applicable_and_nan_is_an_error(images: torch.Tensor) -> None:
    def mixed(prompts: list[str], images: torch.Tensor, **_: object) -> list[object]:
        return [None, 0.5, torch.tensor(0.25)]

    out = score_rewards([mixed], PROMPTS, images)
    assert math.isnan(out[0, 0]) and out[0, 1].item() == 0.5 and out[0, 2].item() == 0.25

    def nan(prompts: list[str], images: torch.Tensor, **_: object) -> list[object]:
        return [None, float("nan"), 0.25]

    with pytest.raises(RewardError, match=r"'nan' returned NaN for sample 1 .*return None"):
        score_rewards([nan], PROMPTS, images)


def test_names_override_and_reward_name() -> None:
    class Scorer:
        def __call__(self, prompts: list[str], images: torch.Tensor, **_: object) -> list[float]:
            return [0.0] * len(prompts)

    assert reward_name(Scorer()) == "Scorer"
    named = Scorer()
    named.__name__ = "custom"
    assert reward_name(named) == "custom"
    with pytest.raises(RewardError, match="'explicit'"):
        score_rewards([const(1.0, n=1)], PROMPTS, torch.rand(3, 3, 4, 4), names=["explicit"])


# ---------------------------------------------------------------------------------------------------------------------
# Registry


def test_unknown_name_lists_the_known_rewards() -> None:
    with pytest.raises(ValueError, match=r"Unknown reward 'nope'.*Known rewards:.*brightness.*jpeg_compressibility"):
        get_reward("nope")


def test_registered_plain_reward_rejects_options() -> None:
    assert get_reward("brightness").__name__ == "brightness"
    with pytest.raises(ValueError, match="takes no options"):
        get_reward("brightness", scale=2)


@pytest.mark.parametrize("path", ["marble_trl.rewards.simple.contrast", "marble_trl.rewards.simple:contrast"])
def test_dotted_path_import(path: str) -> None:
    from marble_trl.rewards.simple import contrast

    assert get_reward(path) is contrast


def test_dotted_path_errors() -> None:
    with pytest.raises(ValueError, match="Could not import"):
        get_reward("no_such_package_xyz.fn")
    with pytest.raises(ValueError, match="has no attribute"):
        get_reward("marble_trl.rewards.simple.no_such_fn")


def test_dotted_path_factory_gets_options() -> None:
    fn = get_reward("marble_trl.rewards.http:HTTPReward", url="http://127.0.0.1:9/score", name="remote")
    assert fn.__name__ == "remote"


def test_factory_registration_and_reward_kwargs(images: torch.Tensor) -> None:
    @register_reward("test_contract_scaled", factory=True)
    class Scaled:
        def __init__(self, scale: float = 1.0) -> None:
            self.scale = scale
            self.__name__ = "test_contract_scaled"

        def __call__(self, prompts: list[str], images: torch.Tensor, **_: object) -> list[float]:
            return [self.scale] * len(prompts)

    assert "test_contract_scaled" in available_rewards()
    funcs = resolve_reward_funcs(
        ["test_contract_scaled", "brightness"], reward_kwargs={"test_contract_scaled": {"scale": 3.0}}
    )
    out = score_rewards(funcs, PROMPTS, images)
    assert out[0].tolist() == [3.0] * 3
    with pytest.raises(ValueError, match="not in reward_funcs"):
        resolve_reward_funcs(["brightness"], reward_kwargs={"pickscore": {}})
    with pytest.raises(ValueError, match="already registered"):
        register_reward("test_contract_scaled")(const(1.0))


def test_callables_pass_through() -> None:
    fn = const(1.0)
    assert resolve_reward_funcs(fn) == [fn]
    with pytest.raises(ValueError, match="pass them to it directly"):
        get_reward(fn, scale=2)
    with pytest.raises(TypeError):
        get_reward(42)  # type: ignore[arg-type]


# ---------------------------------------------------------------------------------------------------------------------
# Pixel and JPEG rewards


def test_jpeg_compressibility_ranks_flat_above_noise() -> None:
    torch.manual_seed(0)
    flat = torch.full((1, 3, 64, 64), 0.5)
    noise = torch.rand(1, 3, 64, 64)
    images = torch.cat([flat, noise])
    comp, incomp = score_rewards(
        resolve_reward_funcs(["jpeg_compressibility", "jpeg_incompressibility"]), ["flat", "noise"], images
    )
    assert comp[0] > comp[1] and incomp[1] > incomp[0]
    torch.testing.assert_close(comp, -incomp)
    assert 0 < incomp[0] < incomp[1]  # sizes in kB


def test_pixel_rewards() -> None:
    white, black = torch.ones(1, 3, 8, 8), torch.zeros(1, 3, 8, 8)
    red = torch.zeros(1, 3, 8, 8)
    red[:, 0] = 1.0
    images = torch.cat([white, black, red])
    bright, dark, sat, con = score_rewards(
        resolve_reward_funcs(["brightness", "darkness", "saturation", "contrast"]), ["w", "b", "r"], images
    )
    assert bright.tolist() == pytest.approx([1.0, 0.0, 1 / 3])
    torch.testing.assert_close(dark, 1 - bright)
    assert sat.tolist() == pytest.approx([0.0, 0.0, 1.0])
    assert con.tolist() == pytest.approx([0.0, 0.0, 0.0])


def test_score_rewards_reports_time_per_reward(monkeypatch):
    # A fake clock: on a loaded machine a real one can charge the "fast" reward more than the "slow" one's sleep.
    import types

    from marble_trl.rewards import scoring

    now = [100.0]
    monkeypatch.setattr(scoring, "time", types.SimpleNamespace(perf_counter=lambda: now[0]))

    def slow(prompts, images, **_):
        now[0] += 2.5
        return [1.0] * len(prompts)

    def fast(prompts, images, **_):
        return [0.0] * len(prompts)

    timings: dict[str, float] = {}
    score_rewards([slow, fast], ["a", "b"], torch.zeros(2, 3, 4, 4), timings=timings)
    assert timings == {"slow": 2.5, "fast": 0.0}
