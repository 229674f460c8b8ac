"""Reward functions: the contract, the registry and the built-ins (see docs/rewards.md)."""

from .base import RewardError, RewardFunc, reward_name, score_rewards
from .images import from_pil, to_pil, to_uint8_numpy
from .registry import available_rewards, get_reward, register_reward, resolve_reward_funcs

__all__ = [
    "RewardError",
    "RewardFunc",
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
