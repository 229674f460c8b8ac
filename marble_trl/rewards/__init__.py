"""Reward functions: the contract, the registry and the built-ins (see docs/rewards.md)."""

from .base import (
    TRAINER_KWARGS,
    RewardError,
    RewardFunc,
    RewardLogs,
    accepted_trainer_kwargs,
    check_reward_columns,
    check_reward_funcs,
    check_reward_signature,
    dataset_columns,
    finite_numbers,
    is_async_reward,
    reward_name,
)
from .images import from_pil, to_pil, to_uint8_numpy
from .registry import available_rewards, get_reward, register_reward, resolve_reward_funcs
from .scoring import score_rewards

__all__ = [
    "TRAINER_KWARGS",
    "RewardError",
    "RewardFunc",
    "RewardLogs",
    "accepted_trainer_kwargs",
    "check_reward_columns",
    "check_reward_funcs",
    "check_reward_signature",
    "dataset_columns",
    "finite_numbers",
    "is_async_reward",
    "available_rewards",
    "from_pil",
    "get_reward",
    "register_reward",
    "resolve_reward_funcs",
    "reward_name",
    "score_rewards",
    "to_pil",
    "to_uint8_numpy",
]
