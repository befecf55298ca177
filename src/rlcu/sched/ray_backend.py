"""`rlcu sched serve --ray`: the same scheduler as a named Ray actor, for several machines.

The actor wraps one `Core` (the same policy, state and operations as the socket service)
and answers `handle(msg)` from many callers at once (a threaded actor; the core has its own
lock, and `wait` long-polls inside it). Clients reach it by name:

    SchedClient("ray:rlcu-sched")              # from any process attached to the Ray cluster

The pool is every GPU of every alive node (device names "NODE_ID/cuda:K"), or CPU slots.
Jobs run as Ray actors with `num_gpus=0`: Ray places the process, the rlcu scheduler shares
the GPU. `launch_grpo` first places the job's cluster (its `init` phase, from the driver),
then starts the job's actor on the node that holds the leased device, where the job asks for
init again on those devices and goes on as any job does (rlcu.sched.job).
"""

from __future__ import annotations

import os
import threading
import time

NAMESPACE = "rlcu"


def _ray():
    try:
        import ray
    except ImportError:
        raise ImportError("`--ray` needs Ray: pip install ray") from None
    return ray


class _CoreActor:
    """The Core behind a threaded Ray actor, with its heartbeat ticker."""

    def __init__(self, capacity, names, policy, aging_s, heartbeat_timeout, state, tick_s):
        from rlcu.sched.core import Core

        self.core = Core(capacity, state=state, policy=policy, aging_s=aging_s, heartbeat_timeout=heartbeat_timeout,
                         device_names=names)
        self._stop = threading.Event()
        tick = tick_s if tick_s is not None else max(0.05, min(1.0, heartbeat_timeout / 4))
        self._ticker = threading.Thread(target=self._tick, args=(tick,), daemon=True)
        self._ticker.start()

    def _tick(self, every: float) -> None:
        while not self._stop.wait(every):
            self.core.tick()

    def handle(self, msg: dict) -> dict:
        return self.core.handle(msg)

    def pool(self) -> dict:
        return dict(self.core.pool)

    def stop(self) -> None:
        self._stop.set()
        self._ticker.join(timeout=5)
        self.core.close()


def start_actor(capacity, names=None, *, name: str = "rlcu-sched", policy: str = "phase", aging_s: float = 60.0,
                heartbeat_timeout: float = 30.0, state=None, tick_s: float | None = None, detached: bool = False):
    """Start the scheduler actor (named, in namespace "rlcu"); returns its handle."""
    ray = _ray()
    cls = ray.remote(num_cpus=0, max_concurrency=256)(_CoreActor)
    opts = {"name": name, "namespace": NAMESPACE}
    if detached:
        opts["lifetime"] = "detached"
    h = cls.options(**opts).remote(capacity, names, policy, aging_s, heartbeat_timeout,
                                   None if state is None else str(state), tick_s)
    ray.get(h.pool.remote())  # raises here if the core refused its arguments
    return h


def get_actor(name: str = "rlcu-sched"):
    return _ray().get_actor(name, namespace=NAMESPACE)


class RayTransport:
    """SchedClient transport to the actor: RayTransport("ray:NAME") or RayTransport(handle)."""

    def __init__(self, target):
        from rlcu.sched.client import parse_address

        self.actor = get_actor(parse_address(target)[1]) if isinstance(target, str) else target

    def call(self, msg: dict) -> dict:
        ray = _ray()
        try:
            return ray.get(self.actor.handle.remote(msg))
        except ray.exceptions.RayActorError as e:
            from rlcu.sched.client import SchedError

            raise SchedError(f"the scheduler actor is gone: {e}", "unavailable") from None


def ray_gpu_pool(mem_gib: float | None = None) -> tuple[list[float], list[str]]:
    """Every GPU of every alive node: capacities (GiB; probed on each node unless given) and
    names "NODE_ID/cuda:K"."""
    ray = _ray()
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    @ray.remote(num_cpus=0, num_gpus=0)
    def probe():
        import torch

        return [torch.cuda.get_device_properties(i).total_memory / (1 << 30) for i in range(torch.cuda.device_count())]

    cap, names = [], []
    for node in sorted(ray.nodes(), key=lambda n: n["NodeID"]):
        n = int(node.get("Resources", {}).get("GPU", 0)) if node.get("Alive") else 0
        if n == 0:
            continue
        mems = [mem_gib] * n if mem_gib else ray.get(probe.options(
            scheduling_strategy=NodeAffinitySchedulingStrategy(node["NodeID"], soft=False)).remote())[:n]
        cap += mems
        names += [f"{node['NodeID']}/cuda:{k}" for k in range(n)]
    if not cap:
        raise ValueError("the Ray cluster has no GPU: schedule CPU slots with --cpu-slots N")
    return cap, names


def serve_ray(capacity, names, *, name: str = "rlcu-sched", policy: str = "phase", aging_s: float = 60.0,
              heartbeat_timeout: float = 30.0, state=None) -> int:
    """The CLI's `serve --ray`: join (or start) a Ray cluster, start the named actor, stay
    until interrupted (the actor lives while this process does)."""
    ray = _ray()
    ray.init(address=os.environ.get("RAY_ADDRESS"), namespace=NAMESPACE, log_to_driver=False)
    if capacity is None:
        capacity, names = ray_gpu_pool()
    h = start_actor(capacity, names, name=name, policy=policy, aging_s=aging_s, heartbeat_timeout=heartbeat_timeout,
                    state=state)
    print(f"rlcu sched: {policy} policy over {len(capacity)} devices as Ray actor {name!r} "
          f"(clients: SchedClient('ray:{name}'))", flush=True)
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        ray.get(h.stop.remote())
    return 0


class _GRPOJobActor:
    def run(self, config, addr, name, overrides, mem, trainer_kw):
        from rlcu.sched.job import run_grpo

        hist = run_grpo(config, addr, name, overrides=overrides, attach=True, mem=mem, **trainer_kw)
        return hist[-1] if hist else {}


def launch_grpo(config, name: str, *, addr: str = "ray:rlcu-sched", overrides=(), mem: dict | None = None,
                **trainer_kw):
    """Place a GRPO job (its init phase, from here), then run it as a Ray actor on the node
    of its leased device. Returns (actor, ObjectRef of its last metrics)."""
    ray = _ray()
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    from rlcu.config import load_config
    from rlcu.sched.client import SchedClient
    from rlcu.sched.job import job_memory
    from rlcu.train.core import coerce_config
    from rlcu.train.rl_config import GRPOConfig

    cfg = coerce_config(GRPOConfig, config) if not isinstance(config, str) else load_config(GRPOConfig, config,
                                                                                      list(overrides))
    clusters, mem = job_memory(cfg, mem)
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
    return actor, actor.run.remote(config, addr, name, list(overrides), mem, trainer_kw)
