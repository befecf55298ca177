"""Phase-aware multi-job GPU scheduler: several RL jobs share GPUs.

An RL step has a memory-bound phase (rollout) and compute-bound phases (training, logprobs);
a scheduler that knows each job's phase overlaps them across jobs. The pieces:

    pool.py        the books: devices with memory, jobs, clusters, requests, leases
    policy.py      the policy (phase-aware sharing, and the FIFO-exclusive baseline): pure
    simulator.py   replay a job-mix trace through the policy in simulated time
    metrics.py     idle fraction, jobs/hour, latency, memory, fragmentation, Chrome trace
    store.py       the service's state in SQLite (the `Job` record, group commit, retention)
    core.py        the service's logic (transport-free): dispatch, transactions, audits, ticks
    ops.py         its operations (register, request, release, wait, ...)
    views.py       what it shows: a job's view, status, metrics, `Snapshot`
    server.py      Unix-socket / loopback-TCP transport;  ray_backend.py: the Ray actor
    client.py      the Python API jobs use;  job.py: a GRPO job under the scheduler
    cli.py         `rlcu sched serve|submit|status|cancel|simulate|trace|metrics`

Submodules are imported on first use, so `import rlcu.sched` is light.
"""

import importlib

_LAZY = {
    "PhasePolicy": "rlcu.sched.policy", "FifoPolicy": "rlcu.sched.policy", "make_policy": "rlcu.sched.policy",
    "PolicyError": "rlcu.sched.pool", "PHASES": "rlcu.sched.pool",
    "simulate": "rlcu.sched.simulator", "load_trace": "rlcu.sched.simulator",
    "Core": "rlcu.sched.core", "SchedServer": "rlcu.sched.server",
    "SchedClient": "rlcu.sched.client", "JobHandle": "rlcu.sched.client", "SchedError": "rlcu.sched.client",
    "JobEnded": "rlcu.sched.client",
    "ScheduledGRPO": "rlcu.sched.job", "run_grpo": "rlcu.sched.job",
}


def __getattr__(name):
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'rlcu.sched' has no attribute {name!r}")
