"""Helpers of the scheduler's tests: a settable clock, a call that must succeed, a raw handshake."""

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
