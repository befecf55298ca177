"""rlcu: LLM reinforcement-learning post-training for Qwen3 with hand-written kernels."""

__version__ = "0.1.0"

from rlcu.model.config import Qwen3Config  # noqa: E402,F401
from rlcu.model.qwen3 import Qwen3  # noqa: E402,F401
