"""The scheduler's wire protocol: errors, addresses, frames and the schema of every op.

The lowest layer of the scheduler's one-way stack (protocol <- client <- services <- jobs):
it imports nothing else of rlcu.sched, so the client, the socket server and the Ray actor
all read the same definitions.

A message is a JSON object `{"op": ..., <auth>, <fields>}`. On a socket it travels as a
*head* line of at most `MAX_HEAD` bytes, optionally followed by a *body*:

    {"op": "register", "token_proof": "9f2c...", "job": "a", "id": "c1f0-7", "body": 1234}\\n <1234 bytes of JSON>

The head carries everything the service needs to authenticate (the proof of the service
token, or the `job` and the proof of its secret), so a service reads at most `MAX_HEAD` bytes
from a stranger; the body (the op's other fields, at most `MAX_BODY` bytes) is read only
after. A message that fits in one head line needs no body. Replies are one JSON line each.

Authentication (protocol 2, auth.py): a connection (a Ray session) opens with a `hello`, whose
answer proves that the service knows the key, and the messages after it carry proofs bound to
that handshake's nonces; the token and the job secrets themselves never travel. Auth and
bookkeeping fields: `token_proof` (of the service's token: admin authority), `secret_proof`
(of a job's secret, which `register` returns: authority over that job), `session` (the Ray
transport's handshake: the service's nonce), `id` (an operation id the client makes per
call; a retried call with the same id gets the first call's reply), `retry` (true on a
resend after a lost reply: the service reconciles with what it already did).

`validate(msg)` checks every field of every op for its type and range, so that nothing a
service cannot store or compute with (a dict as pid, 2**70, NaN memory, a 200,000-deep
list) gets past the boundary: such a message gets an error reply and changes nothing.
"""

from __future__ import annotations

import ipaddress
import json
import math
import os
import re
import reprlib
from pathlib import Path

MAX_HEAD = 4096  # bytes of the head line (auth) read before the sender is known
MAX_BODY = 1 << 20  # bytes of an authenticated message's body
MAX_REPLY = 1 << 26  # bytes of a reply the client accepts (status and trace of a long history)
MAX_DEPTH = 16  # nesting of the free-form fields (spec)
MAX_DEVICES = 4096
MAX_PID = 1 << 22  # Linux's pid_max limit
MAX_ID = 1 << 62  # lease and request ids (SQLite's INTEGER is 64-bit signed)
MAX_MEM = 1e12  # memory numbers (any unit the pool uses)
MAX_WAIT = 3600.0
PROTOCOL = 2  # the handshake's version (auth.py)

# hello: the service knows no handshake of this caller (a Ray session it forgot, a restart): say hello again
CODES = ("invalid", "protocol", "auth", "hello", "unknown_job", "ended", "unavailable", "busy", "draining",
         "internal")
AUTH_FIELDS = ("token_proof", "secret_proof", "session", "id", "retry")
HEAD_FIELDS = ("op", "job", *AUTH_FIELDS, "body")
NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
OP_ID = re.compile(r"^[A-Za-z0-9._:-]{1,64}$")
NONCE = re.compile(r"^[0-9a-f]{32,128}$")  # a handshake's nonce: 16 random bytes or more, as hex
PROOF = re.compile(r"^[0-9a-f]{64}$")  # an HMAC-SHA256, as hex


class SchedError(RuntimeError):
    """The service refused a request (its message says why) or could not be reached;
    `code` is one of CODES."""

    def __init__(self, msg: str, code: str = "invalid"):
        super().__init__(msg)
        self.code = code


class JobEnded(SchedError):
    """The job was cancelled, declared dead or finished: it must stop."""


def error(msg: str, code: str = "invalid") -> dict:
    return {"ok": False, "error": msg, "code": code}


def raise_for(reply: dict) -> dict:
    """The reply itself when ok, else its error as SchedError (JobEnded for code "ended")."""
    if not isinstance(reply, dict):
        raise SchedError(f"the scheduler sent a reply that is not an object: {reply!r:.200}", "protocol")
    if not reply.get("ok"):
        code = reply.get("code", "invalid")
        raise (JobEnded if code == "ended" else SchedError)(str(reply.get("error", "unknown error")), code)
    return reply


# ---------------------------------------------------------------------- addresses
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
    rest = addr.removeprefix("tcp://")
    host, sep, port = rest.rpartition(":")
    if sep and port.isdigit() and host:
        if int(port) > 65535:
            raise SchedError(f"port {port} of scheduler address {addr!r} is above 65535")
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


# ---------------------------------------------------------------------- frames
def encode(msg: dict) -> bytes:
    """A message as it goes on a socket: one head line, plus a body when it does not fit."""
    line = json.dumps(msg, separators=(",", ":"), allow_nan=False).encode()
    if len(line) < MAX_HEAD:
        return line + b"\n"
    head = {k: msg[k] for k in HEAD_FIELDS if k in msg}
    body = json.dumps({k: v for k, v in msg.items() if k not in head}, separators=(",", ":"), allow_nan=False).encode()
    if len(body) > MAX_BODY:
        raise SchedError(f"op {msg.get('op')!r}: the message is {len(body)} bytes, more than {MAX_BODY}", "invalid")
    head["body"] = len(body)
    line = json.dumps(head, separators=(",", ":")).encode()
    if len(line) >= MAX_HEAD:
        raise SchedError(f"op {msg.get('op')!r}: its auth fields alone exceed {MAX_HEAD} bytes", "invalid")
    return line + b"\n" + body


