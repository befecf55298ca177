"""The Python API jobs use to talk to the scheduler.

    client = SchedClient("unix:/path/sched.sock")            # or "127.0.0.1:7777", "ray:rlcu-sched"
    job = client.job("exp-1", {"actor": {"devices": 1, "resident": 12, "peak": 40}})
    with job.phase("init", mem=4):
        ...build the model...
    lease = job.acquire("rollout", mem=30, work=4096)
    while generating:
        if job.should_yield(lease):      # a higher phase needs the memory: stop at a step boundary
            job.release(lease); ...sleep the engine...; lease = job.acquire("rollout", ...)
    job.release(lease)
    job.finish()

Messages are framed by protocol.py; each thread keeps one connection to the service and
reuses it for all its calls (reconnecting when the service closed it). Authority: the
service token registers jobs and runs admin ops; `register` returns the job's secret,
which the client keeps and proves with every op of that job (a worker
started by `rlcu sched submit` gets it in $RLCU_SCHED_JOB_SECRET). Neither the token nor a
secret is ever sent: each connection (Ray session) opens with a handshake in which the
service proves it knows the key first, and the client then sends proofs bound to it (auth.py).

Faults. Every call carries an operation id; a call that finds no service (refused, reset,
closed without a reply, "busy", "unavailable") is sent again with the same id, marked as a
retry, until `retry_s` has passed, so a service restarted on the same state within that
bound is found again and no request or release happens twice (a kept connection found
closed before a send is replaced silently; one that breaks under a call is replaced and the
call resent at once, the same way). A `JobHandle` heartbeats
from a daemon thread; `should_yield` reads the latest view of the job (refreshing it at most
every `poll_s`). A job the service ended (cancelled, reclaimed as dead) raises `JobEnded`
from its next call; a lease the job believes held but the service does not raises
`LeaseLost`.

Token: given, else read from `token_file`, else $RLCU_SCHED_TOKEN, else the `token` file
beside a Unix socket, else the one in the default state folder ($RLCU_SCHED_DIR or
~/.rlcu/sched).
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import os
import secrets
import socket
import threading
import time
from pathlib import Path

from rlcu.sched.auth import Handshake
from rlcu.sched.protocol import (
    MUTATING,
    JobEnded,
    SchedError,
    default_address,
    default_state_dir,
    parse_address,
    raise_for,
)
from rlcu.sched.transport import SocketTransport

__all__ = ["JobEnded", "JobHandle", "LeaseInfo", "LeaseLost", "RayTransport", "SchedClient", "SchedError",
           "SocketTransport", "default_address", "default_state_dir", "find_token", "parse_address"]
RAY_NAMESPACE = "rlcu"
_RETRY_CODES = ("unavailable", "busy")


class LeaseLost(SchedError):
    """A lease the job holds by its own books is no longer held by the service."""


def find_token(addr: str, token: str | None = None, token_file: str | Path | None = None) -> str | None:
    if token:
        return token
    if token_file:
        try:
            return _nonempty(Path(token_file).read_text(), token_file)
        except OSError as e:
            raise SchedError(f"cannot read the token file {token_file}: {e.strerror}") from None
    if os.environ.get("RLCU_SCHED_TOKEN"):
        return os.environ["RLCU_SCHED_TOKEN"]
    kind, where = parse_address(addr)
    places = [Path(where).parent / "token"] if kind == "unix" else []
    places.append(default_state_dir() / "token")
    for p in places:
        try:
            return _nonempty(p.read_text(), p)
        except OSError:
            continue
    return None


def _nonempty(text: str, path) -> str:
    """A token file's token; an empty one is refused, never sent as the token "" (anyone's)."""
    if not text.strip():
        raise SchedError(f"the token file {path} is empty: it must hold the service's token")
    return text.strip()


class RayTransport:
    """SchedClient transport to the scheduler's Ray actor: RayTransport("ray:NAME") or
    RayTransport(handle). Ray itself is imported only here, on first use. The actor has no
    connections, so the handshake (auth.py) makes a session, named by the service's nonce in
    every message; a session the actor forgot (restarted) is made again at once."""

    def __init__(self, target, token: str | None = None):
        self.token = token
        self.where = target if isinstance(target, str) else "the scheduler's Ray actor"
        if isinstance(target, str):
            ray = import_ray()
            self.actor = ray.get_actor(parse_address(target)[1], namespace=RAY_NAMESPACE)
        else:
            self.actor = target
        self._auth: Handshake | None = None
        self._lock = threading.Lock()

    def call(self, msg: dict, retry_s: float | None = None) -> dict:
        ray = import_ray()
        if "token" not in msg and "secret" not in msg and self.token is not None:
            msg = {**msg, "token": self.token}
        try:
            for _ in range(2):
                auth = self._session(ray, msg)
                reply = ray.get(self.actor.handle.remote({**auth.sign(msg), "session": auth.snonce}))
                if reply.get("code") != "hello":
                    return reply
                with self._lock:  # (forgotten by the actor: a new handshake, once)
                    self._auth = None if self._auth is auth else self._auth
            return reply
        except ray.exceptions.RayActorError as e:
            raise SchedError(f"the scheduler actor is gone: {e}", "unavailable") from None

    def _session(self, ray, msg: dict) -> Handshake:
        with self._lock:
            if self._auth is None:
                auth = Handshake(msg, self.token)
                auth.accept(ray.get(self.actor.hello.remote(auth.hello)), self.where)
                self._auth = auth
            return self._auth


def import_ray():
    try:
        import ray
    except ImportError:
        raise ImportError("a ray: scheduler address needs Ray: pip install ray") from None
    return ray


@dataclasses.dataclass(frozen=True)
class LeaseInfo:
    id: int
    phase: str
    cluster: str
    devices: tuple[int, ...]
    names: tuple[str, ...]
    mem: tuple[float, ...]
    start: float

    @classmethod
    def of(cls, d: dict) -> LeaseInfo:
        return cls(d["id"], d["phase"], d["cluster"], tuple(d["devices"]), tuple(d["names"]), tuple(d["mem"]),
                   d["start"])


class SchedClient:
    def __init__(self, addr: str | None = None, token: str | None = None, *, token_file: str | Path | None = None,
                 transport=None, timeout: float = 30.0, retry_s: float = 30.0, keep_alive: bool = True):
        self.addr = addr or default_address()
        self.retry_s = retry_s
        if transport is None:
            tok = find_token(self.addr, token, token_file)
            if parse_address(self.addr)[0] == "ray":
                transport = RayTransport(self.addr, tok)
            else:
                transport = SocketTransport(self.addr, tok, timeout, retry_s, keep_alive=keep_alive)
        self.transport = transport
        self._secrets: dict[str, str] = {}
        self._cid = secrets.token_hex(4)
        self._seq = itertools.count(1)
        self._retries = 0

    @property
    def retries(self) -> int:
        """Calls sent again after a lost reply (here, and by the transport at once when a kept
        connection broke under a call)."""
        return self._retries + getattr(self.transport, "resent", 0)

    def set_secret(self, job: str, secret: str) -> None:
        """Act for `job` with its secret (a worker given it by whoever registered the job)."""
        self._secrets[job] = secret

    def call(self, op: str, *, retry_s: float | None = None, **args) -> dict:
        """One op; resent with the same operation id while the service is away (retry_s)."""
        msg = {"op": op, **{k: v for k, v in args.items() if v is not None}}
        if op in MUTATING:
            msg["id"] = f"{self._cid}-{next(self._seq)}"
        job = msg.get("job")
        if isinstance(job, str) and job in self._secrets and (op != "register" or msg.get("attach")):
            msg["secret"] = self._secrets[job]
        budget = self.retry_s if retry_s is None else retry_s
        end = time.monotonic() + budget
        pause = 0.05
        while True:
            try:
                reply = self.transport.call(msg, max(0.0, end - time.monotonic()))
            except SchedError as e:
                if e.code not in _RETRY_CODES or time.monotonic() >= end or not getattr(self.transport, "reached", 1):
                    raise
                reply = None
            if reply is not None and (reply.get("ok") or reply.get("code") not in _RETRY_CODES
                                      or time.monotonic() >= end):
                break
            time.sleep(min(pause, max(0.0, end - time.monotonic())))
            pause = min(1.0, pause * 2)
            msg["retry"] = True
            self._retries += 1
        raise_for(reply)
        if op == "register" and isinstance(reply.get("secret"), str):
            self._secrets[msg["job"]] = reply["secret"]
        return reply

    def close(self) -> None:
        """Close the calling thread's kept connection (others close with their threads)."""
        close = getattr(self.transport, "close", None)
        if close is not None:
            close()

    # ------------------------------------------------------------------ admin
    def ping(self) -> dict:
        return self.call("ping")

    def status(self) -> dict:
        return self.call("status")

    def metrics(self) -> dict:
        return self.call("metrics")

    def trace(self) -> dict:
        return self.call("trace")["trace"]

    def cancel(self, job: str, graceful: bool = False) -> dict:
        """End `job` now, or (graceful) ask it to stop after the step in flight and a checkpoint."""
        return self.call("cancel", job=job, graceful=graceful or None)

    def drain(self, on: bool = True) -> dict:
        """Stop (on) or go on (off) taking new jobs; the live ones go on."""
        return self.call("drain", on=on)

    def submit(self, job: str, clusters: dict, spec: dict | None = None) -> dict:
        """Register a job whose worker attaches later (`job(..., attach=True)`); the reply's
        `secret` is what the worker needs."""
        return self.call("register", job=job, clusters=clusters, spec=spec, queued=True)

    def job(self, name: str, clusters: dict | None = None, *, spec: dict | None = None, attach: bool = False,
            heartbeat_s: float = 2.0, poll_s: float = 0.1, secret: str | None = None) -> JobHandle:
        """Register a job (or attach to one: with the secret given here, in $RLCU_SCHED_JOB_SECRET
        when $RLCU_SCHED_JOB names it, or with the service token while it is queued)."""
        secret = secret or (os.environ.get("RLCU_SCHED_JOB_SECRET") if os.environ.get("RLCU_SCHED_JOB") == name
                            else None)
        if secret:
            self.set_secret(name, secret)
        view = self.call("register", job=name, clusters=clusters or {}, spec=spec, pid=os.getpid(),
                         host=socket.gethostname()[:255], attach=attach)
        return JobHandle(self, name, view, heartbeat_s, poll_s)


