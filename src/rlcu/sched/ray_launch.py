"""Start a GRPO job on a Ray cluster under the scheduler's Ray actor (the jobs layer: it
uses the client and the GRPO job, and nothing of the services).

    actor, done = launch_grpo("grpo.yaml", "exp-1")            # ray.get(done): its last metrics

`launch_grpo` first places the job's cluster (its `init` phase, from the driver), then starts
the job's actor on the node that holds the leased device, where the job attaches with its
secret, asks for init again on those devices and goes on as any job does (rlcu.sched.job).
"""

from __future__ import annotations

from rlcu.sched.client import SchedClient, import_ray
from rlcu.sched.job import grpo_config, job_memory, run_grpo


class _GRPOJobActor:
    def run(self, config, addr, name, overrides, mem, secret, trainer_kw):
        client = SchedClient(addr)
        client.set_secret(name, secret)
        hist = run_grpo(config, addr, name, overrides=overrides, attach=True, mem=mem, client=client, threads=True,
                        **trainer_kw)  # (threads: the actor's process is the job's own)
        return hist[-1] if hist else {}


def launch_grpo(config, name: str, *, addr: str = "ray:rlcu-sched", overrides=(), mem: dict | None = None,
                **trainer_kw):
    """Place a GRPO job (its init phase, from here), then run it as a Ray actor on the node
    of its leased device. Returns (actor, ObjectRef of its last metrics)."""
    ray = import_ray()
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy  # ray: an optional package

    clusters, mem = job_memory(grpo_config(config, overrides), mem)
    client = SchedClient(addr)
    h = client.job(name, clusters, spec={"kind": "grpo", "mem": mem}, heartbeat_s=2.0)
    lease = h.acquire("init", mem=mem["init"])  # places the cluster: its resident memory stays
    h.release(lease)
    h.close()
    node = lease.names[0].rsplit("/", 1)[0] if "/" in lease.names[0] else None
    opts = {"num_cpus": 1, "num_gpus": 0}
    if node:
        opts["scheduling_strategy"] = NodeAffinitySchedulingStrategy(node, soft=False)
    actor = ray.remote(_GRPOJobActor).options(**opts).remote()
    return actor, actor.run.remote(config, addr, name, list(overrides), mem, h.secret, trainer_kw)
