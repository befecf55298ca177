"""Reward functions: the built-in `math` and `format`, user callables given as
"module.path:function" (called as TRL's GRPOTrainer calls them: see call.py), and
RewardSet to apply several with weights, time limits and per-sample failure masking."""

from rlcu.rewards.call import TrainerState
from rlcu.rewards.format import format_reward
from rlcu.rewards.loader import BUILTIN, add_import_dir, load_reward
from rlcu.rewards.math import (
           answers_match,
           extract_answer,
           math_reward,
           normalize_answer,
)
from rlcu.rewards.reward_set import RewardSet, RewardsFailed, reward_options

__all__ = [
           "BUILTIN",
           "RewardSet",
           "RewardsFailed",
           "TrainerState",
           "add_import_dir",
           "answers_match",
           "extract_answer",
           "format_reward",
           "load_reward",
           "math_reward",
           "normalize_answer",
           "reward_options",
]
