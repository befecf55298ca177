"""What the memory model reads: a job's shape (the model's config, the precisions, the ranks, the
micro-batch and its checkpointing, what else the job holds) and its engine's shape (the KV pool,
the step's token budget, the graphs). Plain numbers, so the scheduler can size a job from its
config before anything is built, and a trainer from the buffers it has built
(rlcu.train.sizing makes both)."""

from __future__ import annotations

import dataclasses

from rlcu.model.config import Qwen3Config, checkpointed_layers, layer_keeps
from rlcu.model.lora import LoraConfig


def checkpointing_name(mode) -> str | int:
    """A `gradient_checkpointing` value (True/'full', 'attention', False/'none', an int) as the
    memory model names it: 'full', 'attention', 'none' or the int."""
    if checkpointed_layers(mode) is not None:
        return mode
    return {True: "full", "full": "full", "attention": "attention"}.get(mode, "none")


@dataclasses.dataclass(frozen=True)
class EngineShape:
    """The rollout engine of a job.

    kv_tokens: the KV pool's token slots (blocks x block_size); kv_bytes: bytes of a cached
    K or V element; max_num_seqs: the widest decode step (its rows sample); budget: the token
    budget of one step (max_num_batched_tokens); decode_graphs: decode steps replay CUDA
    graphs, whose pool the engine keeps through a sleep (resident, as RL trainers sleep with
    keep_graphs); prefill_graph_rows: None without prefill graphs, else the rows of hidden
    states the graphs of every token bucket but the largest keep as their outputs
    (engine/prefill_graphs.py `kept_output_rows`)."""

    kv_tokens: int
    kv_bytes: int = 2
    max_num_seqs: int = 256
    budget: int = 8192
    decode_graphs: bool = False
    prefill_graph_rows: int | None = None

    def __post_init__(self):
        for name in ("kv_tokens", "kv_bytes", "max_num_seqs", "budget"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < (0 if name == "kv_tokens" else 1):
                raise ValueError(f"EngineShape.{name} must be an integer >= {0 if name == 'kv_tokens' else 1}, "
                                 f"got {v!r}")


@dataclasses.dataclass(frozen=True)
class AdapterShape:
    """A job's LoRA adapters (model/lora.py): the rank, the HF target modules (or 'all-linear')
    and whether dropout is on (its masks are allocated in the forward and again in the backward)."""

    r: int
    target_modules: tuple[str, ...] | str = "all-linear"
    dropout: bool = False

    def __post_init__(self):
        t = LoraConfig(r=self.r, target_modules=self.target_modules).target_modules  # its checks, named
        object.__setattr__(self, "target_modules", t)


@dataclasses.dataclass(frozen=True)
class RewardModelShape:
    """A reward model in the loop (rewards/model_reward.py): its config (a one-label head on that
    trunk), the tokens of one scoring forward, and whether its weights live in host memory between
    scorings (offload: on the device only through the rollout phase, where it scores)."""

    cfg: Qwen3Config
    tokens: int = 16384
    offload: bool = False


@dataclasses.dataclass(frozen=True)
class JobShape:
    """One rank of a job.

    weight_bytes: the model's dtype (activations and the engine's too); master: an fp32 master
    copy of bf16 weights; state_bytes: each Adam moment's; grad_bytes: the gradient buffer's;
    world_size N: data-parallel ranks (ZeRO: master, moments and gradient are 1/N shards);
    overlap: across ranks, gradients go into per-layer buckets reduce-scattered during the
    backward (else one full buffer reduce-scattered at the step); micro_batch_tokens: the
    tokens of one forward + backward; checkpointing: 'full', 'attention', 'none' or the number
    of checkpointed layers (`checkpointing_name`); fused_head: the LM head's gradient is taken
    in its forward sweep (RL's forward_backward) rather than by a second sweep (SFT's
    forward, backward); release_grads: the gradient is freed between steps (RL); reference:
    a frozen copy of the weights (a KL term); critic: PPO's value model, a trunk of the same
    shape with its own optimizer state of the same precisions; optimizer: False for a model
    that is not trained (an engine alone); random_init: the weights are drawn on the device in
    fp32 (a model made from scratch) rather than read in their dtype; engine: the rollout
    engine, or None; reward_models: the reward models that score the rollouts (`RewardModelShape`);
    adapter: LoRA adapters that train while the base stays frozen (the base then
    has no master, moments or gradient; the adapters have theirs, whole on every rank), or None."""

    cfg: Qwen3Config
    weight_bytes: int = 2
    master: bool = True
    state_bytes: int = 4
    grad_bytes: int = 4
    world_size: int = 1
    overlap: bool = True
    micro_batch_tokens: int = 8192
    checkpointing: str | int = "full"
    fused_head: bool = True
    release_grads: bool = False
    reference: bool = False
    critic: bool = False
    optimizer: bool = True
    random_init: bool = False
    engine: EngineShape | None = None
    adapter: AdapterShape | None = None
    reward_models: tuple[RewardModelShape, ...] = ()

    def __post_init__(self):
        for name in ("weight_bytes", "state_bytes", "grad_bytes", "world_size", "micro_batch_tokens"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"JobShape.{name} must be an integer >= 1, got {v!r}")
        self.keeps()  # the model's own check of the checkpointing (a ValueError naming it)

    def keeps(self) -> tuple[str, ...]:
        """What each layer's forward keeps (model/config.py `layer_keeps`)."""
        return layer_keeps(self.checkpointing, self.cfg.num_hidden_layers)

    @property
    def has_master(self) -> bool:
        """An fp32 master copy exists only beside weights narrower than fp32."""
        return self.optimizer and self.master and self.weight_bytes < 4

    @property
    def trains_base(self) -> bool:
        """The base's weights get gradients and optimizer state: trained, and no adapters."""
        return self.optimizer and self.adapter is None

    def with_(self, **changes) -> JobShape:
        return dataclasses.replace(self, **changes)