def decode(data: bytes, what: str = "message") -> dict:
    """JSON bytes -> a dict; a SchedError (code "protocol") for anything else, including
    nesting too deep for the parser (RecursionError) and NaN/Infinity."""
    try:
        obj = json.loads(data, parse_constant=_no_constant)
    except RecursionError:
        raise SchedError(f"the {what} is nested too deeply to parse", "protocol") from None
    except (ValueError, UnicodeDecodeError) as e:
        raise SchedError(f"the {what} is not JSON: {e}", "protocol") from None
    if not isinstance(obj, dict):
        raise SchedError(f"a {what} is a JSON object with an 'op', got {type(obj).__name__}", "protocol")
    return obj


def _no_constant(name: str):
    raise ValueError(f"{name} is not a number here")


def body_length(head: dict) -> int:
    """The body length a head announces (0: none)."""
    n = head.get("body", 0)
    if not _is_int(n) or not 0 <= n <= MAX_BODY:
        raise SchedError(f"the head's body length must be an integer in [0, {MAX_BODY}], got {n!r:.40}", "protocol")
    return n


def merge(head: dict, body: dict) -> dict:
    """A head and its body as one message (the body cannot restate head fields)."""
    dup = [k for k in body if k in HEAD_FIELDS]
    if dup:
        raise SchedError(f"field {dup[0]!r} belongs in the head, not the body", "protocol")
    out = {k: v for k, v in head.items() if k != "body"}
    out.update(body)
    return out


# ---------------------------------------------------------------------- field checks
def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


class _Bad(Exception):
    """A field out of its type or range; the message names what it must be."""


def _int(lo: int, hi: int, what: str = "an integer"):
    def check(v):
        if not _is_int(v) or not lo <= v <= hi:
            raise _Bad(f"must be {what} in [{lo}, {hi}]")
        return v
    return check


def _num(lo: float, hi: float):
    def check(v):
        if not _is_num(v) or not (math.isfinite(v) and lo <= v <= hi):
            raise _Bad(f"must be a finite number in [{lo:g}, {hi:g}]")
        return v
    return check


def _bool(v):
    if not isinstance(v, bool):
        raise _Bad("must be true or false")
    return v


def _name(v):
    if not isinstance(v, str) or not NAME.match(v):
        raise _Bad("must be 1-128 characters of letters, digits, '.', '_', '-' (starting with a letter or digit)")
    return v


def _str(n: int):
    def check(v):
        if not isinstance(v, str) or len(v) > n:
            raise _Bad(f"must be a string of at most {n} characters")
        return v
    return check


def _only(v):
    items = v if isinstance(v, list) else [v]
    if not items or len(items) > MAX_DEVICES or not all(_is_int(d) and 0 <= d < MAX_DEVICES for d in items):
        raise _Bad(f"must be a device index or a non-empty list of device indices in [0, {MAX_DEVICES})")
    return v


def _clusters(v):
    if not isinstance(v, dict) or len(v) > 64:
        raise _Bad("must be a mapping of at most 64 cluster names to a device count or "
                   "{devices, resident, peak}")
    for name, c in v.items():
        if not isinstance(name, str) or not NAME.match(name):
            raise _Bad(f"names cluster {name!r:.40}: a cluster name is 1-128 letters, digits, '.', '_', '-'")
        if isinstance(c, dict):
            bad = set(c) - {"devices", "resident", "peak"}
            if bad:
                raise _Bad(f"cluster {name!r}: unknown key {min(map(str, bad))!r:.40} "
                           "(allowed: devices, resident, peak)")
            _field(_DEVICES, c.get("devices", 1), f"cluster {name!r}: devices")
            for k in ("resident", "peak"):
                _field(_MEM, c.get(k, 0.0), f"cluster {name!r}: {k}")
        else:
            _field(_DEVICES, c, f"cluster {name!r}: devices")
    return v


def _json_value(v):
    """Plain JSON of bounded depth (checked without recursion: a deep value cannot blow the stack)."""
    stack = [(v, 1)]
    while stack:
        x, d = stack.pop()
        if d > MAX_DEPTH:
            raise _Bad(f"is nested deeper than {MAX_DEPTH} levels")
        if isinstance(x, dict):
            if not all(isinstance(k, str) for k in x):
                raise _Bad("has a key that is not a string")
            stack.extend((y, d + 1) for y in x.values())
        elif isinstance(x, list):
            stack.extend((y, d + 1) for y in x)
        elif isinstance(x, float):
            if not math.isfinite(x):
                raise _Bad("holds a number that is not finite")
        elif _is_int(x):
            if abs(x) >= 1 << 63:
                raise _Bad("holds an integer beyond 64 bits")
        elif not (x is None or isinstance(x, (str, bool))):
            raise _Bad(f"holds a {type(x).__name__}, which is not JSON")
    return v


