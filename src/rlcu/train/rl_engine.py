"""An RL job's rollout engine: its arguments and its construction on the policy's own tensors.

The KV pool is sized to the job's batch unless the config says otherwise: RL knows how many
sequences a step (or an evaluation) generates, so a pool that holds them and no more keeps the
rollout phase's peak memory small (the pool lives only through the rollout, llm.sleep / wake).
With LoRA the engine is given the live adapters, which it applies unmerged: the base is never
merged, so a build whose engine cannot apply adapters is refused, not silently merged.
"""

from __future__ import annotations

import inspect

from rlcu.parallel.comm import world
from rlcu.train import sizing


def engine_kwargs(cfg, device, prompt_reports: list, eval_rows: list) -> dict:
    """rlcu.LLM's arguments for a job's engine (no adapters). Its KV pool: engine.num_kv_blocks
    when set; else, with engine.gpu_memory_utilization set, what that fraction of the device
    leaves (the engine's own sizing); else (the default) one step's sequences or one
    evaluation's, whichever is more. prompt_reports: the loaded prompts' checks (their longest)."""
    e = cfg.engine
    kw = dict(device=str(device), max_num_seqs=e.max_num_seqs, max_num_batched_tokens=e.max_num_batched_tokens,
              num_kv_blocks=e.num_kv_blocks, block_size=e.block_size, enforce_eager=e.enforce_eager,
              prefill_graphs=e.prefill_graphs,
              gpu_memory_utilization=e.gpu_memory_utilization)
    if kw["num_kv_blocks"] is None and e.gpu_memory_utilization is None:
        longest = max([r.longest for r in prompt_reports] + [1])  # over every prompt kept
        kw["num_kv_blocks"] = sizing.rl_kv_blocks(cfg, world().size, longest,
                                                  min(len(eval_rows), cfg.eval_max_prompts))
    return kw


def make_engine(llm_cls, model, kw: dict):
    """llm_cls(model, **kw) on the policy's weights, given its live adapters (model.lora); kw
    keeps only what llm_cls takes unless it takes **kwargs (a test's stand-in engine)."""
    params = inspect.signature(llm_cls).parameters
    if model.lora is not None:  # the engine reads the live adapters, unmerged
        kw = {**kw, "lora": model.lora}
    if not any(p.kind == p.VAR_KEYWORD for p in params.values()):
        kw = {k: v for k, v in kw.items() if k in params}
    return llm_cls(model, **kw)
