"""Trainers (SFT, DPO, GRPO, PPO, reward models) and their shared pieces: the lr schedule, checkpoints and run
logging; FlatAdamW (rlcu.optim, which rlcu.parallel shares) and the errors a run raises
(rlcu.errors) are named here too. Submodules are imported on first use so that
`import rlcu.train` stays light."""

import importlib

_LAZY = {
    "SFTTrainer": "rlcu.train.sft",
    "DPOTrainer": "rlcu.train.dpo",
    "Trainer": "rlcu.train.core",
    "Hooks": "rlcu.train.core",
    "FlatAdamW": "rlcu.optim",
    "NonFiniteError": "rlcu.errors",
    "SetupError": "rlcu.errors",
    "RunLogger": "rlcu.train.logging",
    "lr_at": "rlcu.train.schedule",
    "save_checkpoint": "rlcu.train.checkpoint",
    "load_checkpoint": "rlcu.train.checkpoint",
    "latest_checkpoint": "rlcu.train.checkpoint",
    "GRPOTrainer": "rlcu.train.grpo",
    "PPOTrainer": "rlcu.train.ppo",
    "RewardTrainer": "rlcu.train.reward_trainer",
}


def __getattr__(name):
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'rlcu.train' has no attribute {name!r}")
