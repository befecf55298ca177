"""Reward functions: the built-in `math` and `format`, user callables given as
"module.path:function", and RewardSet to apply several with weights."""

from rlcu.rewards.format import format_reward
from rlcu.rewards.math import answers_match, extract_answer, math_reward, normalize_answer
from rlcu.rewards.reward_set import BUILTIN, RewardSet, load_reward

__all__ = ["math_reward", "format_reward", "extract_answer", "normalize_answer", "answers_match",
           "load_reward", "RewardSet", "BUILTIN"]
