"""rlcu: LLM reinforcement-learning post-training with hand-written kernels, for the Qwen3, Qwen2/2.5,
Llama 3.x and Mistral families (docs/models.md).

    import rlcu
    m = rlcu.from_pretrained(path)                   # the model (any family), weights in one flat buffer
    llm = rlcu.LLM(m)                                # the paged engine, sharing m's weights
    m.exact = True                                   # exact mode, the model's: llm's logprobs == m.forward's
    rlcu.GRPOTrainer(config, dataset, rewards).train()
"""

__version__ = "0.1.0"

from rlcu.model.causal_lm import CausalLM, Qwen3  # noqa: E402,F401
from rlcu.model.config import CausalLMConfig, Qwen3Config  # noqa: E402,F401

from_pretrained = CausalLM.from_pretrained  # the family from config.json's architectures

# heavier subsystems load on first use
_LAZY = {
    "LLM": "rlcu.engine", "SamplingParams": "rlcu.engine",
    "SFTTrainer": "rlcu.train", "DPOTrainer": "rlcu.train", "GRPOTrainer": "rlcu.train", "PPOTrainer": "rlcu.train",
    "RewardTrainer": "rlcu.train", "RewardModel": "rlcu.model.reward_model",
    "Tokenizer": "rlcu.data.tokenizer",
}


def __getattr__(name):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'rlcu' has no attribute {name!r}")