def _spec(v):
    if not isinstance(v, dict):
        raise _Bad("must be a mapping")
    return _json_value(v)


def _op_id(v):
    if not isinstance(v, str) or not OP_ID.match(v):
        raise _Bad("must be 1-64 characters of letters, digits, '.', '_', ':', '-'")
    return v


def _hex(pattern: re.Pattern, what: str):
    def check(v):
        if not isinstance(v, str) or not pattern.match(v):
            raise _Bad(f"must be {what}")
        return v
    return check


def _opt(check):
    return lambda v: v if v is None else check(v)


def _field(check, v, what: str):
    try:
        return check(v)
    except _Bad as e:
        raise SchedError(f"{what} {e}, got {short(v)}", "invalid") from None


_REPR = reprlib.Repr()
_REPR.maxlevel, _REPR.maxstring, _REPR.maxother = 3, 60, 60


def short(v) -> str:
    """A bounded repr (of any depth or size) for error messages."""
    return _REPR.repr(v)


_DEVICES = _int(1, MAX_DEVICES)
_MEM = _num(0.0, MAX_MEM)
_ID = _int(1, MAX_ID, "a lease or request id (an integer)")
FIELDS = {
    "job": _name, "clusters": _clusters, "spec": _opt(_spec),
    "pid": _opt(_int(1, MAX_PID, "a process id (an integer)")),
    "host": _opt(_str(255)), "queued": _bool, "attach": _bool, "phase": _name, "cluster": _opt(_name),
    "devices": _opt(_DEVICES), "min_devices": _opt(_DEVICES), "mem": _opt(_MEM), "work": _num(0.0, 1e18),
    "only": _opt(_only), "request": _ID, "lease": _ID, "version": _int(-1, MAX_ID),
    "timeout": _num(0.0, MAX_WAIT), "failed": _bool, "on": _bool, "graceful": _bool,
    "nonce": _hex(NONCE, "32-128 lowercase hex digits"), "session": _hex(NONCE, "32-128 lowercase hex digits"),
    "token_proof": _hex(PROOF, "64 lowercase hex digits (an HMAC-SHA256)"),
    "secret_proof": _hex(PROOF, "64 lowercase hex digits (an HMAC-SHA256)"), "id": _op_id, "retry": _bool,
}


# op -> (required fields, optional fields); the auth fields are allowed everywhere
OPS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "hello": (("nonce",), ("job",)),  # a connection's handshake (auth.py), answered by the front, not the core
    "ping": ((), ()),
    "status": ((), ()),
    "metrics": ((), ()),
    "trace": ((), ()),
    "drain": ((), ("on",)),
    "register": (("job", "clusters"), ("spec", "pid", "host", "queued", "attach")),
    "request": (("job", "phase"), ("cluster", "devices", "mem", "min_devices", "work", "only")),
    "withdraw": (("job", "request"), ()),
    "release": (("job", "lease"), ()),
    "work": (("job", "work"), ()),
    "heartbeat": (("job",), ()),
    "wait": (("job",), ("version", "timeout")),
    "finish": (("job",), ("failed",)),
    "cancel": (("job",), ("graceful",)),
}
READ_OPS = ("ping", "status", "metrics", "trace")  # any authenticated caller
ADMIN_OPS = ("drain",)  # the service token only
JOB_OPS = ("request", "withdraw", "release", "work", "heartbeat", "wait", "finish")  # the job's secret only
# register: the token (a new job; attaching to a queued one) or the job's secret (attaching to it);
# cancel: the token (any job) or the job's secret (itself)
MUTATING = ("register", "request", "withdraw", "release", "work", "finish", "cancel", "drain")


def validate(msg) -> tuple[str, dict]:
    """(op, fields without the auth ones) of a well-formed message; SchedError otherwise
    (code "protocol" for an unknown op or field, "invalid" for a value out of type or range)."""
    if not isinstance(msg, dict):
        raise SchedError("a message is a JSON object with an 'op'", "protocol")
    op = msg.get("op")
    if not isinstance(op, str) or op not in OPS:
        raise SchedError(f"unknown op {short(op)}; ops: {', '.join(sorted(OPS))}", "protocol")
    need, may = OPS[op]
    for k in msg:
        if k != "op" and k not in need and k not in may and k not in AUTH_FIELDS:
            raise SchedError(f"op {op!r} takes no argument {short(k)} (takes: {', '.join(need + may) or 'none'})",
                             "protocol")
    for k in need:
        if k not in msg:
            raise SchedError(f"op {op!r} needs {k!r}", "protocol")
    for k, v in msg.items():
        if k != "op":
            _field(FIELDS[k], v, f"op {op!r}: {k}")
    return op, {k: v for k, v in msg.items() if k != "op" and k not in AUTH_FIELDS}
