"""One model of a job's memory, by part, per rank: every consumer reads it.

    shape = JobShape(cfg, world_size=8, micro_batch_tokens=16384, checkpointing="full",
                     engine=EngineShape(kv_tokens=102_400))
    mem = job_memory(shape)          # JobMemory: bytes of each part
    mem.phases(), mem.peak, mem.request(), mem.summary()

- shape.py: what a job is (`JobShape`: the model's config, precisions, ranks, micro-batch,
  checkpointing, reference, critic; `EngineShape`: the KV pool, the step's budget, the graphs);
- parts.py: one function a part, of the shape -> bytes on one rank: weights, fp32 master,
  optimizer state, gradients and the data-parallel buckets (ZeRO shards are 1/N), LoRA
  adapters (their weights, master, moments and gradients; the frozen base then has none), the
  activations a micro-batch keeps per token under each checkpointing mode, the backward's and
  the fused LM head's work (its logits tile), KV per token and per block, the engine's step and
  its graphs' pools, a reference model, a critic, the reward models (their weights, resident or
  offloaded, and their scoring forward);
- job.py: `JobMemory`, the parts of one job and their phases (init, rollout, ref_logprobs,
  actor_train, critic_train), its peak, the scheduler's request and one line of summary; the
  measured factors (fragmentation, the CUDA context) as named constants;
- fit.py: what fits a budget: the checkpointed layers of `gradient_checkpointing: auto`, the KV
  blocks of the engine's pool and of a scheduled job's rollout lease, one RL step's pool.

Readers: the engine's pool sizing (engine/kv_pool.py), `gradient_checkpointing: auto`, the
per-rank estimate a run logs at its start and the RL trainer's one-step pool
(rlcu.train.sizing), the scheduler's per-phase request (rlcu.sched.job.estimate_memory).

Adding a kind of memory (LoRA adapters, MoE experts, a new model family): give `JobShape` the
field that describes it (an adapter's rank, the experts' count and top-k), write its part in
parts.py as one function of the shape (the tensors it allocates, named in its docstring), add
the part to `JobMemory` (a field; `RESIDENT` if it stays across phases, else the phase that
holds it in `JobMemory.phases`), and a hand sum for it in tests/unit/test_memory.py. Nothing
else sizes memory: the consumers read the parts through `job_memory`.
"""

from rlcu.memory.job import CONTEXT_BYTES, FRAGMENTATION, GiB, JobMemory, job_memory
from rlcu.memory.shape import AdapterShape, EngineShape, JobShape, RewardModelShape, checkpointing_name

__all__ = ["CONTEXT_BYTES", "FRAGMENTATION", "GiB", "AdapterShape", "EngineShape", "JobMemory", "JobShape",
           "RewardModelShape", "checkpointing_name", "job_memory"]
