"""TRL's GRPOTrainer under the rlcu scheduler: its generation on a preemptible `rollout`
lease, its scoring and update on an `actor_train` lease.

    from rlcu.sched.integrations.trl import scheduled
    trainer = GRPOTrainer(model=..., reward_funcs=..., args=GRPOConfig(...), train_dataset=...)
    scheduled(trainer, addr="unix:/path/sched.sock", job="exp-1").train()   # addr None: the default

`scheduled` changes no math. It adds a `TrainerCallback` (it registers the job when training
begins and finishes it when training ends) and wraps two of the trainer's methods, because
no callback fires around generation:

- `_generate(prompts)`, one generation batch (prompts -> completions, HF `generate` or
  vLLM): it runs on a `rollout` lease; when it returns, the job moves to `actor_train` (the
  rewards, the old/ref logprob forwards, the loss and the optimizer step), held until the
  next generation batch (TRL reuses a batch for `steps_per_generation * num_iterations`
  optimizer steps, all on that lease);
- `_generate_single_turn(...)`, only with `rollout_chunk=N` and HF generation: the batch is
  generated N rows at a time, and between two sub-batches the job checks for a yield.

Yields. Rollout is the preemptible phase: when another job's higher phase needs the memory,
the service marks the rollout lease `yield`. The job honours it at its next boundary: the
end of the generation batch (always), or the end of a sub-batch with `rollout_chunk`. There
it gives the lease back (on CUDA after `torch.cuda.empty_cache()`, so the memory really is
free), asks for `rollout` again with the rows it has left as `work` (its request keeps its
age), and goes on once granted. HF `generate` cannot stop inside a call, so a sub-batch is
the finest boundary. With vLLM in colocate mode, pass `vllm_enable_sleep_mode=True`: TRL
then wakes the engine's KV cache inside `_generate` and sleeps it after, so the engine's
memory lives inside the rollout lease (a yield is honoured between generation batches).

Cancel. After `rlcu sched cancel JOB` the callback ends training at the end of the step in
flight with a checkpoint (TRL's own, in `output_dir`), and the job finishes as cancelled;
`--now` ends it at its next call to the service (`JobEnded`).

Memory (GiB per device). `mem={"resident": R, "rollout": X, "actor_train": Y}` declares
the footprint; what is not declared is estimated from the model and the config (weights,
gradients and AdamW moments; the KV cache of one generation batch; one micro-batch's
activations and logits) and, on CUDA, measured (rlcu.sched.lease): each phase's peak above
what was allocated when it began becomes its next request (x1.1), capped at the peak
registered (the larger estimate doubled, at least 0.5 GiB, at most a device less the resident
memory).

Versions. Supported and tested: TRL 1.16.0 (with transformers 5.24, accelerate 1.15,
datasets 5.2); the `trl` extra asks for >=1.16,<2. TRL 1.0 to 1.9 have the same two methods
(`_generate_single_turn` without its later `num_generations` argument, which the wrapper
passes through), so they should work, untested; `scheduled` refuses a trainer without them,
naming the method (TRL before 0.24 has no `_generate`). `evaluate()` called outside `train()` runs unscheduled;
one `train()` per job name.
One process (one GPU, or the CPU): a multi-process (accelerate/DDP) run
would register one job per rank, which this does not do. `pip install 'rlcu[trl]'`.
"""

from __future__ import annotations

import contextlib
import inspect
import secrets
import time

from rlcu.sched.client import JobEnded, LeaseInfo, SchedClient, SchedError
from rlcu.sched.lease import CudaMeter, LeaseHolder, Lessor

GiB = float(1 << 30)
TESTED = "1.16.0"
WRAPPED = ("_generate", "_generate_single_turn")
PHASES = ("resident", "rollout", "actor_train")
MIN_PEAK_GIB = 0.5  # the least peak registered for a measured (CUDA) job


def require_trl():
    """The `trl` module, or an ImportError that says how to install it."""
    try:
        import transformers  # noqa: F401
        import trl
    except ImportError as e:
        raise ImportError(f"rlcu.sched.integrations.trl needs TRL ({e}): pip install 'rlcu[trl]' "
                          f"(tested with trl=={TESTED})") from None
    return trl


