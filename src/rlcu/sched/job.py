"""A GRPO job under the scheduler: every phase of every step runs on a lease.

    python -m rlcu.sched.job --config grpo.yaml --addr unix:~/.rlcu/sched/sched.sock [--set k=v ...]
    run_grpo("grpo.yaml", addr)                                   # the Python API

`ScheduledGRPO` is the GRPO trainer driven through its phase hooks (`JobHooks`, rlcu.sched.hooks,
on rlcu.train.core.Hooks; it changes nothing in the math): building the model, engine and
optimizer is `init`; sampling is `rollout`; the reference model's forward is `ref_logprobs`;
the optimizer updates are `actor_train`. Each boundary gives back the lease of the phase
before and asks for the next, with the memory that phase needs on the job's one cluster,
`actor`, whose weights and optimizer state stay resident on its device (a `resident` lease) for the job's life.

Preemption. Rollout is the one preemptible phase. Between two engine steps the engine asks
the job whether to yield (`LLM.generate(yield_check=..., on_yield=...)`); on a yield notice
the engine preempts every live sequence the way its scheduler does (its blocks freed, its
tokens kept) and sleeps (the KV pool is freed), and the job gives the lease back and asks
again with the work it has left, keeping its age. Once granted, the engine wakes, the
sequences are recomputed from their tokens and generation goes on. Sampling is counter-based
per (seed, sample, position), so a preempted rollout makes the same tokens as an
uninterrupted one: nothing is lost and training ends at the same weights.

Memory per phase is the memory model's for the config (rlcu.memory; `estimate_memory`, GiB)
unless given; on a GPU the engine's KV pool is what the rollout lease holds once the engine's
step and graphs are set aside (rlcu.memory.fit.kv_blocks_for_lease), so several jobs on one
device never take more than they were leased.

Across the ranks of a data-parallel run (torchrun) the job is one, with leases of WORLD_SIZE
devices held by rank 0, and every phase and yield taken by all ranks together: rlcu.sched.dp.

Cancel. `rlcu sched cancel JOB` makes the job `stopping`: it learns so from its next call to
the service (a phase, a heartbeat), finishes the step in flight, checkpoints and logs as on
SIGTERM (`Hooks.stop_reason`), finishes (the service marks it cancelled) and exits with status
3; `--now` ends it at once, losing the steps since its last checkpoint.

Threads. From a command line (`threads=True`) a job on CPU slots takes its slots' share of the
machine's cores (rlcu.threads; its `init` lease says which slots, `status` how many there are).
"""

from __future__ import annotations

import argparse
import os
import secrets
import sys
from pathlib import Path

from rlcu import memory
from rlcu.config import ConfigError, GRPOConfig, load_config
from rlcu.errors import SetupError
from rlcu.memory.fit import kv_blocks_for_lease
from rlcu.parallel.comm import ranked, world
from rlcu.rewards import add_import_dir
from rlcu.sched.client import JobEnded, JobHandle, SchedClient, SchedError, pool_devices
from rlcu.sched.dp import DistJobHooks, on_main
from rlcu.sched.hooks import CLUSTER, JobHooks
from rlcu.threads import apply as apply_threads
from rlcu.train import sizing
from rlcu.train.core import TrainingStopped, coerce_config, exit_status
from rlcu.train.grpo import GRPOTrainer

GiB = float(1 << 30)


def estimate_memory(cfg: GRPOConfig, world_size: int = 1) -> dict[str, float]:
    """GiB per device of the job on one of its `world_size` ranks, by phase: the memory model's
    request (rlcu.memory `JobMemory.request`, from the config alone: rlcu.train.sizing.config_shape):
    `resident` (weights, master, moments, the reference, the gradient unless
    optim.release_grads frees it between steps, the decode graphs' pool, the CUDA context) and
    the transient need of init, rollout (one step's KV pool, the engine's widest step, the
    prefill graphs), ref_logprobs and actor_train (a micro-batch under
    model.gradient_checkpointing, the gradient when released, the data-parallel buckets)."""
    if cfg.model.gradient_checkpointing == "auto":
        raise ConfigError("model.gradient_checkpointing", "'auto' sizes the activations to the free memory of a "
                                                          "GPU of its own; a scheduled job shares one: give true, "
                                                          "'attention', false or a number of checkpointed layers")
    return memory.job_memory(sizing.config_shape(cfg, world_size)).request()


