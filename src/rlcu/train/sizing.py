"""A run's memory (rlcu.memory) from what the run is: its `JobShape` from a config before anything
is built (the scheduler's request, `config_shape`) or from a trainer's buffers (`run_shape`),
the KV pool of one RL step (`rl_kv_blocks`, which the RL trainer's engine takes), `gradient_checkpointing:
auto` made a number of layers (`resolve_auto`), and the per-rank estimate logged at a run's start
(`log_estimate`)."""

from __future__ import annotations

import dataclasses

import torch

from rlcu.engine.kv_pool import dtype_bytes, engine_shape
from rlcu.errors import SetupError
from rlcu.hub import model_folder
from rlcu.memory import GiB, JobShape, checkpointing_name, job_memory
from rlcu.memory.fit import fit_checkpointing, step_kv_blocks
from rlcu.memory.shape import AdapterShape, RewardModelShape
from rlcu.model.config import Qwen3Config
from rlcu.parallel.comm import World, world

DEFAULT_PROMPT_TOKENS = 256  # a prompt's length when neither the data nor data.max_prompt_tokens says


def model_config(mc) -> Qwen3Config:
    """The Qwen3Config a ModelConfig names (model.tiny, model.path's config.json, or the
    default 0.6B shape), read without building the model."""
    if mc.tiny is not None:
        return Qwen3Config(**mc.tiny)
    if mc.path is not None:
        return Qwen3Config.from_file(model_folder(mc.path, mc.revision, "model.path", ("config.json",)) / "config.json")
    return Qwen3Config()