def estimate_memory(trainer, prompt_tokens: int = 512) -> dict[str, float]:
    """Rough GiB per device of the trainer's `resident` state (weights, gradients, AdamW's two
    moments, the reference model), one generation batch's `rollout` (KV cache + logits) and
    one micro-batch's `actor_train` (activations, checkpointed or not, and logits)."""
    model, args = trainer.model, trainer.args
    params = list(model.parameters())
    w = params[0].element_size() if params else 4
    P = sum(p.numel() for p in params)
    Pt = sum(p.numel() for p in params if p.requires_grad)
    cfg = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    L, H, V = cfg.num_hidden_layers, cfg.hidden_size, cfg.vocab_size
    heads = cfg.num_attention_heads
    kvh = getattr(cfg, "num_key_value_heads", None) or heads
    hd = getattr(cfg, "head_dim", None) or H // heads
    ref = P * w if getattr(trainer, "ref_model", None) is not None else 0
    resident = P * w + Pt * w * 3 + ref
    seq = (getattr(args, "max_prompt_length", None) or prompt_tokens) + (args.max_completion_length or 256)
    rows = args.generation_batch_size or args.per_device_train_batch_size
    rollout = rows * seq * 2 * L * kvh * hd * w + rows * V * 4 * 2
    per_tok = L * H * w * (4 if args.gradient_checkpointing else 34) + V * 4 * 3
    train = args.per_device_train_batch_size * seq * per_tok
    return {"resident": resident / GiB, "rollout": rollout * 1.2 / GiB, "actor_train": train * 1.2 / GiB}


class SchedRun:
    """One trainer's side of the scheduler: the job handle and its `LeaseHolder`
    (rlcu.sched.lease: the phase moves, the yield, the peaks measured on CUDA), and the
    generation boundaries. `events` logs (time, kind, detail) for tests and debugging: kinds
    acquire, release, boundary, yield, finish."""

    def __init__(self, trainer, client: SchedClient, name: str, mem: dict | None = None, *, cluster: str = "actor",
                 rollout_chunk: int | None = None, heartbeat_s: float = 2.0, poll_s: float = 0.1):
        bad = set(mem or {}) - set(PHASES)
        if bad:
            raise ValueError(f"mem: unknown key {min(bad)!r} (keys: {', '.join(PHASES)})")
        for k, v in (mem or {}).items():
            if not isinstance(v, (int, float)) or isinstance(v, bool) or v < 0:
                raise ValueError(f"mem.{k} must be a number of GiB >= 0, got {v!r}")
        if rollout_chunk is not None and (not isinstance(rollout_chunk, int) or rollout_chunk < 1):
            raise ValueError(f"rollout_chunk must be an integer >= 1 (rows per sub-batch), got {rollout_chunk!r}")
        self.trainer, self.client, self.name, self.cluster = trainer, client, name, cluster
        self.declared = dict(mem or {})
        self.rollout_chunk, self.heartbeat_s, self.poll_s = rollout_chunk, heartbeat_s, poll_s
        self.job = None
        self.lease: LeaseHolder | None = None  # once the job is registered
        self.mem: dict[str, float] = {}
        self.events: list[tuple[float, str, dict]] = []

    @property
    def held(self) -> LeaseInfo | None:
        return self.lease.held if self.lease is not None else None

    @property
    def measured(self) -> dict[str, float]:
        return self.lease.measured if self.lease is not None else {}

    @property
    def yields(self) -> int:
        return self.lease.yields if self.lease is not None else 0

    # ------------------------------------------------------------------ register / finish
    def start(self) -> None:
        if self.job is not None:
            return
        import torch

        dev = self.trainer.accelerator.device
        cuda = dev if dev.type == "cuda" and torch.cuda.is_available() else None
        est = estimate_memory(self.trainer)
        if cuda is not None:
            opt = getattr(self.trainer, "optimizer", None)
            missing = 0 if opt is not None and opt.state else sum(
                p.numel() * p.element_size() * 3 for p in self.trainer.model.parameters() if p.requires_grad)
            est["resident"] = max(est["resident"], (torch.cuda.memory_allocated(dev) + missing) / GiB)
        self.mem = {**est, **self.declared}
        peak = max(self.mem["rollout"], self.mem["actor_train"])
        if cuda is not None and not {"rollout", "actor_train"} <= set(self.declared):
            # room for measured peaks above the estimates (the allocator's and cuBLAS's own), within a device
            cap = min(d["capacity"] for d in self.client.status()["devices"])
            peak = max(peak, min(cap - self.mem["resident"], max(2 * peak, MIN_PEAK_GIB)))
        self.peak = peak
        clusters = {self.cluster: {"devices": 1, "resident": self.mem["resident"], "peak": peak}}
        self.job = self.client.job(self.name, clusters, spec={"kind": "trl-grpo", "mem": self.mem},
                                   heartbeat_s=self.heartbeat_s, poll_s=self.poll_s)
        only = None
        if cuda is not None:
            idx = cuda.index if cuda.index is not None else torch.cuda.current_device()
            names = {d["name"]: d["index"] for d in self.client.status()["devices"]}
            only = [names[f"cuda:{idx}"]] if f"cuda:{idx}" in names else None
        self.lease = LeaseHolder(Lessor(self.job), self.cluster, self.mem, declared=self.declared, cap=peak,
                                 meter=CudaMeter(cuda) if cuda is not None else None, ask={"only": only},
                                 events=self.events)

    def finish(self, failed: bool = False) -> None:
        """Give back the lease and end the job (failed: with an error); safe to call twice."""
        if self.job is None:
            return
        job, self.job = self.job, None
        with contextlib.suppress(SchedError):
            self.lease.leave()
        self.events.append((time.time(), "finish", {"failed": failed}))
        try:
            if "failed" in inspect.signature(job.finish).parameters:
                job.finish(failed=failed)
            elif failed:
                job._call("finish", failed=True)  # the client's finish() knows no failure yet
            else:
                job.finish()
        except JobEnded:
            pass  # the service had ended it already
        except SchedError:
            if not failed:  # a job that trained but could not say so: the caller must know
                raise
            # (on an error, the error is what matters: the service reclaims the job once it falls silent)
        finally:
            job.close()

    # ------------------------------------------------------------------ leases
    def enter(self, phase: str, work: float | None = None) -> None:
        self.lease.enter(phase, work)

    def boundary(self, rows_left: int) -> None:
        """Between two generation sub-batches: honour a yield notice on the rollout lease."""
        self.events.append((time.time(), "boundary", {"rows_left": rows_left}))
        if self.lease.yield_due():  # give it back, then ask again with the work left; the request keeps its age
            self.lease.yield_and_wait(float(rows_left * (self.trainer.args.max_completion_length or 1)))

    # ------------------------------------------------------------------ the wrapped methods
    def generate(self, orig, prompts):
        if self.job is None:  # outside train() (a lone evaluate()): not scheduled
            return orig(prompts)
        rows = len(prompts)
        self.enter("rollout", work=float(rows * (self.trainer.args.max_completion_length or 1)))
        out = orig(prompts)
        self.enter("actor_train")
        return out

    def generate_single_turn(self, orig, prompt_ids, images, multimodal_fields, *a, **kw):
        # (TRL 1.0-1.9 take (prompt_ids, images, multimodal_fields); 1.16 adds num_generations, ...)
        k, t = self.rollout_chunk, self.trainer
        plain = not (getattr(t, "use_vllm", False) or getattr(t, "use_transformers_continuous_batching", False))
        if (k is None or self.job is None or not plain or images is not None or multimodal_fields
                or len(prompt_ids) <= k):
            return orig(prompt_ids, images, multimodal_fields, *a, **kw)
        ids, lps = [], []
        for i in range(0, len(prompt_ids), k):
            if i:
                self.boundary(len(prompt_ids) - i)
            c, lp = orig(prompt_ids[i:i + k], images, multimodal_fields, *a, **kw)
            ids.extend(c)
            lps.append(lp)
        if all(lp is None for lp in lps):
            return ids, None
        return ids, [x for lp in lps for x in lp]


