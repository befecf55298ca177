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

Joining. A LoRA job submitted later (`rlcu grpo b.yaml --scheduler ADDR`, `submit_lora`) joins
a host already running on its base: each host listens on a join channel (rlcu.sched.join: a
Unix socket whose proofs are the scheduler's token) whose address, with the key of its base
(`base_key`: check_jobs' shared fields), is in its registration's spec, which `status` shows to
token holders. The submitter finds a running host of its key there and sends its config over
the channel; the host takes the job between two steps (LoraHost.join), grows its leases by the
job's adapter parts (rlcu.train.sizing.host_join: every phase it asks for from then on, since the
scheduler fixed its resident at registration), and answers the job's exit status once it ends.
With no such host (or one that ended meanwhile) the job runs as a host of its own, which later
jobs join in turn. The joined job's files are read and written by the host's process: its
config goes with its file fields made absolute (`absolute_paths`), and the config's folder, where
reward modules are looked for, goes along.
"""

from __future__ import annotations

import hashlib
import json
import secrets
import sys
import threading
from pathlib import Path

from rlcu.config import GRPOConfig, config_to_dict
from rlcu.errors import SetupError
from rlcu.sched.client import SchedClient, SchedError
from rlcu.sched.hooks import CLUSTER, JobHooks
from rlcu.sched.job import _use_device, grpo_config, sched_exit_status
from rlcu.sched.join import JoinServer, join
from rlcu.train import sizing
from rlcu.train.core import coerce_config
from rlcu.train.host_jobs import BASE_FIELDS, HostedJob, check_jobs
from rlcu.train.lora_host import LoraHost

JOIN_ROOM = 7  # a joinable host's declared peak leaves room for this many more jobs like its first


def host_memory(cfgs: list[GRPOConfig], given: dict | None = None, joinable: bool = False) -> tuple[dict, dict]:
    """(clusters, mem per phase) a host registers: its request (module docstring), overridden by
    `given`; a joinable host declares a peak with room for JOIN_ROOM more jobs like its first (the
    scheduler holds a job's requests to its declared peak: joins beyond the room are refused)."""
    mem = sizing.host_request(cfgs)
    mem.update(given or {})
    peak = max(v for k, v in mem.items() if k != "resident")
    if joinable:
        peak += JOIN_ROOM * max(sizing.host_join(cfgs, cfgs[0]).values())
    return {CLUSTER: {"devices": 1, "resident": mem["resident"], "peak": peak}}, mem


def base_key(cfg: GRPOConfig) -> str:
    """What a host's jobs share (check_jobs: model.path, revision, tiny, init_seed, dtype, device;
    exact; the engine section) as a hash: a job joins only a host of its own key."""
    d = {f: getattr(cfg.model, f) for f in BASE_FIELDS} | {"exact": cfg.exact, "engine": config_to_dict(cfg)["engine"]}
    d["path"] = _local(d["path"])  # one folder, however a config names it
    return hashlib.sha256(json.dumps(d, sort_keys=True, default=str).encode()).hexdigest()[:32]


# the fields a joined job's process reads or writes, made absolute before its config is sent
# (the host's working directory is not the submitter's); the read ones only where they exist here
WRITTEN = (("log", "out_dir"), ("checkpoint", "dir"))
READ = (("model", "path"), ("model", "tokenizer"), ("data", "path"), ("data", "eval_path"), ("lora", "path"),
        ("checkpoint", "resume"))


def _local(v):
    """A path that exists here, made absolute; anything else (a Hub id, None, 'auto') as given."""
    return str(Path(v).expanduser().resolve()) if isinstance(v, str) and v and Path(v).expanduser().exists() else v


def absolute_paths(cfg: GRPOConfig) -> GRPOConfig:
    """`cfg` with its file fields (WRITTEN, READ) absolute, for a host in another directory."""
    for sec, f in WRITTEN + READ:
        part = getattr(cfg, sec)
        v = getattr(part, f)
        if isinstance(v, str) and v and (sec, f) in WRITTEN:
            setattr(part, f, str(Path(v).expanduser().resolve()))
        elif (sec, f) in READ:
            setattr(part, f, _local(v))
    return cfg


def run_host(configs: list, addr: str | None = None, name: str | None = None, *, overrides=(), mem: dict | None = None,
             token: str | None = None, client: SchedClient | None = None, sources: list[str] | None = None,
             names: list[str] | None = None, heartbeat_s: float = 2.0, poll_s: float = 0.1, joinable: bool = True,
             **host_kw) -> LoraHost:
    """Register the host as one job, run its jobs under it (and the jobs that join it: joinable,
    the module docstring), finish; returns the LoraHost (each job's status, history, error).
    host_kw (datasets, reward_fns, tokenizers) go to LoraHost."""
    cfgs = [grpo_config(c, overrides) if not isinstance(c, GRPOConfig) else coerce_config(GRPOConfig, c)
            for c in configs]
    check_jobs([HostedJob(f"job{i}", c, (sources or [None] * len(cfgs))[i]) for i, c in enumerate(cfgs)])
    c = client or SchedClient(addr, token)
    key = getattr(c.transport, "token", None)
    joinable = bool(joinable and key)
    try:
        clusters, mem = host_memory(cfgs, mem, joinable)
    except (ValueError, FileNotFoundError) as e:
        raise SetupError(str(e)) from None
    server = JoinServer(key).start() if joinable else None
    spec = {"kind": "lora-host", "jobs": len(cfgs), "mem": mem}
    if server is not None:
        spec |= {"base": base_key(cfgs[0]), "join": server.address}
    try:
        handle = c.job(name or f"lora-host-{secrets.token_hex(3)}", clusters, spec=spec, heartbeat_s=heartbeat_s,
                       poll_s=poll_s)
    except BaseException:
        if server is not None:
            server.close()
        raise
    hooks = JobHooks(handle, CLUSTER, mem)
    ok = False
    try:
        with hooks.phase("init") as lease:
            _use_device(lease)
            host = LoraHost(cfgs, sources=sources, names=names, hooks=hooks, **host_kw)
        if server is not None:
            peak, joined, lock = clusters[CLUSTER]["peak"], list(cfgs), threading.Lock()
            server.admit = lambda cfg: _admit(hooks, joined, cfg, peak, lock)
            server.bind(host)
        host.train()
        ok = all(j.status in (0, None) for j in host.jobs)
        return host
    finally:
        if server is not None:
            server.close()
        hooks.lease.leave()
        try:
            handle._call("finish", failed=not ok)
        except SchedError:
            pass
        handle.close()


def _admit(hooks: JobHooks, joined: list, cfg: GRPOConfig, peak: float, lock: threading.Lock) -> bool:
    """Whether a joining job fits the host's declared peak; if so its memory (sizing.host_join)
    is added to every phase the host asks for from now on (the leases grow; they do not shrink
    when it leaves, as the host's request keeps every job it started with). One join at a time
    (`lock`: each connection has a thread of its own)."""
    with lock:
        add = sizing.host_join(joined, cfg)
        grown = {k: hooks.mem.get(k, 0.0) + v for k, v in add.items()}
        if max(grown.values()) > peak + 1e-9:
            return False
        hooks.mem.update(grown)
        joined.append(cfg)
        return True


def submit_lora(config, addr: str | None = None, name: str | None = None, *, overrides=(), token: str | None = None,
                client: SchedClient | None = None, source: str | None = None, **host_kw) -> tuple[int, str | None]:
    """A LoRA GRPO job under the scheduler: joined into a running host of its base (module
    docstring), else run as a host of its own that later jobs join; returns (its exit status as
    `rlcu grpo` gives it alone, its error or None). host_kw go to run_host (mem, datasets, ...)."""
    cfg = absolute_paths(grpo_config(config, overrides))
    source = source or (str(config) if isinstance(config, (str, Path)) else None)
    c = client or SchedClient(addr, token)
    key, mine = getattr(c.transport, "token", None), base_key(cfg)
    if key:
        for row in c.status().get("jobs", []):
            h = row.get("host")
            if row.get("state") != "running" or not isinstance(h, dict) or h.get("base") != mine:
                continue
            got = join(h["join"], key, config_to_dict(cfg), name=name, source=source,
                       import_dir=str(Path(source).resolve().parent) if source else None)
            if got is not None:
                return got
    host = run_host([cfg], client=c, sources=[source] if source else None, names=[name] if name else None,
                    **host_kw)
    first = host.jobs[0]  # (its errors were printed here, by the host)
    return (first.status if first.status is not None else 1), None


def submit_lora_exit_code(prog: str, *args, **kw) -> int:
    """submit_lora for a command line: the job's status (its error as one line on stderr; a
    joined job's full report is in the host's output and its run folder), 3 when the scheduler
    ended the host it ran in, 2 on a scheduler error."""

    def run() -> int:
        status, err = submit_lora(*args, **kw)
        if status and err:
            print(f"{prog}: {err}", file=sys.stderr)
        return status

    return sched_exit_status(prog, run, "host")


def run_host_exit_code(prog: str, *args, **kw) -> int:
    """run_host for a command line: the worst of the jobs' statuses (each as `rlcu grpo` gives it
    alone), 3 when the scheduler ended the host, 2 on a scheduler error or configs that cannot
    share a host (one line naming the file and the field)."""

    return sched_exit_status(prog, lambda: run_host(*args, **kw).status, "host")
