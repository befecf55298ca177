"""Helpers of the scheduler's tests: a settable clock, a call that must succeed, a raw handshake,
the servers of a `serve` or `service` fixture, and a process's CPU share."""

import os
from contextlib import contextmanager

SPEC = {"c": {"devices": 1}}


class Clock:
    def __init__(self, t=1000.0):
        self.t = t

    def __call__(self):
        return self.t


def ok(core, **msg):
    r = core.handle(msg)
    assert r["ok"], r
    return r


def hello(sock, token=None, job=None, secret=None):
    """A raw connection's handshake (rlcu.sched.auth); returns the Handshake whose `sign(msg)`
    turns a message's token or secret into its proof for this connection."""
    import json

    from rlcu.sched.auth import Handshake
    from rlcu.sched.protocol import encode

    hs = Handshake({"job": job, "secret": secret} if secret else {}, token)
    sock.sendall(encode(hs.hello))
    buf = b""
    while not buf.endswith(b"\n"):
        chunk = sock.recv(65536)
        if not chunk:
            break
        buf += chunk
    hs.accept(json.loads(buf), "the test's service")
    return hs


@contextmanager
def servers(tmp_path, token: str, devices: list[float]):
    """A `serve` fixture's body (`with servers(...) as serve: yield serve`): serve(core=None,
    addr=None, **kw) starts a SchedServer (by default on a Core of `devices` with its state in
    tmp_path, on a Unix socket there); every one whose threads still run is stopped at the end."""
    from rlcu.sched.core import Core
    from rlcu.sched.server import SchedServer

    started = []

    def start(core=None, addr=None, **kw):
        srv = SchedServer(core or Core(list(devices), state=tmp_path / "s.db"), addr or f"unix:{tmp_path / 's.sock'}",
                          token, tick_s=0.05, **kw).start()
        started.append(srv)
        return srv

    yield start
    for srv in started:
        if srv._threads:
            srv.stop()


@contextmanager
def services(tmp_path, token: str):
    """A `service` fixture's body: service(capacity=(80.0,), state="s.db", hb=30.0, addr=None,
    **core_kw) serves a Core of those (capacity None: the pool its state holds; state None: in
    memory) as servers() does, and returns the server and a client that retries for 5 s."""
    from rlcu.sched.client import SchedClient
    from rlcu.sched.core import Core

    with servers(tmp_path, token, []) as serve:
        def start(capacity=(80.0,), state="s.db", hb=30.0, addr=None, **core_kw):
            core = Core(list(capacity) if capacity is not None else None, state=tmp_path / state if state else None,
                        heartbeat_timeout=hb, **core_kw)
            srv = serve(core, addr)
            return srv, SchedClient(srv.address, token, retry_s=5.0)

        yield start


def cpu_share(pid: int, seconds: float = 1.5) -> float:
    """The share of one core process `pid` used (user + system) over the next `seconds`."""
    import time
    from pathlib import Path

    tick = os.sysconf("SC_CLK_TCK")

    def cpu() -> float:
        f = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(f[11]) + int(f[12])) / tick

    c0, t0 = cpu(), time.monotonic()
    time.sleep(seconds)
    return (cpu() - c0) / (time.monotonic() - t0)
