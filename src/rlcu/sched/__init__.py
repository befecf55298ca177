"""Phase-aware multi-job GPU scheduler: several RL jobs share GPUs.

An RL step has a memory-bound phase (rollout) and compute-bound phases (training, logprobs);
a scheduler that knows each job's phase overlaps them across jobs. The pieces:

    pool.py        the books: devices with memory, jobs, clusters, requests, leases
    policy.py      the policy (phase-aware sharing, and the FIFO-exclusive baseline): pure
    simulator.py   replay a job-mix trace through the policy in simulated time
    metrics.py     idle fraction, jobs/hour, latency, memory, fragmentation, Chrome trace
    store.py       the service's state in SQLite (the `Job` record, group commit, retention)
    core.py        the service's logic (transport-free): its books, dispatch, transactions, audits,
                   ticks (recovery.py: loading the books)
    ops.py         its verbs (register, request, release, wait, ...): an object holding the core
    views.py       what it shows: a job's view, status, metrics, `Snapshot`

and, in one-way layers (each imports only those above it):

    protocol.py    messages, errors, addresses, frames, every op's field schema
    auth.py        the handshake: challenge-response proofs of the token and job secrets
    transport.py   the client's socket transport: kept connections, one per thread
    client.py      the Python API jobs use (on the socket transport, or Ray's)
    service.py     the services' front door: authority (token, job secrets), op ids
    server.py      Unix-socket / loopback-TCP service (conns.py: its connections, their
                   admission and replies);  ray_backend.py: the Ray actor service
    job.py         a GRPO job under the scheduler;  ray_launch.py: one started on a Ray cluster
    cli.py         `rlcu sched serve|submit|status|cancel|drain|simulate|trace|metrics`

Submodules are imported on first use, so `import rlcu.sched` is light.
"""

import importlib

_LAZY = {
    "PhasePolicy": "rlcu.sched.policy", "FifoPolicy": "rlcu.sched.policy", "make_policy": "rlcu.sched.policy",
    "PolicyError": "rlcu.sched.pool", "PHASES": "rlcu.sched.pool",
    "simulate": "rlcu.sched.simulator", "load_trace": "rlcu.sched.simulator",
    "Core": "rlcu.sched.core", "SchedServer": "rlcu.sched.server",
    "SchedClient": "rlcu.sched.client", "JobHandle": "rlcu.sched.client", "LeaseLost": "rlcu.sched.client",
    "SchedError": "rlcu.sched.protocol", "JobEnded": "rlcu.sched.protocol", "Front": "rlcu.sched.service",
    "ScheduledGRPO": "rlcu.sched.job", "run_grpo": "rlcu.sched.job", "launch_grpo": "rlcu.sched.ray_launch",
}


def __getattr__(name):
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'rlcu.sched' has no attribute {name!r}")
