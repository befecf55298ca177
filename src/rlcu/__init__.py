"""rlcu: LLM reinforcement-learning post-training for Qwen3 with hand-written kernels.

    import rlcu
    m = rlcu.Qwen3.from_pretrained(path)            # the model, weights in one flat buffer
    llm = rlcu.LLM(m)                                # the paged engine, sharing m's weights
    m.exact = True                                   # exact mode, the model's: llm's logprobs == m.forward's
    rlcu.GRPOTrainer(config, dataset, rewards).train()
"""

__version__ = "0.1.0"

from rlcu.model.config import Qwen3Config  # noqa: E402,F401
from rlcu.model.qwen3 import Qwen3  # noqa: E402,F401

# heavier subsystems load on first use
_LAZY = {
    "LLM": "rlcu.engine", "SamplingParams": "rlcu.engine",
    "SFTTrainer": "rlcu.train", "GRPOTrainer": "rlcu.train", "PPOTrainer": "rlcu.train",
    "Tokenizer": "rlcu.data.tokenizer",
}


def __getattr__(name):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'rlcu' has no attribute {name!r}")