def slot_share(sched: JobHandle, lease) -> float | None:
    """The part of this machine's cores a lease of CPU slots gives: its slots over the pool's
    slots on its host; None for GPUs, or when the pool cannot be read (`status` needs the
    service token, which a worker holding only its job's secret lacks)."""
    names = list(lease.names)
    if not names or not all(n.rsplit("/", 1)[-1].startswith("cpu") for n in names):
        return None
    host = names[0].rpartition("/")[0]
    devices = pool_devices(sched.client)
    if devices is None:
        return None
    pool = [d["name"] for d in devices]
    here = [n for n in pool if n.rpartition("/")[0] == host and n.rsplit("/", 1)[-1].startswith("cpu")]
    return min(1.0, len(names) / len(here)) if here else None


def _use_device(lease) -> None:
    if world().distributed:
        return  # each rank keeps its LOCAL_RANK device (its process group's); DistJobHooks checks the lease
    name = lease.names[0].rsplit("/", 1)[-1] if lease.names else ""  # "cuda:K" or "NODE/cuda:K"
    if name.startswith("cuda:"):
        import torch

        torch.cuda.set_device(int(name.split(":")[1]))


class ScheduledGRPO(GRPOTrainer):
    """GRPOTrainer whose phases run on scheduler leases through its phase hooks (`JobHooks`):
    `sched` is the job's JobHandle and `mem` the memory per phase (and `resident`) on its
    device, as registered. Nothing of the trainer is overridden: building it is the `init`
    phase; the trainer's own hooks.phase calls do the rest. The engine keeps its decode
    graphs through every sleep (between phases and on a yield): a wake whose pool comes back
    at the same address replays them, so they are captured once, not every step."""

    def __init__(self, config, dataset=None, reward_fns=None, *, sched: JobHandle, mem: dict | None = None,
                 cluster: str = CLUSTER, threads: bool = False, **kw):
        cfg = coerce_config(GRPOConfig, config)
        if world().distributed:  # rank 0 holds the leases; every rank enters each phase (sched/dp.py)
            hooks = DistJobHooks(sched, cluster, mem)
        else:
            hooks = JobHooks(sched, cluster, mem)
        with hooks.phase("init") as lease:
            self._use_device(lease)
            if threads:  # a command line's process: its CPU slots' share of the cores
                _set_threads(cfg, hooks, lease)
            if cfg.engine.num_kv_blocks is None and hooks.mem.get("rollout") and _on_cuda(cfg):
                # the pool the rollout lease holds once the engine's step and graphs are set aside
                shape = sizing.config_shape(cfg, world().size)
                cfg.engine.num_kv_blocks = max(16, kv_blocks_for_lease(hooks.mem["rollout"] * GiB, shape,
                                                                       cfg.engine.block_size))
            super().__init__(cfg, dataset, reward_fns, hooks=hooks, **kw)
        if hasattr(hooks, "attach"):
            hooks.attach(self.llm)

    def _use_device(self, lease) -> None:
        """Make the lease's device current (benchmarks extend this, e.g. with a stream)."""
        _use_device(lease)

    @property
    def sched(self) -> JobHandle:
        return self.hooks.sched

    @property
    def yields(self) -> int:
        return self.hooks.yields

    @property
    def engine_steps(self) -> int:
        return self.hooks.engine_steps

    @property
    def on_engine_step(self):
        return self.hooks.on_engine_step

    @on_engine_step.setter
    def on_engine_step(self, fn) -> None:
        self.hooks.on_engine_step = fn


def _set_threads(cfg: GRPOConfig, hooks, lease) -> None:
    if world().distributed:  # rank 0 reads the pool; every rank takes its slot's share
        share = on_main(lambda: slot_share(hooks.sched, lease))
    else:
        share = slot_share(hooks.sched, lease)
    apply_threads(cfg.model.threads, share=share or 1.0)


def _on_cuda(cfg) -> bool:
    return cfg.model.resolve_device() == "cuda"


def job_memory(cfg: GRPOConfig, given: dict | None = None, devices: int = 1) -> tuple[dict, dict]:
    """(clusters, mem per phase and device) to register: the estimates, overridden by `given`;
    `devices`: the job's ranks (one device each)."""
    mem = estimate_memory(cfg, world_size=devices)
    mem.update(given or {})
    peak = max(v for k, v in mem.items() if k != "resident")
    return {CLUSTER: {"devices": devices, "resident": mem["resident"], "peak": peak}}, mem


def grpo_config(config, overrides=()) -> GRPOConfig:
    """A job's GRPOConfig from a YAML path (with `--set` overrides), a dict or a GRPOConfig."""
    if isinstance(config, (str, Path)) or config is None:
        return load_config(GRPOConfig, config, list(overrides))
    return coerce_config(GRPOConfig, config)