def pool_devices(client: SchedClient) -> list[dict] | None:
    """The service's devices (`status`), or None when this client may not read them: `status`
    needs the service token, which a worker holding only its job's secret lacks."""
    try:
        return client.status()["devices"]
    except SchedError as e:
        if e.code != "auth":
            raise
        return None


_VIEW = ("job", "state", "version", "leases", "pending")
STOP_REASON = "cancelled by the scheduler (rlcu sched cancel)"  # a stopping job's, in its log and exit


class JobHandle:
    """One job's side of the protocol: acquire/release phases, heartbeat, yield notices."""

    def __init__(self, client: SchedClient, name: str, view: dict, heartbeat_s: float, poll_s: float):
        self.client, self.name, self.poll_s = client, name, poll_s
        self.heartbeat_s = heartbeat_s
        self.view, self._seen = {k: view[k] for k in _VIEW}, time.monotonic()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._hb = threading.Thread(target=self._beat, args=(heartbeat_s,), name=f"sched-heartbeat-{name}",
                                    daemon=True)
        self._hb.start()

    @property
    def secret(self) -> str | None:
        return self.client._secrets.get(self.name)

    def _update(self, view: dict) -> dict:
        with self._lock:  # (versions restart with the service: the latest reply wins)
            self.view, self._seen = {k: view[k] for k in _VIEW}, time.monotonic()
        return view

    def _beat(self, every: float) -> None:
        try:
            while not self._stop.wait(every):
                try:
                    self._update(self.client.call("heartbeat", job=self.name, retry_s=every))
                except SchedError:
                    continue  # the service is restarting: keep trying; JobEnded shows in the view
        finally:
            self.client.close()  # this thread's connection

    def _call(self, op: str, **args) -> dict:
        r = self.client.call(op, job=self.name, **args)
        if "state" in r:
            self._update(r)
        return r

    @property
    def state(self) -> str:
        return self.view["state"]

    @property
    def stopping(self) -> bool:
        """Whether the service asked this job to stop (a graceful cancel): finish the step in
        flight, checkpoint, then `finish`; its phases are still granted until then."""
        return self.view["state"] == "stopping"

    def _check_live(self, lease_id: int | None = None) -> None:
        v = self.view
        if v["state"] not in ("queued", "running", "stopping"):
            raise JobEnded(f"job {self.name!r} is {v['state']}", "ended")
        if lease_id is not None and all(le["id"] != lease_id for le in v["leases"]):
            raise LeaseLost(f"lease {lease_id} of job {self.name!r} is no longer held by the scheduler", "lease_lost")

    def acquire(self, phase: str, cluster: str | None = None, *, mem: float | None = None, devices: int | None = None,
                min_devices: int | None = None, work: float | None = None, only: list[int] | None = None,
                timeout: float | None = None) -> LeaseInfo:
        """Ask for a phase and block until it is granted; returns the lease."""
        r = self._call("request", phase=phase, cluster=cluster, mem=mem, devices=devices, min_devices=min_devices,
                       work=work, only=only)
        rid = r["request"]
        end = None if timeout is None else time.monotonic() + timeout
        while True:
            for le in self.view["leases"]:
                if le.get("request") == rid:
                    return LeaseInfo.of(le)
            self._check_live()
            left = 10.0 if end is None else min(10.0, end - time.monotonic())
            if left <= 0:
                self._call("withdraw", request=rid)
                raise TimeoutError(f"phase {phase!r} of job {self.name!r} not granted within {timeout} s")
            self._call("wait", version=self.view["version"], timeout=left)

    def release(self, lease: LeaseInfo | int) -> None:
        self._call("release", lease=lease.id if isinstance(lease, LeaseInfo) else int(lease))

    @contextlib.contextmanager
    def phase(self, phase: str, cluster: str | None = None, **kw):
        lease = self.acquire(phase, cluster, **kw)
        try:
            yield lease
        finally:
            with contextlib.suppress(JobEnded):
                self.release(lease)

    def set_work(self, work: float) -> None:
        self._call("work", work=float(work))

    def should_yield(self, lease: LeaseInfo | int | None = None) -> bool:
        """Whether the service asked this job to give back `lease` (default: any lease). The
        view is refreshed when older than poll_s; raises JobEnded when the job was ended and
        LeaseLost when `lease` is no longer held."""
        if time.monotonic() - self._seen >= self.poll_s:
            self._call("heartbeat")
        lid = lease.id if isinstance(lease, LeaseInfo) else lease
        self._check_live(lid)
        return any(le["yield"] for le in self.view["leases"] if lid is None or le["id"] == lid)

    def finish(self, failed: bool = False) -> None:
        with contextlib.suppress(JobEnded):
            self._call("finish", failed=failed)
        self.close()

    def close(self) -> None:
        self._stop.set()
        if self._hb.is_alive() and self._hb is not threading.current_thread():
            self._hb.join(timeout=5)

    def __enter__(self):
        return self

    def __exit__(self, exc_type, *_):
        if exc_type is None:
            self.finish()
        else:
            self.close()
