"""A job's memory on one rank, by part and by phase (`job_memory(shape) -> JobMemory`).

The parts are bytes the job's tensors take from torch's allocator (what
`torch.cuda.max_memory_allocated` counts). A phase's total is what stays across phases (the
resident parts) plus what that phase alone holds:
    init          a random initialisation's fp32 copy of the weights (beside the weights alone:
                  a phase only where that is more than the resident parts)
    rollout       the KV pool, the prefill graphs' pool, and the larger of the engine's widest step
                  and the reward models' scoring (their widest forward, and the weights of those
                  offloaded between scorings)
    ref_logprobs  the frozen reference's forward of a micro-batch
    actor_train   the gradient (the adapters' too; when released between steps), the data-parallel buckets, and a
                  micro-batch's kept activations with the larger of the backward's and the LM
                  head's work
    critic_train  (PPO) the critic's gradient and its micro-batch
The rollout and training phases never overlap (the KV pool sleeps through training, the gradient
is freed through the rollout), so the peak is the resident parts plus the largest phase.

What a device needs beyond the allocated bytes is measured, not modelled: the allocator's
rounding and fragmentation (`FRAGMENTATION`) and the CUDA context (`CONTEXT_BYTES`), see
`device_bytes`. The scheduler's request (`request`) is in those terms.
"""

from __future__ import annotations

import dataclasses

from rlcu.memory import parts
from rlcu.memory.shape import JobShape

GiB = 1 << 30
# torch's reserved over allocated bytes at a phase's peak (its 2 MiB and 20 MiB segments, blocks
# split and cached): 1.000 to 1.015 over the train steps and rollouts of tests/integration/test_memory_gpu.py
# (0.6B and 4B, H200); 1.05 leaves room for a long run's churn of segments
FRAGMENTATION = 1.05
# the device memory a process uses outside torch's allocator (the CUDA context, the kernels' modules,
# cuBLAS's own): 0.77 GiB in one process in the same test; 1.5 GiB leaves room for NCCL's buffers across ranks
CONTEXT_BYTES = int(1.5 * GiB)

RESIDENT = ("weights", "master", "optimizer_state", "gradients", "adapters", "adapter_gradients", "reference",
            "critic", "critic_gradients", "reward_model", "decode_graphs", "workspace")


@dataclasses.dataclass(frozen=True)
class JobMemory:
    """Bytes per rank of each part of a job (rlcu.memory.parts), and their phases."""

    shape: JobShape
    weights: int
    master: int
    optimizer_state: int
    gradients: int
    adapters: int
    adapter_gradients: int
    grad_buckets: int
    reference: int
    critic: int
    critic_gradients: int
    reward_model: int
    reward_model_offloaded: int
    reward_work: int
    workspace: int
    kept_activations: int
    layer_work: int
    head_work: int
    head_tile: int
    ref_forward: int
    critic_work: int
    kv_pool: int
    engine_step: int
    decode_graphs: int
    prefill_graphs: int
    init_staging: int

    @property
    def resident(self) -> int:
        """What stays across phases: weights, master, moments, the adapters (their weights, master
        and moments), the reference, the critic, the reward models not offloaded, the
        decode graphs' pool (kept through the engine's sleep), cuBLAS's workspace, and the
        gradients unless released between steps."""
        s = self.shape
        held = {k: getattr(self, k) for k in RESIDENT}
        if s.release_grads:
            held["gradients"] = held["adapter_gradients"] = held["critic_gradients"] = 0
        return sum(held.values())

    def phases(self) -> dict[str, int]:
        """Each phase's own bytes, above `resident`."""
        s = self.shape
        released = self.gradients + self.adapter_gradients if s.release_grads else 0
        # building: the staging copy beside the weights, before the other buffers exist
        out = {"init": max(0, self.weights + self.init_staging - self.resident),
               "rollout": self.kv_pool + self.prefill_graphs + max(self.engine_step, self.reward_scoring),
               "ref_logprobs": self.ref_forward,
               "actor_train": released + self.grad_buckets + self.kept_activations
               + max(self.layer_work, self.head_work)}
        if s.critic:
            out["critic_train"] = released + (self.critic_gradients if s.release_grads else 0) + self.critic_work
        return out

    @property
    def reward_scoring(self) -> int:
        """What scoring with the reward models adds in the rollout phase (after generation, the
        engine's step done): the offloaded ones' weights and the widest forward."""
        return self.reward_model_offloaded + self.reward_work

    def total(self, phase: str) -> int:
        """Allocated bytes at the phase's peak: the resident parts and the phase's own."""
        return self.resident + self.phases()[phase]

    @property
    def peak(self) -> int:
        return self.resident + max(self.phases().values())

    @staticmethod
    def device_bytes(allocated: int) -> int:
        """Device memory for `allocated` bytes of tensors: fragmentation, and the context."""
        return int(allocated * FRAGMENTATION) + CONTEXT_BYTES

    def request(self) -> dict[str, float]:
        """The scheduler's memory per phase and device, GiB: `resident` (the context with it) and
        each phase's own (rlcu.sched: a job's peak is resident + its largest phase)."""
        out = {"resident": self.device_bytes(self.resident) / GiB}
        return out | {k: v * FRAGMENTATION / GiB for k, v in self.phases().items()}

    def summary(self) -> str:
        """One line: the peak and its parts, GiB."""
        names = (*RESIDENT, "grad_buckets", "kept_activations", "layer_work", "head_work", "kv_pool", "engine_step",
                 "prefill_graphs", "reward_model_offloaded", "reward_work")
        body = ", ".join(f"{k.replace('_', ' ')} {getattr(self, k) / GiB:.2f}" for k in names if getattr(self, k))
        phases = ", ".join(f"{k} {v / GiB:.2f}" for k, v in self.phases().items() if v)
        s = self.shape
        return (f"memory per rank (estimate, {s.world_size} rank{'s' if s.world_size > 1 else ''}): peak "
                f"{self.peak / GiB:.1f} GiB allocated, {self.device_bytes(self.peak) / GiB:.1f} GiB of device "
                f"= resident {self.resident / GiB:.2f} + the largest phase ({phases}); parts: {body}")


def job_memory(shape: JobShape) -> JobMemory:
    """Every part of the job (rlcu.memory.parts) for `shape`."""
    fields = [f.name for f in dataclasses.fields(JobMemory) if f.name not in ("shape", "workspace")]
    return JobMemory(shape=shape, workspace=parts.CUBLAS_WORKSPACE, **{k: getattr(parts, k)(shape) for k in fields})