def rl_step_seqs(cfg, world_size: int, eval_prompts: int = 0) -> int:
    """The sequences one rank's engine holds at once: its block of a step's prompts times the
    group (or of an evaluation's prompts, whichever is more), at most engine.max_num_seqs."""
    n = max(1, world_size)
    return min(cfg.engine.max_num_seqs, max(-(-cfg.prompts_per_step // n) * cfg.group_size, -(-eval_prompts // n)))


def rl_kv_blocks(cfg, world_size: int, longest_prompt: int | None = None, eval_prompts: int = 0) -> int:
    """The RL trainer's default KV pool: one step's sequences (rlcu.memory.fit.step_kv_blocks);
    the longest prompt kept, else data.max_prompt_tokens, else DEFAULT_PROMPT_TOKENS."""
    longest = longest_prompt or cfg.data.max_prompt_tokens or DEFAULT_PROMPT_TOKENS
    return step_kv_blocks(longest, cfg.sequence_new_tokens(), cfg.engine.block_size, rl_step_seqs(cfg, world_size,
                                                                                             eval_prompts))


def config_reward_models(cfg, offload_auto: bool = False) -> tuple[RewardModelShape, ...]:
    """The reward models of a run's `rewards` (their config.json read, not their weights), each
    scoring forward of its max_tokens (else micro_batch_tokens); `offload: auto` as offload_auto."""
    from rlcu.rewards.model_reward import model_config

    out = []
    for i, spec in enumerate(cfg.rewards):
        if not isinstance(spec, dict) or not isinstance(spec.get("model"), str):
            continue
        folder = model_folder(spec["model"], None, f"rewards[{i}].model", ("config.json",))
        off = spec.get("offload", "auto")
        out.append(RewardModelShape(model_config(folder), spec.get("max_tokens") or cfg.micro_batch_tokens,
                                    offload_auto if off == "auto" else bool(off)))
    return tuple(out)


def choose_offload(shape: JobShape, auto: list[int], budget: int | None) -> JobShape:
    """`offload: auto` decided: the reward models at indices `auto` stay on the device unless the
    job's peak with them there (fragmentation and context included) exceeds `budget` bytes (the
    device's; None: kept). Offloading costs a host-device copy of their weights each step, so it
    pays only where keeping them does not fit."""
    if not auto or budget is None:
        return shape
    rms = list(shape.reward_models)
    kept = shape.with_(reward_models=tuple(dataclasses.replace(r, offload=False) if i in auto else r
                                           for i, r in enumerate(rms)))
    mem = job_memory(kept)
    if mem.device_bytes(mem.peak) <= budget:
        return kept
    return shape.with_(reward_models=tuple(dataclasses.replace(r, offload=True) if i in auto else r
                                           for i, r in enumerate(rms)))


def config_shape(cfg, world_size: int = 1, *, model_cfg: Qwen3Config | None = None,
                 offload_auto: bool = False) -> JobShape:
    """The shape of a GRPO/PPO job on one of its `world_size` ranks from its config alone (the
    engine's pool as the RL trainer sizes it by default: one step's sequences); reward models
    with `offload: auto` kept on the device (the larger need: a scheduler's request) unless
    offload_auto."""
    m, e = cfg.model, cfg.engine
    qc = model_config(m) if model_cfg is None else model_cfg
    m.check_layers(qc.num_hidden_layers)
    dtype = m.resolve_dtype()
    engine = engine_shape(qc, dtype, kv_tokens=(e.num_kv_blocks or rl_kv_blocks(cfg, world_size)) * e.block_size,
                          max_num_seqs=e.max_num_seqs, max_num_batched_tokens=e.max_num_batched_tokens,
                          graphs=m.resolve_device() == "cuda" and not e.enforce_eager, prefill_graphs=e.prefill_graphs)
    return JobShape(qc, **_precisions(cfg), world_size=max(1, world_size), micro_batch_tokens=cfg.micro_batch_tokens,
                    checkpointing=checkpointing_name(m.gradient_checkpointing), release_grads=cfg.optim.release_grads,
                    reference=cfg.kl_coef > 0 and not cfg.lora.enabled, critic=hasattr(cfg, "critic"),
                    random_init=m.path is None, engine=engine.engine, adapter=config_adapter(cfg.lora),
                    reward_models=config_reward_models(cfg, offload_auto))


def _precisions(cfg) -> dict:
    """A config's weight, master, moment and gradient precisions as JobShape's fields."""
    o = cfg.optim
    wb = dtype_bytes(cfg.model.resolve_dtype())
    return dict(weight_bytes=wb, master=o.master_weights, state_bytes=2 if o.state_dtype == "bfloat16" else 4,
                grad_bytes=2 if wb == 2 and o.grad_dtype == "bfloat16" else 4)


def train_shape(cfg, world_size: int = 1, *, model_cfg: Qwen3Config | None = None) -> JobShape:
    """A trainer's job from its config: an RL config's `config_shape`; an SFT config's (no
    engine, micro-batches of batch_tokens, the head's gradient in a second sweep). A
    checkpointing still 'auto' is every layer checkpointed, and a reward model's offload 'auto'
    offloaded: the least that auto can choose."""
    if hasattr(cfg, "prompts_per_step"):
        shape = config_shape(cfg, world_size, model_cfg=model_cfg, offload_auto=True)
    else:
        m = cfg.model
        qc = model_config(m) if model_cfg is None else model_cfg
        m.check_layers(qc.num_hidden_layers)
        shape = JobShape(qc, **_precisions(cfg), world_size=max(1, world_size), micro_batch_tokens=cfg.batch_tokens,
                         checkpointing=checkpointing_name(m.gradient_checkpointing), fused_head=False,
                         random_init=m.path is None, adapter=config_adapter(cfg.lora))
    return shape.with_(checkpointing="full") if cfg.model.gradient_checkpointing == "auto" else shape


def device_memory(device: str) -> int | None:
    """The bytes of the device a run trains on, which a job's estimate is held to: a CUDA
    device's total (what an otherwise empty device gives; the memory free now depends on other
    jobs sharing it); None on the CPU, which has no budget to hold a run to."""
    return torch.cuda.mem_get_info()[1] if device == "cuda" else None


def refuse_unfit(cfg, world_size: int = 1, *, model_cfg: Qwen3Config | None = None, device: str | None = None,
                 budget: int | None = None) -> None:
    """Refuse full fine-tuning (no `lora:`) of a model whose job, by the memory model, needs more
    than the device has: a SetupError with the estimate, the budget and a pointer to LoRA, at
    setup rather than an out-of-memory error an hour into loading. device: where the model lives
    (else model.device's); budget: bytes (else `device_memory`; nothing is checked where neither
    gives one)."""
    if cfg.lora.enabled:
        return
    budget = device_memory(device or cfg.model.resolve_device()) if budget is None else budget
    if budget is None:
        return
    mem = job_memory(train_shape(cfg, world_size, model_cfg=model_cfg))
    need = mem.device_bytes(mem.peak)
    if need <= budget:
        return
    state = mem.weights + mem.master + mem.optimizer_state + mem.gradients
    n = mem.weights // mem.shape.weight_bytes
    raise SetupError(
        f"full fine-tuning of this model ({n:,} parameters, {world_size} rank{'s' if world_size > 1 else ''}) "
        f"does not fit: estimated {need / GiB:.2f} GiB a rank (weights, master, optimizer state and gradients "
        f"{state / GiB:.2f} GiB) against {budget / GiB:.2f} GiB of device memory; "
        f"train LoRA adapters instead (lora: {{r: 16}}: the base frozen, with no master, moments or gradient), "
        f"or add ranks (the optimizer state is sharded across them)")


HOST_MAX_SEQS = 1024  # the most sequences a LoRA host's shared engine takes in one step (its graphs' largest batch)


def host_engine_config(cfgs: list):
    """The config whose engine is a LoRA host's shared one (train/lora_host.py): the first job's,
    with a KV pool that holds every job's step (the sum of their pools) and room for all their
    sequences in one step (at most HOST_MAX_SEQS)."""
    import copy

    c = copy.deepcopy(cfgs[0])
    c.engine.num_kv_blocks = sum(x.engine.num_kv_blocks or rl_kv_blocks(x, 1) for x in cfgs)
    c.engine.max_num_seqs = min(sum(x.engine.max_num_seqs for x in cfgs), HOST_MAX_SEQS)
    return c


def host_request(cfgs: list) -> dict[str, float]:
    """A LoRA host's memory (the scheduler's request, GiB per phase as JobMemory.request): the
    base, the CUDA context and the shared engine's graphs once; each job's adapters (weights,
    master, moments; their gradient unless released); the shared engine's pool and step; and,
    since the jobs' updates take turns, the largest of their training phases."""
    from rlcu.memory.job import FRAGMENTATION, GiB

    one = job_memory(config_shape(host_engine_config(cfgs)))
    mems = [job_memory(config_shape(c)) for c in cfgs]
    own = [m.adapters + (0 if m.shape.release_grads else m.adapter_gradients) for m in mems]
    resident = one.resident - own[0] + sum(own)
    phases = dict(one.phases())
    for k in phases:
        if k != "rollout":
            phases[k] = max(m.phases()[k] for m in mems)
    out = {"resident": one.device_bytes(resident) / GiB}
    return out | {k: v * FRAGMENTATION / GiB for k, v in phases.items()}


def host_join(cfgs: list, cfg) -> dict[str, float]:
    """GiB a LoRA host's leases grow by when job `cfg` joins its jobs `cfgs` (rlcu.sched.host): the
    joined job's adapter parts (host_request's resident, which the scheduler fixed at the host's
    registration, so added to every phase the host holds) and any phase the job makes larger
    (its update: the phases are the largest of the jobs'); the rollout's pool does not grow (the
    running engine's is fixed)."""
    before, after = host_request(cfgs), host_request([*cfgs, cfg])
    res = max(0.0, after["resident"] - before["resident"])
    return {k: res + (0.0 if k == "rollout" else max(0.0, after[k] - before[k])) for k in after if k != "resident"}


def config_adapter(section) -> AdapterShape | None:
    """The adapters a `lora:` section makes (lora.path: its adapter_config.json's), None when off."""
    if not section.enabled:
        return None
    if section.path is None:
        c = section.lora_config()
    else:
        from rlcu.model.lora_peft import read_adapter_config

        c = read_adapter_config(section.path)
    return AdapterShape(c.r, c.target_modules, bool(section.dropout or c.dropout))


def adapter_shape(model) -> AdapterShape | None:
    """The adapters attached to `model` (model/lora.py), None without."""
    ad = model.lora
    return None if ad is None else AdapterShape(ad.cfg.r, ad.cfg.target_modules, ad.cfg.dropout > 0)


def run_shape(model, opt, *, micro_batch_tokens: int, fused_head: bool, release_grads: bool = False, llm=None,
              reference: bool = False, critic: bool = False, reward_models: tuple = ()) -> JobShape:
    """The shape of a run on this rank from its buffers: the model's and the optimizer's dtypes
    and modes, the engine's pool and graphs. A checkpointing still 'auto' is the number of
    layers it will become (`auto_layers`). With adapters attached the optimizer's state and the
    gradient are theirs (the base frozen), and a LoRA run's reference is the base itself."""
    trained = getattr(opt, "model", model)  # FlatAdamW's: the adapters with LoRA
    runner = getattr(llm, "runner", None)  # none yet: a LoRA host's job before the shared engine starts
    grad_dtype = getattr(opt, "grad_dtype", getattr(trained, "grad_dtype", torch.float32))
    shape = JobShape(model.cfg, weight_bytes=model.flat.element_size(),
                     master=getattr(opt, "master", None) is not None and not getattr(opt, "master_is_model", True),
                     state_bytes=opt.m.element_size(), grad_bytes=dtype_bytes(grad_dtype), world_size=world().size,
                     overlap=getattr(opt, "sink", None) is not None, micro_batch_tokens=micro_batch_tokens,
                     fused_head=fused_head, release_grads=release_grads, reference=reference, critic=critic,
                     engine=runner.memory_shape().engine if runner is not None else None, adapter=adapter_shape(model),
                     reward_models=tuple(reward_models))
    mode = model.gradient_checkpointing
    k = auto_layers(shape, model.device)[0] if mode == "auto" else checkpointing_name(mode)
    return shape.with_(checkpointing=k)


def reward_model_shapes(rewards) -> tuple[RewardModelShape, ...]:
    """The reward models of a RewardSet (rewards/model_reward.py) as the memory model sees them;
    `offload: auto` as kept, until `settle_offload` decides it."""
    return tuple(RewardModelShape(m.rm.cfg, m.max_tokens, m.offload is True)
                 for m in (rewards.models if rewards is not None else []))


def settle_offload(rewards, shape: JobShape, device: torch.device) -> list[str]:
    """Decide each reward model's `offload: auto` (`choose_offload` against the device's memory;
    kept on the CPU) and put the offloaded ones to sleep; returns a line per model for the log."""
    models = rewards.models if rewards is not None else []
    auto = [i for i, m in enumerate(models) if m.offload == "auto"]
    budget = device_memory(device.type) if device.type == "cuda" else None
    chosen = choose_offload(shape, auto, budget).reward_models
    lines = []
    for i, m in enumerate(models):
        m.offload = chosen[i].offload
        if m.offload:
            m.sleep()
        if i in auto and budget is not None:
            how = "offloaded between scorings (it does not fit kept)" if m.offload else "kept on the device"
            lines.append(f"reward model {i}: offload auto: {how}")
    return lines


def auto_layers(shape: JobShape, device: torch.device) -> tuple[int, int]:
    """(k, the budget): the fewest checkpointed layers whose peak fits what this process may hold
    on its GPU (the free memory and what it has reserved already, within the caching allocator's
    per-process cap, `torch.cuda.set_per_process_memory_fraction`, which fails any allocation past it);
    every layer on the CPU (budget 0)."""
    if device.type != "cuda":
        return shape.cfg.num_hidden_layers, 0
    free, total = torch.cuda.mem_get_info(device)
    budget = min(free + torch.cuda.memory_reserved(device), process_cap(device, total))
    return fit_checkpointing(budget, shape), budget


def process_cap(device: torch.device, total: int) -> int:
    """The bytes this process's caching allocator may hold on `device`: its per-process memory
    fraction of the device's total (the whole device unless a caller set one)."""
    frac = getattr(torch.cuda, "get_per_process_memory_fraction", None)
    return int(total * frac(device)) if frac is not None else total


def resolve_auto(model, shape: JobShape) -> str:
    """`gradient_checkpointing: auto` made a number (`auto_layers` over the run's shape): sets
    model.gradient_checkpointing and returns a line for the log."""
    L = model.cfg.num_hidden_layers
    k, budget = auto_layers(shape, model.device)
    model.gradient_checkpointing = k
    if model.device.type != "cuda":
        return f"gradient checkpointing auto: all {L} layers checkpointed (on the CPU)"
    need = job_memory(shape.with_(checkpointing=k))
    return (f"gradient checkpointing auto: {k} of {L} layers checkpointed, every activation of the others kept "
            f"(estimated peak {need.peak / (1 << 30):.1f} GiB allocated of {budget / (1 << 30):.1f} GiB this "
            f"process may hold)")


def log_estimate(log, shape: JobShape, device: torch.device, w: World | None = None) -> str | None:
    """Log the per-rank estimate (`JobMemory.summary`) at a run's start: on a GPU or across ranks
    (a one-process CPU run has no device to fit)."""
    w = w or world()
    if not w.distributed and device.type != "cuda":
        return None
    line = job_memory(shape).summary()
    log.info(line)
    return line