def run_grpo(config, addr: str | None = None, name: str | None = None, *, overrides=(), attach: bool = False,
             mem: dict | None = None, token: str | None = None, client: SchedClient | None = None,
             heartbeat_s: float = 2.0, poll_s: float = 0.1, trainer_cls=None, threads: bool = False,
             **trainer_kw) -> list[dict]:
    """Register (or attach to) a job, train under the scheduler, finish; returns the metrics.
    trainer_kw (dataset, reward_fns, tokenizer, ...) go to the trainer, a ScheduledGRPO
    (or trainer_cls). threads: choose torch's CPU threads from the job's slots (a command
    line's process; a library caller owns its threads). A job the service asked to stop (a
    graceful cancel) raises TrainingStopped after its checkpoint, and finishes as cancelled.
    Under torchrun (rlcu.parallel) every rank calls this: rank 0 registers the job with one lease
    of WORLD_SIZE devices and talks to the scheduler; see rlcu.sched.dp."""
    cfg = grpo_config(config, overrides)
    w = world()
    try:  # the estimate reads model.path's config: a name neither here nor on the Hub is one line, exit 2
        clusters, mem = job_memory(cfg, mem, devices=w.size)
    except (ValueError, FileNotFoundError) as e:
        raise SetupError(str(e)) from None

    def register():
        c = client or SchedClient(addr, token)
        return c.job(name or f"grpo-{secrets.token_hex(3)}", clusters, spec={"kind": "grpo", "mem": mem},
                     attach=attach, heartbeat_s=heartbeat_s, poll_s=poll_s)

    if w.distributed:
        handle = on_main(register, share=False)  # rank 0's; None elsewhere (a refusal raises on every rank)
    else:
        handle = register()
    ok, trainer = False, None
    try:
        try:  # as a plain run's setup: a missing data file or a bad row is one line, exit 2
            trainer = (trainer_cls or ScheduledGRPO)(cfg, sched=handle, mem=mem, **trainer_kw,
                                                     **({"threads": True} if threads else {}))
        except (ValueError, FileNotFoundError) as e:
            raise SetupError(str(e)) from None
        try:
            hist = trainer.train()
        except TrainingStopped:
            ok = True  # it stopped as asked, checkpoint written: the service makes it cancelled
            raise
        ok = True
        return hist
    finally:
        if trainer is not None and hasattr(trainer.hooks, "close"):
            trainer.hooks.close()
        if handle is not None:
            try:
                handle._call("finish", failed=not ok)
            except SchedError:
                pass
            handle.close()


def run_grpo_exit_code(prog: str, *args, **kw) -> int:
    """run_grpo for a command line: 0 when the job finished, 3 when the scheduler ended it
    (cancelled: after the step in flight and a checkpoint, or at once with --now; or its
    leases reclaimed), 2 on a scheduler error, and the trainer's statuses otherwise
    (train.core.exit_status: 1, 2, 128 + N); the reason goes to stderr."""

    def run() -> int:
        run_grpo(*args, **kw)
        return 0

    return sched_exit_status(prog, run, "job")


def sched_exit_status(prog: str, run, what: str) -> int:
    """`run()`'s status for a command line under the scheduler (train.core.exit_status around
    it): 3 when the run was stopped or the scheduler ended it (`what`: the job, or the host it
    runs in), 2 on a scheduler error; the reason as one line on stderr."""

    def guarded() -> int:
        try:
            return run()
        except TrainingStopped as e:
            print(f"{prog}: {e}", file=sys.stderr)
            return 3
        except JobEnded as e:
            print(f"{prog}: the scheduler ended the {what}: {e}", file=sys.stderr)
            return 3
        except SchedError as e:
            print(f"{prog}: scheduler error: {e}", file=sys.stderr)
            return 2

    return exit_status(prog, guarded)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m rlcu.sched.job", description="a GRPO job under the rlcu scheduler")
    p.add_argument("--config", required=True, help="GRPO YAML config")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--addr", default=None, help="scheduler address (default $RLCU_SCHED_ADDR or the local socket)")
    p.add_argument("--name", default=os.environ.get("RLCU_SCHED_JOB"), help="job name (default: random)")
    p.add_argument("--attach", action="store_true", help="take over a job registered by `rlcu sched submit`")
    p.add_argument("--mem", action="append", default=[], metavar="PHASE=GIB",
                   help="memory of a phase (or resident) per device, overriding the estimate")
    a = p.parse_args(argv)
    add_import_dir(a.config)
    mem = {}
    for kv in a.mem:
        k, _, v = kv.partition("=")
        try:
            mem[k] = float(v)
        except ValueError:
            p.error(f"--mem takes PHASE=GIB, got {kv!r}")
    return run_grpo_exit_code("rlcu sched job", a.config, a.addr, a.name, overrides=a.overrides,
                              attach=a.attach, mem=mem, threads=True)


if __name__ == "__main__":
    sys.exit(ranked(main))  # under torchrun: the process group around the job