def _callback(run: SchedRun):
    from transformers import TrainerCallback

    class SchedCallback(TrainerCallback):
        """Registers the job when training begins, finishes it when training ends; a graceful
        cancel (`rlcu sched cancel`) ends training after the step in flight, with a checkpoint."""

        def on_train_begin(self, args, state, control, **kw):
            run.start()

        def on_step_end(self, args, state, control, **kw):
            if run.job is None:
                return
            try:
                run.job._call("heartbeat")  # the job's view now: a step may hold one lease throughout
            except JobEnded:
                raise
            except SchedError:
                pass  # the service is away for now: its last view stands
            if run.job.stopping:
                control.should_save = control.should_training_stop = True

        def on_train_end(self, args, state, control, **kw):
            run.finish()

    return SchedCallback()


def scheduled(trainer, addr: str | None = None, job: str | None = None, *, token: str | None = None,
              client: SchedClient | None = None, mem: dict | None = None, cluster: str = "actor",
              rollout_chunk: int | None = None, heartbeat_s: float = 2.0, poll_s: float = 0.1):
    """Put a TRL GRPOTrainer under the scheduler at `addr` as job `job` (default: a random
    name); returns the same trainer, ready for `.train()`. Its `SchedRun` is `trainer.sched`."""
    require_trl()
    missing = [m for m in WRAPPED if not callable(getattr(trainer, m, None))]
    if missing:
        raise TypeError(f"scheduled() needs a TRL GRPOTrainer with {', '.join(WRAPPED)}; "
                        f"{type(trainer).__name__} has no {missing[0]} (tested with trl=={TESTED})")
    if getattr(trainer, "sched", None) is not None:
        raise ValueError("this trainer is already scheduled")
    run = SchedRun(trainer, client or SchedClient(addr, token), job or f"trl-{secrets.token_hex(3)}", mem,
                   cluster=cluster, rollout_chunk=rollout_chunk, heartbeat_s=heartbeat_s, poll_s=poll_s)
    gen, single, train = trainer._generate, trainer._generate_single_turn, trainer.train
    trainer._generate = lambda prompts: run.generate(gen, prompts)
    trainer._generate_single_turn = lambda *a, **kw: run.generate_single_turn(single, *a, **kw)

    def train_under_scheduler(*a, **kw):
        try:
            return train(*a, **kw)
        except BaseException:
            run.finish(failed=True)  # on_train_end is not called on an error
            raise

    trainer.train = train_under_scheduler
    trainer.add_callback(_callback(run))
    trainer.sched = run
    return trainer
