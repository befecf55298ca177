"""The in-process paged inference engine: `LLM(model).generate(prompts, SamplingParams(...))`.

Split as the best small engines are: `Sequence` (state and block table), `BlockManager`
(CPU bookkeeping: ref-counted blocks, fork, copy-on-write, prefix cache), `Scheduler`
(policy: continuous batching, chunked prefill, preemption), `ModelRunner` (a step's tensors,
launch and readback) over the forward on the paged cache (paged_forward), the KV pool
(kv_pool) and the CUDA graphs of decode steps (graphs) and of prefill steps (prefill_graphs),
`LLM` (the public API: generate, chat, and run_episodes over `Episode`s, engine/episodes.py).
"""

from rlcu.engine.episodes import Episode
from rlcu.engine.llm import LLM
from rlcu.engine.params import CompletionOutput, InvalidRequestError, RequestOutput, SamplingParams

__all__ = ["LLM", "Episode", "SamplingParams", "RequestOutput", "CompletionOutput", "InvalidRequestError"]
