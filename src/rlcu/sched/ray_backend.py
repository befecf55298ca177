"""`rlcu sched serve --ray`: the same scheduler as a named Ray actor, for several machines.

The actor wraps one `Core` behind the same `Front` as the socket service (service.py: the
same authority, field validation, op ids and error replies) and answers `handle(msg)` from
many callers at once (a threaded actor of `CONCURRENCY` threads; the core has its own lock,
and `wait` long-polls inside it, holding a thread). So that waits cannot take every thread
(and leave a grant, or any other call, unanswered), one job holds at most `JOB_WAITS` of them
and all jobs together `CONCURRENCY - 64`; a wait beyond is answered "busy" (the client tries
again). A ticker that fails ends the actor's process (fail fast). Clients reach it by name
(the client's RayTransport):

    SchedClient("ray:rlcu-sched")              # from any process attached to the Ray cluster

`serve --ray` gives the actor the state folder's token: registering jobs and the admin ops
need it ($RLCU_SCHED_TOKEN where the file is not at hand); a job's own ops need only its
secret, which `launch_grpo` hands to the job's actor. Neither goes to the actor: a caller's
first call is a `hello` whose answer proves the actor knows the key (an impostor that took
the actor's name learns nothing), and its messages then carry proofs bound to that session
(auth.py; the actor keeps the last 4096 sessions, and a caller it forgot says hello again).

The pool is every GPU of every alive node (device names "NODE_ID/cuda:K"), or CPU slots.
Jobs run as Ray actors with `num_gpus=0`: Ray places the process, the rlcu scheduler shares
the GPU; `rlcu.sched.ray_launch.launch_grpo` starts a GRPO job so (a job, not a service:
it lives in the layer above).
"""

from __future__ import annotations

import os
import sys
import threading
import time
import traceback

from rlcu.sched.client import RAY_NAMESPACE, RayTransport, import_ray
from rlcu.sched.core import Core
from rlcu.sched.protocol import SchedError, error
from rlcu.sched.service import Front

NAMESPACE = RAY_NAMESPACE
CONCURRENCY = 256  # the actor's threads
JOB_WAITS = 16  # the waits one job may hold at once (as the socket service's connections per job)
__all__ = ["NAMESPACE", "RayTransport", "get_actor", "ray_gpu_pool", "serve_ray", "start_actor"]


class _CoreActor:
    """The Core behind a threaded Ray actor and the same Front as the socket service
    (authority, validation, op ids), with its heartbeat ticker."""

    def __init__(self, capacity, names, policy, aging_s, heartbeat_timeout, state, tick_s, token=None):
        self.core = Core(capacity, state=state, policy=policy, aging_s=aging_s, heartbeat_timeout=heartbeat_timeout,
                         device_names=names)
        self.front = Front(self.core, token)
        self._waits: dict[str, int] = {}  # job -> its waits in progress (each holds a thread)
        self._waits_lock = threading.Lock()
        self._stop = threading.Event()
        tick = tick_s if tick_s is not None else max(0.05, min(1.0, heartbeat_timeout / 4))
        self._ticker = threading.Thread(target=self._tick, args=(tick,), daemon=True)
        self._ticker.start()

    def _tick(self, every: float) -> None:
        try:
            self.core.run_ticks(self._stop, every)  # a failing tick is reported and the loop goes on
        except BaseException:  # noqa: BLE001  (fail fast: a service that cannot reclaim must not go on answering)
            if not self._stop.is_set():
                traceback.print_exc()
                sys.stderr.flush()
                os._exit(70)

    def hello(self, msg) -> dict:
        """A caller's handshake (auth.py): the session its messages then name."""
        return self.front.hello(msg, keep=True)[0]

    def handle(self, msg) -> dict:
        if not isinstance(msg, dict) or msg.get("op") != "wait":
            return self.front.handle(msg)
        try:  # (whose wait it is, known before it may hold a thread)
            job = self.front.authenticate(msg, self.front.session(msg))
        except SchedError:
            return self.front.handle(msg)  # its error reply
        with self._waits_lock:
            mine, held = self._waits.get(job, 0), sum(self._waits.values())
            if mine >= JOB_WAITS or held >= CONCURRENCY - 64:
                return error(f"too many waits in progress ({mine} of job {job!r}, at most {JOB_WAITS}; {held} in "
                             f"all, at most {CONCURRENCY - 64}): try again", "busy")
            self._waits[job] = mine + 1
        try:
            return self.front.handle(msg)
        finally:
            with self._waits_lock:
                self._waits[job] -= 1
                if not self._waits[job]:
                    del self._waits[job]

    def pool(self) -> dict:
        return dict(self.core.pool)

    def stop(self) -> None:
        self._stop.set()
        self._ticker.join(timeout=5)
        self.core.close()


def start_actor(capacity, names=None, *, name: str = "rlcu-sched", policy: str = "phase", aging_s: float = 60.0,
                heartbeat_timeout: float = 30.0, state=None, tick_s: float | None = None, detached: bool = False,
                token: str | None = None):
    """Start the scheduler actor (named, in namespace "rlcu"); returns its handle. token:
    the admin token callers must give (None: anyone on the Ray cluster is admin; jobs still
    act only with their secrets)."""
    ray = import_ray()
    cls = ray.remote(num_cpus=0, max_concurrency=CONCURRENCY)(_CoreActor)
    opts = {"name": name, "namespace": NAMESPACE}
    if detached:
        opts["lifetime"] = "detached"
    h = cls.options(**opts).remote(capacity, names, policy, aging_s, heartbeat_timeout,
                                   None if state is None else str(state), tick_s, token)
    ray.get(h.pool.remote())  # raises here if the core refused its arguments
    return h


def get_actor(name: str = "rlcu-sched"):
    return import_ray().get_actor(name, namespace=NAMESPACE)


def ray_gpu_pool(mem_gib: float | None = None) -> tuple[list[float], list[str]]:
    """Every GPU of every alive node: capacities (GiB; probed on each node unless given) and
    names "NODE_ID/cuda:K"."""
    ray = import_ray()
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
              heartbeat_timeout: float = 30.0, state=None, token: str | None = None) -> int:
    """The CLI's `serve --ray`: join (or start) a Ray cluster, start the named actor, stay
    until interrupted (the actor lives while this process does)."""
    ray = import_ray()
    ray.init(address=os.environ.get("RAY_ADDRESS"), namespace=NAMESPACE, log_to_driver=False)
    if capacity is None:
        capacity, names = ray_gpu_pool()
    h = start_actor(capacity, names, name=name, policy=policy, aging_s=aging_s, heartbeat_timeout=heartbeat_timeout,
                    state=state, token=token)
    print(f"rlcu sched: {policy} policy over {len(capacity)} devices as Ray actor {name!r} "
          f"(clients: SchedClient('ray:{name}'))", flush=True)
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        ray.get(h.stop.remote())
    return 0
