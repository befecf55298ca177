"""A LoRA host under the scheduler: LoRA GRPO jobs that name one base, placed together as ONE job
of the scheduler (one process, one lease at a time, one copy of the base on its device).

    rlcu grpo a.yaml b.yaml c.yaml --scheduler ADDR        # the command line
    run_host(["a.yaml", "b.yaml"], addr)                   # the Python API

The host (rlcu.train.lora_host) registers with the memory model's request for all of them
(rlcu.train.sizing.host_request): the base, the context and the shared engine's graphs once, each
job's adapter parts, the shared engine's pool, the largest of the jobs' training phases (their
updates take turns). Its phases are the host's `JobHooks`: `init` around building the base, the
jobs and the engine; `rollout` around each shared generate call (preemptible: the engine yields
between steps as a single job's does); each job's `ref_logprobs` and `actor_train` in its turn.
A job that ends leaves the host between steps and the others go on; the host finishes at the
scheduler when the last one ends.

What it does not do yet: a job cannot join a host that is already running. Jobs are placed into
a host when it starts (the configs given together); a job submitted later starts a host of its
own. Joining a live host needs a channel from a job's process into the host's (the configs and
the per-job status going over it) and the host's lease growing by the job's adapter parts
between steps, neither of which the scheduler's one-process-per-job model has today.
"""

from __future__ import annotations

import secrets
import sys

from rlcu.config import GRPOConfig
from rlcu.errors import SetupError
from rlcu.sched.client import JobEnded, SchedClient, SchedError
from rlcu.sched.hooks import CLUSTER, JobHooks
from rlcu.sched.job import _use_device, grpo_config
from rlcu.train import sizing
from rlcu.train.core import coerce_config, exit_status
from rlcu.train.lora_host import HostedJob, LoraHost, check_jobs


def host_memory(cfgs: list[GRPOConfig], given: dict | None = None) -> tuple[dict, dict]:
    """(clusters, mem per phase) a host registers: its request (module docstring), overridden by
    `given`."""
    mem = sizing.host_request(cfgs)
    mem.update(given or {})
    peak = max(v for k, v in mem.items() if k != "resident")
    return {CLUSTER: {"devices": 1, "resident": mem["resident"], "peak": peak}}, mem


def run_host(configs: list, addr: str | None = None, name: str | None = None, *, overrides=(), mem: dict | None = None,
             token: str | None = None, client: SchedClient | None = None, sources: list[str] | None = None,
             names: list[str] | None = None, heartbeat_s: float = 2.0, poll_s: float = 0.1, **host_kw) -> LoraHost:
    """Register the host as one job, run its jobs under it, finish; returns the LoraHost (each
    job's status, history, error). host_kw (datasets, reward_fns, tokenizers) go to LoraHost."""
    cfgs = [grpo_config(c, overrides) if not isinstance(c, GRPOConfig) else coerce_config(GRPOConfig, c)
            for c in configs]
    check_jobs([HostedJob(f"job{i}", c, (sources or [None] * len(cfgs))[i]) for i, c in enumerate(cfgs)])
    try:
        clusters, mem = host_memory(cfgs, mem)
    except (ValueError, FileNotFoundError) as e:
        raise SetupError(str(e)) from None
    c = client or SchedClient(addr, token)
    handle = c.job(name or f"lora-host-{secrets.token_hex(3)}", clusters,
                   spec={"kind": "lora-host", "jobs": len(cfgs), "mem": mem}, heartbeat_s=heartbeat_s, poll_s=poll_s)
    hooks = JobHooks(handle, CLUSTER, mem)
    ok = False
    try:
        with hooks.phase("init") as lease:
            _use_device(lease)
            host = LoraHost(cfgs, sources=sources, names=names, hooks=hooks, **host_kw)
        host.train()
        ok = all(j.status in (0, None) for j in host.jobs)
        return host
    finally:
        hooks.lease.leave()
        try:
            handle._call("finish", failed=not ok)
        except SchedError:
            pass
        handle.close()


def run_host_exit_code(prog: str, *args, **kw) -> int:
    """run_host for a command line: the worst of the jobs' statuses (each as `rlcu grpo` gives it
    alone), 3 when the scheduler ended the host, 2 on a scheduler error or configs that cannot
    share a host (one line naming the file and the field)."""

    def run() -> int:
        try:
            return run_host(*args, **kw).status
        except JobEnded as e:
            print(f"{prog}: the scheduler ended the host: {e}", file=sys.stderr)
            return 3
        except SchedError as e:
            print(f"{prog}: scheduler error: {e}", file=sys.stderr)
            return 2

    return exit_status(prog, run)
