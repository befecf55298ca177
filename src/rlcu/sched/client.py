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

Messages are JSON lines; each call opens its own connection (cheap on a Unix socket, and a
restarted service is simply found again: a refused connection is retried for `retry_s`).
A `JobHandle` heartbeats from a daemon thread; `should_yield` reads the latest view of the
job (refreshing it at most every `poll_s`). A job the service has ended (cancelled, reclaimed
as dead) raises `JobEnded` from its next call.

Token: given, else $RLCU_SCHED_TOKEN, else the `token` file beside a Unix socket, else the
one in the default state folder ($RLCU_SCHED_DIR or ~/.rlcu/sched).
"""

from __future__ import annotations

import contextlib
import dataclasses
import ipaddress
import json
import os
import socket
import threading
import time
from pathlib import Path

MAX_LINE = 1 << 24


class SchedError(RuntimeError):
    """The service refused a request (its message says why) or could not be reached."""

    def __init__(self, msg: str, code: str = "invalid"):
        super().__init__(msg)
        self.code = code


class JobEnded(SchedError):
    """The job was cancelled, declared dead or finished: it must stop."""


def default_state_dir() -> Path:
    return Path(os.environ.get("RLCU_SCHED_DIR") or Path.home() / ".rlcu" / "sched")


def default_address() -> str:
    return os.environ.get("RLCU_SCHED_ADDR") or f"unix:{default_state_dir() / 'sched.sock'}"


def parse_address(addr: str) -> tuple[str, object]:
    """'unix:PATH' | a path with '/' or ending in .sock -> ("unix", path); 'tcp://H:P' | 'H:P' ->
    ("tcp", (host, port)); 'ray:NAME' -> ("ray", name)."""
    if not isinstance(addr, str) or not addr:
        raise SchedError(f"a scheduler address is a non-empty string, got {addr!r}")
    for pre in ("unix://", "unix:"):
        if addr.startswith(pre):
            return "unix", addr[len(pre):]
    for pre in ("ray://", "ray:"):
        if addr.startswith(pre):
            return "ray", addr[len(pre):] or "rlcu-sched"
    rest = addr[len("tcp://"):] if addr.startswith("tcp://") else addr
    host, sep, port = rest.rpartition(":")
    if sep and port.isdigit() and host:
        return "tcp", (host.strip("[]"), int(port))
    if "/" in addr or addr.endswith(".sock"):
        return "unix", addr
    raise SchedError(f"cannot read scheduler address {addr!r}: use unix:PATH, HOST:PORT (loopback) or ray:NAME")


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def find_token(addr: str, token: str | None = None) -> str | None:
    if token:
        return token
    if os.environ.get("RLCU_SCHED_TOKEN"):
        return os.environ["RLCU_SCHED_TOKEN"]
    kind, where = parse_address(addr)
    places = [Path(where).parent / "token"] if kind == "unix" else []
    places.append(default_state_dir() / "token")
    for p in places:
        try:
            return p.read_text().strip()
        except OSError:
            continue
    return None


class SocketTransport:
    def __init__(self, addr: str, token: str | None, timeout: float = 30.0, retry_s: float = 10.0):
        self.kind, self.where = parse_address(addr)
        if self.kind == "ray":
            raise SchedError("a ray: address needs RayTransport (rlcu.sched.ray_backend)")
        self.token, self.timeout, self.retry_s = token, timeout, retry_s

    def _connect(self, timeout: float) -> socket.socket:
        end = time.monotonic() + self.retry_s
        while True:
            try:
                if self.kind == "tcp":
                    return socket.create_connection(self.where, timeout=timeout)
                s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                try:
                    s.settimeout(timeout)
                    s.connect(self.where)
                except OSError:
                    s.close()
                    raise
                return s
            except (ConnectionRefusedError, FileNotFoundError, ConnectionResetError, BlockingIOError) as e:
                # (BlockingIOError: a Unix socket's listen backlog is full; the service is busy, not gone)
                if time.monotonic() >= end:
                    if isinstance(e, BlockingIOError):
                        raise SchedError(f"the scheduler at {self.kind}:{self.where} accepted no connection "
                                         f"for {self.retry_s:g} s (its listen backlog stayed full)",
                                         "unavailable") from None
                    raise SchedError(f"no scheduler at {self.kind}:{self.where} ({e.__class__.__name__}); "
                                     "start one with `rlcu sched serve`", "unavailable") from None
                time.sleep(0.05)

    def call(self, msg: dict) -> dict:
        wait = float(msg.get("timeout", 0)) if msg.get("op") == "wait" else 0.0
        try:
            with self._connect(self.timeout + wait) as s:
                s.sendall((json.dumps({**msg, "token": self.token}) + "\n").encode())
                buf = b""
                while not buf.endswith(b"\n"):
                    chunk = s.recv(1 << 16)
                    if not chunk:
                        raise SchedError("the scheduler closed the connection without a reply", "unavailable")
                    buf += chunk
                    if len(buf) > MAX_LINE:
                        raise SchedError("the scheduler's reply is too long", "protocol")
        except OSError as e:  # reset or timed out mid-call (a service going down)
            raise SchedError(f"lost the scheduler at {self.kind}:{self.where}: {e}", "unavailable") from None
        return json.loads(buf)


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
    def of(cls, d: dict) -> "LeaseInfo":
        return cls(d["id"], d["phase"], d["cluster"], tuple(d["devices"]), tuple(d["names"]), tuple(d["mem"]),
                   d["start"])


class SchedClient:
    def __init__(self, addr: str | None = None, token: str | None = None, *, transport=None, timeout: float = 30.0,
                 retry_s: float = 10.0):
        self.addr = addr or default_address()
        if transport is None:
            if parse_address(self.addr)[0] == "ray":
                from rlcu.sched.ray_backend import RayTransport

                transport = RayTransport(self.addr)
            else:
                transport = SocketTransport(self.addr, find_token(self.addr, token), timeout, retry_s)
        self.transport = transport

    def call(self, op: str, **args) -> dict:
        reply = self.transport.call({"op": op, **{k: v for k, v in args.items() if v is not None}})
        if not reply.get("ok"):
            code = reply.get("code", "invalid")
            raise (JobEnded if code == "ended" else SchedError)(reply.get("error", "unknown error"), code)
        return reply

    # ------------------------------------------------------------------ admin
    def ping(self) -> dict:
        return self.call("ping")

    def status(self) -> dict:
        return self.call("status")

    def metrics(self) -> dict:
        return self.call("metrics")

    def trace(self) -> dict:
        return self.call("trace")["trace"]

    def cancel(self, job: str) -> dict:
        return self.call("cancel", job=job)

    def submit(self, job: str, clusters: dict, spec: dict | None = None) -> dict:
        """Register a job whose worker attaches later (`job(..., attach=True)`)."""
        return self.call("register", job=job, clusters=clusters, spec=spec, queued=True)

    def job(self, name: str, clusters: dict | None = None, *, spec: dict | None = None, attach: bool = False,
            heartbeat_s: float = 2.0, poll_s: float = 0.1) -> "JobHandle":
        view = self.call("register", job=name, clusters=clusters or {}, spec=spec, pid=os.getpid(),
                         host=socket.gethostname(), attach=attach)
        return JobHandle(self, name, view, heartbeat_s, poll_s)


class JobHandle:
    """One job's side of the protocol: acquire/release phases, heartbeat, yield notices."""

    def __init__(self, client: SchedClient, name: str, view: dict, heartbeat_s: float, poll_s: float):
        self.client, self.name, self.poll_s = client, name, poll_s
        self.view, self._seen = view, time.monotonic()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._hb = threading.Thread(target=self._beat, args=(heartbeat_s,), name=f"sched-heartbeat-{name}",
                                    daemon=True)
        self._hb.start()

    def _update(self, view: dict) -> dict:
        with self._lock:
            self.view, self._seen = view, time.monotonic()
        return view

    def _beat(self, every: float) -> None:
        while not self._stop.wait(every):
            try:
                v = self.client.call("heartbeat", job=self.name)
                self._update({k: v[k] for k in ("job", "state", "version", "leases", "pending")})
            except SchedError:
                continue  # the service is restarting: keep trying; JobEnded shows in the view

    def _call(self, op: str, **args) -> dict:
        """A job-scoped call; the idempotent ones (wait, heartbeat) ride out a service restart."""
        end = time.monotonic() + 30.0
        while True:
            try:
                r = self.client.call(op, job=self.name, **args)
                break
            except SchedError as e:
                if e.code != "unavailable" or op not in ("wait", "heartbeat") or time.monotonic() > end:
                    raise
                time.sleep(0.1)
        if "state" in r:
            self._update({k: r[k] for k in ("job", "state", "version", "leases", "pending")})
        return r

    @property
    def state(self) -> str:
        return self.view["state"]

    def _check_live(self) -> None:
        if self.view["state"] not in ("queued", "running"):
            raise JobEnded(f"job {self.name!r} is {self.view['state']}", "ended")

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
        view is refreshed when older than poll_s; raises JobEnded when the job was ended."""
        if time.monotonic() - self._seen >= self.poll_s:
            self._call("heartbeat")
        self._check_live()
        lid = lease.id if isinstance(lease, LeaseInfo) else lease
        return any(le["yield"] for le in self.view["leases"] if lid is None or le["id"] == lid)

    def finish(self) -> None:
        with contextlib.suppress(JobEnded):
            self._call("finish")
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
