"""`rlcu sched ...`: serve, submit, status, cancel, drain, simulate, trace, metrics.

    rlcu sched serve --gpus all                      # or --cpu-slots 2 [--mem 64]; --addr 127.0.0.1:7777
    rlcu sched submit job.yaml                       # a job file, or a GRPO config itself
    rlcu sched status                                # jobs, phases, devices, memory, waits
    rlcu sched cancel JOB [--now]                    # stop after the step in flight and a checkpoint
    rlcu sched drain [--off]                         # take no new job (the live ones go on)
    rlcu sched simulate TRACE.json --policy fifo|phase [--json] [--trace-out chrome.json]
    rlcu sched trace OUT.json                        # Chrome/Perfetto trace of every lease
    rlcu sched metrics [--json]

A job file (YAML) for `submit`:

    name: exp-1                   # default: the file's stem
    grpo: grpo.yaml               # the GRPO config the worker runs (relative to this file)
    set: [steps=50]               # overrides of that config
    mem: {rollout: 20, actor_train: 30, resident: 8}   # GiB per device; default: estimates
    ranks: 4                      # data parallel on this node: one job, leases of 4 devices
                                  # (the worker runs under torchrun --nproc-per-node 4)
    # or, instead of grpo: any command; {addr} and {name} are filled in, and the
    # environment has RLCU_SCHED_ADDR, RLCU_SCHED_JOB, RLCU_SCHED_TOKEN
    command: [python, my_job.py, --addr, "{addr}", --name, "{name}"]
    clusters: {actor: {devices: 1, resident: 8, peak: 30}}    # with command: the job's clusters

`submit` registers the job and starts its worker in the background (log in
<state>/logs/NAME.log, mode 0600); the worker gets RLCU_SCHED_JOB_SECRET, its job's secret,
and attaches to the job within the start-up grace (`serve --start-grace`, default
max(heartbeat timeout, 300 s)).

The token: `--token-file PATH`, else $RLCU_SCHED_TOKEN, else <state>/token (made by `serve`,
mode 0600, in a state folder of mode 0700). `--token X` still works but puts the token in
the process list (`ps`): it is deprecated and warns.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

SUBCOMMANDS = ("serve", "submit", "status", "cancel", "drain", "simulate", "trace", "metrics")
JOB_KEYS = {"name", "grpo", "set", "mem", "command", "clusters", "ranks"}


def _addr_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--addr", default=None, help="scheduler address: unix:PATH, 127.0.0.1:PORT or ray:NAME "
                                                "(default $RLCU_SCHED_ADDR or <state>/sched.sock)")
    p.add_argument("--token-file", default=None, help="a file holding the service's token (default "
                                                      "$RLCU_SCHED_TOKEN, else <state>/token)")
    p.add_argument("--token", default=None, help=argparse.SUPPRESS)  # deprecated: visible in `ps`


def _token(a) -> str | None:
    """The token the command line gives (--token-file, else the deprecated --token), else None."""
    if a.token is not None:
        print("rlcu sched: --token puts the token in the process list (ps); it is deprecated: use --token-file "
              "or $RLCU_SCHED_TOKEN", file=sys.stderr)
    if a.token_file is not None:
        try:
            tok = Path(a.token_file).read_text().strip()
        except OSError as e:
            raise ValueError(f"cannot read --token-file {a.token_file}: {e.strerror}") from None
        if not tok:  # never "" as a token: it would be anyone's
            raise ValueError(f"--token-file {a.token_file} is empty: it must hold the service's token")
        return tok
    if a.token is not None and not a.token.strip():
        raise ValueError("--token is empty: give the service's token (better with --token-file)")
    return a.token


def _client(a):
    from rlcu.sched.client import SchedClient

    return SchedClient(a.addr, _token(a), retry_s=0.5)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="rlcu sched", description="phase-aware multi-job GPU scheduler")
    sub = p.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("serve", help="run the scheduler service")
    _addr_args(s)
    s.add_argument("--state", default=None, help="state folder: sched.db, token, socket (default $RLCU_SCHED_DIR "
                                                 "or ~/.rlcu/sched)")
    s.add_argument("--gpus", default=None, help="GPU indices to schedule, e.g. 0,1, or 'all'")
    s.add_argument("--cpu-slots", type=int, default=None, help="schedule N CPU slots instead of GPUs (tests)")
    s.add_argument("--mem", default=None, help="memory per device (GiB; default: each GPU's total, 1 per CPU slot)")
    s.add_argument("--policy", default="phase", choices=("phase", "fifo"))
    s.add_argument("--aging-s", type=float, default=60.0, help="seconds of waiting worth one priority level")
    s.add_argument("--heartbeat-timeout", type=float, default=30.0, help="seconds of silence before a job's "
                                                                          "leases are reclaimed")
    s.add_argument("--fresh", action="store_true", help="begin with an empty state even if the state folder's "
                                                        "database is missing, empty or corrupt (moved aside)")
    s.add_argument("--start-grace", type=float, default=None, help="seconds a submitted job's worker may take to "
                                                                   "attach (default max(heartbeat timeout, 300))")
    s.add_argument("--ray", action="store_true", help="run the policy as a named Ray actor (multi-node)")
    s.add_argument("--ray-name", default="rlcu-sched", help="the Ray actor's name")
    s.add_argument("--dashboard", default=None, metavar="127.0.0.1:PORT",
                   help="also serve a live read-only web page on this loopback address (rlcu.sched.dashboard)")
    s = sub.add_parser("submit", help="register a job and start its worker")
    _addr_args(s)
    s.add_argument("config", help="job file (YAML) or a GRPO config")
    s.add_argument("--name", default=None)
    s.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override of the GRPO config")
    s.add_argument("--no-launch", action="store_true", help="only register the job (its worker is started apart)")
    s = sub.add_parser("status", help="jobs, phases, devices, memory and waits")
    _addr_args(s)
    s.add_argument("--json", action="store_true")
    s = sub.add_parser("cancel", help="cancel a job: its worker finishes the step in flight, checkpoints and "
                                      "exits (as on SIGTERM); --now ends it at once")
    _addr_args(s)
    s.add_argument("job")
    s.add_argument("--now", action="store_true", help="end the job at once: its leases are released and its "
                                                      "worker stops at its next call, losing the steps since "
                                                      "its last checkpoint")
    s = sub.add_parser("drain", help="take no new job (the live ones go on); --off takes them again")
    _addr_args(s)
    s.add_argument("--off", action="store_true")
    s = sub.add_parser("simulate", help="replay a job-mix trace through the policy in simulated time")
    s.add_argument("trace", help="trace JSON (see rlcu.sched.simulator)")
    s.add_argument("--policy", default="phase", choices=("phase", "fifo"))
    s.add_argument("--json", action="store_true", help="print the metrics as JSON")
    s.add_argument("--trace-out", default=None, help="write a Chrome/Perfetto trace of the simulated leases")
    s = sub.add_parser("trace", help="write the Chrome/Perfetto trace of every lease")
    _addr_args(s)
    s.add_argument("out")
    s = sub.add_parser("metrics", help="GPU idle fraction, jobs per hour, latency, memory, fragmentation")
    _addr_args(s)
    s.add_argument("--json", action="store_true")
    return p


def main(argv: list[str]) -> int:
    """argv[0] == "sched"."""
    from rlcu.sched.protocol import SchedError

    a = _parser().parse_args(argv[1:])
    try:
        return globals()[f"_{a.cmd}"](a)
    except SchedError as e:
        print(f"rlcu sched {a.cmd}: {e}", file=sys.stderr)
        return 1
    except BrokenPipeError:  # the output's reader went away (`| head`): rlcu.cli ends quietly
        raise
    except (ValueError, OSError) as e:
        print(f"rlcu sched {a.cmd}: {e}", file=sys.stderr)
        return 2


# ---------------------------------------------------------------------- serve
def _pool(a) -> tuple[list[float], list[str]]:
    if a.cpu_slots is not None:
        if a.gpus is not None:
            raise ValueError("give --gpus or --cpu-slots, not both")
        if a.cpu_slots < 1:
            raise ValueError(f"--cpu-slots must be >= 1, got {a.cpu_slots}")
        mem = float(a.mem) if a.mem not in (None, "auto") else 1.0
        return [mem] * a.cpu_slots, [f"cpu{i}" for i in range(a.cpu_slots)]
    import torch

    if not torch.cuda.is_available():
        raise ValueError("no CUDA device here: schedule CPU slots with --cpu-slots N")
    n = torch.cuda.device_count()
    idx = list(range(n)) if a.gpus in (None, "all") else [int(x) for x in a.gpus.split(",")]
    bad = [i for i in idx if not 0 <= i < n]
    if bad:
        raise ValueError(f"GPU {bad[0]} is not here (there are {n})")
    if a.mem not in (None, "auto"):
        cap = [float(a.mem)] * len(idx)
    else:
        cap = [torch.cuda.get_device_properties(i).total_memory / (1 << 30) for i in idx]
    return cap, [f"cuda:{i}" for i in idx]


def _serve(a) -> int:
    from rlcu.sched.client import SchedClient
    from rlcu.sched.core import Core
    from rlcu.sched.protocol import default_state_dir
    from rlcu.sched.server import SchedServer, load_token, secure_state_dir

    os.umask(0o077)  # what the service makes (database, -wal/-shm, socket, logs) is its user's alone
    state = secure_state_dir(Path(a.state) if a.state else default_state_dir())
    token = load_token(state, _token(a) or os.environ.get("RLCU_SCHED_TOKEN") or None)
    fresh = a.fresh or not (state / "sched.db").exists()
    cap, names = _pool(a) if (fresh or a.gpus or a.cpu_slots) else (None, None)
    if a.ray:
        if a.dashboard:
            raise ValueError("--dashboard serves beside the socket service, not --ray")
        from rlcu.sched.ray_backend import serve_ray

        return serve_ray(cap, names, name=a.ray_name, policy=a.policy, aging_s=a.aging_s,
                         heartbeat_timeout=a.heartbeat_timeout, state=state / "sched.db", token=token)
    core = Core(cap, state=state / "sched.db", policy=a.policy, aging_s=a.aging_s,
                heartbeat_timeout=a.heartbeat_timeout, device_names=names, fresh=a.fresh,
                start_grace_s=a.start_grace, on_fatal=lambda why: os._exit(70))  # fail fast: exit non-zero
    srv = SchedServer(core, a.addr or f"unix:{state / 'sched.sock'}", token)
    signal.signal(signal.SIGTERM, lambda *_: srv._stop.set())
    if a.dashboard:
        from rlcu.sched.dashboard import start_dashboard

        try:
            dash = start_dashboard(SchedClient(srv.address, token), a.dashboard, token)
        except (OSError, ValueError):
            srv.stop()  # the socket and the database, as on any exit
            raise
        print(f"rlcu sched: dashboard on {dash.url} (open {dash.url}?token=<state>/token once)", flush=True)
    pool = ", ".join(f"{n} ({c:.1f})" for n, c in zip(core.pool["names"], core.pool["capacity"]))
    print(f"rlcu sched: {core.pool['policy']} policy over {pool} on {srv.address}; state {state}", flush=True)
    if not fresh:
        live = [j for j in core.jobs.values() if j.state in ("queued", "running", "stopping")]
        print(f"rlcu sched: recovered {len(live)} live jobs and {len(core.pol.leases)} leases", flush=True)
    try:
        srv.serve_forever()
    except KeyboardInterrupt:
        pass
    return 0


# ---------------------------------------------------------------------- submit
def _job_file(path: Path, overrides: list[str]) -> dict:
    import yaml

    try:
        d = yaml.safe_load(path.read_text()) or {}
    except FileNotFoundError:
        raise ValueError(f"no file {path}") from None
    if not isinstance(d, dict):
        raise ValueError(f"{path}: a job file is a mapping")
    if not set(d) <= JOB_KEYS:  # not a job file: the GRPO config itself
        d = {"grpo": str(path)}
    elif "grpo" in d:
        d["grpo"] = str((path.parent / d["grpo"]).resolve())
    if ("grpo" in d) == ("command" in d):
        raise ValueError(f"{path}: a job file needs one of grpo (a GRPO config) or command")
    if "command" in d and not d.get("clusters"):
        raise ValueError(f"{path}: a command job needs clusters, e.g. {{actor: {{devices: 1}}}}")
    d["set"] = list(d.get("set") or []) + list(overrides)
    return d


def _submit(a) -> int:
    from rlcu.sched.protocol import default_state_dir, parse_address

    path = Path(a.config)
    job = _job_file(path, a.overrides)
    name = a.name or job.get("name") or path.stem
    client = _client(a)
    if "grpo" in job:
        from rlcu.config import GRPOConfig, load_config
        from rlcu.sched.job import job_memory

        n = job.get("ranks", 1)
        if not isinstance(n, int) or isinstance(n, bool) or n < 1:
            raise ValueError(f"{path}: ranks must be an integer >= 1 (data-parallel ranks, one device each), got {n!r}")
        clusters, mem = job_memory(load_config(GRPOConfig, job["grpo"], job["set"]), job.get("mem"), devices=n)
        run = ([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(n)]
               if n > 1 else [sys.executable])  # one job, its leases spanning the n ranks' devices
        cmd = [*run, "-m", "rlcu.sched.job", "--config", job["grpo"], "--addr", "{addr}", "--name",
               "{name}", "--attach", *[f"--set={s}" for s in job["set"]], *[f"--mem={k}={v}" for k, v in mem.items()]]
    else:
        clusters, cmd = job["clusters"], [str(x) for x in job["command"]]
    secret = client.submit(name, clusters, {"command": cmd, "file": str(path)})["secret"]
    addr = client.addr
    if a.no_launch:
        print(f"submitted {name} (not launched)")
        return 0
    kind, where = parse_address(addr)
    logs = (Path(where).parent if kind == "unix" else default_state_dir()) / "logs"
    logs.mkdir(mode=0o700, parents=True, exist_ok=True)
    log = logs / f"{name}.log"
    env = {k: v for k, v in os.environ.items() if k != "RLCU_SCHED_TOKEN"}  # the worker acts with its secret
    env.update(RLCU_SCHED_ADDR=addr, RLCU_SCHED_JOB=name, RLCU_SCHED_JOB_SECRET=secret)
    argv = [x.replace("{addr}", addr).replace("{name}", name) for x in cmd]
    with os.fdopen(os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600), "ab") as f:
        proc = subprocess.Popen(argv, stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
                                start_new_session=True)
    print(f"submitted {name}: worker pid {proc.pid}, log {log}")
    return 0


# ---------------------------------------------------------------------- status, cancel, metrics, trace
def _fmt_s(x: float) -> str:
    return f"{x:.0f}s" if x < 120 else f"{x / 60:.1f}m" if x < 7200 else f"{x / 3600:.1f}h"


def _status(a) -> int:
    st = _client(a).status()
    if a.json:
        print(json.dumps(st, indent=2))
        return 0
    from rich.console import Console
    from rich.table import Table

    con = Console()
    t = Table(title=f"rlcu sched: {st['policy']} policy")
    for col in ("job", "state", "phases", "devices", "memory", "waiting", "waited", "age"):
        t.add_column(col, justify="right" if col in ("memory", "waited", "age") else "left")
    for j in st["jobs"]:
        waiting = ", ".join(f"{w['phase']} {_fmt_s(w['for_s'])}" for w in j["waiting"])
        t.add_row(j["job"], j["state"], ", ".join(j["phases"]) or "-", ", ".join(j["devices"]) or "-",
                  f"{j['mem']:.1f}" if j["mem"] else "-", waiting or "-", _fmt_s(j["wait_s"]), _fmt_s(j["age_s"]))
    con.print(t)
    d = Table(title="devices")
    for col in ("device", "used / capacity", "leases"):
        d.add_column(col)
    for dev in st["devices"]:
        d.add_row(dev["name"], f"{dev['used']:.1f} / {dev['capacity']:.1f}", ", ".join(dev["leases"]) or "-")
    con.print(d)
    m = st["metrics"]
    con.print(f"idle {m['gpu_idle_frac']:.1%}  jobs/h {m['jobs_per_hour']:.2f}  mean latency "
              f"{_fmt_s(m['mean_latency_s'])}  memory in use {m['mem_used_frac']:.1%} (avg)  "
              f"fragmentation {m['frag_now']:.2f} now, {m['frag']:.2f} avg  yields {m['yields']}")
    return 0


def _cancel(a) -> int:
    v = _client(a).cancel(a.job, graceful=not a.now)
    more = (": it stops after the step in flight and a checkpoint (`rlcu sched cancel --now` ends it at once)"
            if v["state"] == "stopping" else "")
    print(f"{a.job}: {v['state']}{more}")
    return 0


def _drain(a) -> int:
    r = _client(a).drain(not a.off)
    print("draining: no new job is taken" if r["draining"] else "taking new jobs")
    return 0


def _metrics(a) -> int:
    m = _client(a).metrics()
    m.pop("ok", None)
    if a.json:
        print(json.dumps(m, indent=2))
    else:
        for k, v in m.items():
            print(f"{k:<16} {_metric_text(k, v)}")
    return 0


def _metric_text(key: str, v) -> str:
    """A metric as a person reads it: the service's start (t0, an epoch in --json) as a local
    date and time, durations as 42s / 3.5m / 2.1h, fractions as percentages."""
    if key == "t0" and isinstance(v, (int, float)):
        return time.strftime("%Y-%m-%d %H:%M:%S %Z", time.localtime(v))
    if key.endswith("_s") and isinstance(v, (int, float)):
        return _fmt_s(v)
    if key.endswith("_frac") and isinstance(v, (int, float)):
        return f"{v:.1%}"
    if isinstance(v, list):
        return ", ".join(f"{x:.2f}" if isinstance(x, float) else str(x) for x in v)
    return f"{v:.4f}" if isinstance(v, float) else str(v)


def _trace(a) -> int:
    from rlcu.sched.metrics import write_trace

    p = write_trace(a.out, _client(a).trace())
    print(f"wrote {p} (open in ui.perfetto.dev or chrome://tracing)")
    return 0


def _simulate(a) -> int:
    from rlcu.sched.metrics import write_trace
    from rlcu.sched.simulator import (
        TraceError,
        load_trace,
        public,
        report,
        simulate,
        trace_of,
    )

    try:
        res = simulate(load_trace(a.trace), a.policy)
    except TraceError as e:
        print(f"rlcu sched simulate: {e}", file=sys.stderr)
        return 2
    if a.trace_out:
        write_trace(a.trace_out, trace_of(res))
    print(json.dumps(public(res), indent=2) if a.json else report(res))
    return 0
