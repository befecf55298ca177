"""The services' one front door: authority, validation, operation ids, error replies.

The socket server (server.py) and the Ray actor (ray_backend.py) both put a `Front` before
their `Core`, so both answer every message the same way:

    front = Front(core, token)
    reply, session = front.hello(msg)           # a connection's handshake (auth.py): the service proves first
    caller = front.authenticate(head, session)  # from the head alone (before any body is read)
    reply = front.handle(msg, caller)           # never raises

Authority. The service `token` is admin authority: register a job, cancel any job, drain,
read status. A job's own operations (request, withdraw, release, work, heartbeat, wait,
finish, cancelling itself, attaching to it) need that job's *secret*, which `register`
returns: the token alone does not act for a job, so one job's process cannot release,
heartbeat or attach to another's. A job's secret is HMAC(key, name), the key derived from
the token (a restarted service on the same state knows every job's secret; a new token
revokes them all). Neither the token nor a secret travels (protocol 2, auth.py): a message
carries the proof of one, an HMAC over its connection's handshake nonces, and a message that
carries a token or secret in clear is refused (from a client too old to know better). The Ray
actor has no connections: its callers' handshakes are kept as sessions (the last
`keep_sessions`; a caller whose session was forgotten is told to say hello again, code "hello").

Waits. The socket server does not block on a `wait`: `wait_now` answers it at once, or says
how long it may still be held, and the server keeps it (a connection, no thread) until
`settled` says the job's view moved or its time is up.

Operation ids. A mutating op may carry an `id` made by the client; the reply to the first
call with that id is kept (per job, the last `keep_ops`, without the view, for `keep_s` after
the job's last op), and a call with the same id gets it again (with the job's view as it is
now) instead of acting twice. A resend after a lost reply that finds no kept reply (the
service restarted in between) carries `retry`: the front then reconciles with the state
(a request for a phase the job already awaits or holds returns that request; a release of a
lease already ended, or a finish of a job already ended, succeeds).
"""

from __future__ import annotations

import collections
import hashlib
import hmac
import secrets
import threading
import time

from rlcu.sched.auth import nonce, proof, same
from rlcu.sched.protocol import (
    ADMIN_OPS,
    JOB_OPS,
    MUTATING,
    PROTOCOL,
    SchedError,
    error,
    short,
    validate,
)

LIVE = ("queued", "running", "stopping")
_VIEW = ("job", "state", "version", "leases", "pending")  # a reply's view of its job
ADMIN = None  # the caller who gave the service token
HOLD_S = 60.0  # the longest a wait is held (as the core's own wait): the client asks again after


class Front:
    def __init__(self, core, token: str | None, keep_ops: int = 8, keep_s: float = 300.0,
                 keep_sessions: int = 4096):
        """token None: no service token (a Ray actor reached only from its cluster): every
        caller who gives no job secret has admin authority."""
        if token is not None and not token.strip():  # "" would be anyone's, and so every job's secret
            raise ValueError("the service token is empty: give a secret one (or None: no token)")
        self.core, self.token = core, token
        seed = token.encode() if token is not None else secrets.token_bytes(32)
        self._key = hashlib.sha256(b"rlcu-sched job secrets\0" + seed).digest()
        self._secrets: dict[str, str] = {}  # job -> its secret (an HMAC per message is not free)
        self.keep_ops, self.keep_s = keep_ops, keep_s
        self.draining = False
        # a job's view version, as callers see it, is the core's plus a base drawn per start: a
        # version a client kept from before a restart is then never taken for a current one
        self._base = (secrets.randbelow(1 << 40) + 1) << 20
        self._ops: dict[str, tuple[float, collections.OrderedDict]] = {}  # job -> (last use, op id -> reply)
        self._stripes = [threading.RLock() for _ in range(64)]  # one job's mutating ops, one at a time
        self._lock = threading.Lock()
        self._swept = time.monotonic()
        self._sessions: collections.OrderedDict[str, str] = collections.OrderedDict()  # Ray's: S -> C
        self.keep_sessions = keep_sessions

    # ------------------------------------------------------------------ authority
    def secret(self, job: str) -> str:
        sec = self._secrets.get(job)
        if sec is None:
            if len(self._secrets) >= 4096:  # (the names seen lately; any other is computed again)
                self._secrets.clear()
            sec = self._secrets[job] = hmac.new(self._key, job.encode(), hashlib.sha256).hexdigest()[:32]
        return sec

    def hello(self, msg, keep: bool = False) -> tuple[dict, tuple[str, str] | None]:
        """Answer a handshake (auth.py): the reply, proving the service knows the key the hello
        names, and the session (service nonce, client nonce) the caller's proofs will be
        checked against (None after an error reply). keep: remember the session (the Ray
        actor, whose callers have no connection to hold it)."""
        try:
            if not isinstance(msg, dict) or msg.get("op") != "hello":
                raise SchedError("a connection opens with a hello (protocol 2: the token and secrets are never "
                                 "sent; upgrade rlcu on the client)", "hello")
            _, args = validate(msg)
        except SchedError as e:
            return error(str(e), e.code), None
        s, c = nonce(), args["nonce"]
        job = args.get("job")
        key = self.secret(job) if job is not None else self.token
        if keep:
            with self._lock:
                self._sessions[s] = c
                while len(self._sessions) > self.keep_sessions:
                    self._sessions.popitem(last=False)
        return {"ok": True, "protocol": PROTOCOL, "nonce": s,
                "proof": proof(key, "service", s, c) if key is not None else None}, (s, c)

    def session(self, msg) -> tuple[str, str] | None:
        """The kept session a Ray caller's message names (None: unknown)."""
        s = msg.get("session") if isinstance(msg, dict) else None
        with self._lock:
            c = self._sessions.get(s) if isinstance(s, str) else None
        return (s, c) if c is not None else None

    def authenticate(self, head: dict, session: tuple[str, str] | None):
        """ADMIN (the proof of the service token) or the job name (the proof of its secret),
        checked against the caller's handshake; SchedError code "auth" (code "hello": no
        handshake)."""
        if "token" in head or "secret" in head:
            raise SchedError("this message carries a token or secret in clear, which the scheduler never takes "
                             f"(protocol {PROTOCOL} proves them by challenge-response): upgrade rlcu on the client, "
                             "and change the token if the old one went to another process", "auth")
        if session is None:
            raise SchedError("no handshake for this message (the service restarted, or forgot the session): "
                             "say hello first", "hello")
        sp, tp, job = head.get("secret_proof"), head.get("token_proof"), head.get("job")
        if sp is not None:
            if isinstance(job, str) and same(sp, proof(self.secret(job), "client", *session)):
                return job
            raise SchedError("bad job secret (the one `register` returned for this job)", "auth")
        if self.token is None or (tp is not None and same(tp, proof(self.token, "client", *session))):
            return ADMIN
        raise SchedError("bad or missing token (see <state>/token, --token-file or $RLCU_SCHED_TOKEN)", "auth")

    def _authorize(self, op: str, args: dict, caller) -> None:
        job = args.get("job")
        if caller is not ADMIN and job != caller:
            raise SchedError(f"the secret of job {caller!r} gives no authority over job {job!r}", "auth")
        if op in JOB_OPS and caller is ADMIN:
            raise SchedError(f"op {op!r} acts for job {job!r}: it needs the job's secret (returned by register), "
                             "not the service token", "auth")
        if op == "register" and caller is not ADMIN and not args.get("attach"):
            raise SchedError(f"job {job!r} exists: its secret only attaches to it (attach: true)", "auth")

    # ------------------------------------------------------------------ dispatch
    def handle(self, msg, caller=ADMIN, authenticated: bool = False) -> dict:
        """One message -> one reply; never raises. Without `authenticated` the message's own
        proof is checked first, against the session it names (the Ray actor's path)."""
        try:
            if not authenticated:
                caller = self.authenticate(msg if isinstance(msg, dict) else {}, self.session(msg))
            if msg.get("op") == "hello":
                raise SchedError("a hello opens a connection (or a Ray session), once", "protocol")
            if msg.get("op") in ADMIN_OPS and caller is not ADMIN:
                raise SchedError(f"op {msg['op']!r} needs the service token", "auth")
            op, args = validate(msg)
            self._authorize(op, args, caller)
            if op in MUTATING and "id" in msg:
                return self._once(op, args, msg, caller)
            return self._do(op, args, msg, caller)
        except SchedError as e:
            return error(str(e), e.code)
        except Exception as e:  # noqa: BLE001  (a defect: the caller gets a reply, not a dead connection)
            op = msg.get("op") if isinstance(msg, dict) else None
            return error(f"op {short(op)} failed inside the service: {type(e).__name__}: {e}", "internal")

    def wait_now(self, msg: dict, caller) -> tuple[dict, float]:
        """A `wait` answered without blocking: its reply as things are, and how long it may still
        be held (0: the reply is final). The socket server holds a wait whose time is > 0 and
        asks again once `settled` says so."""
        try:
            _, args = validate(msg)
        except SchedError as e:
            return error(str(e), e.code), 0.0
        reply = self.handle({**msg, "timeout": 0.0}, caller, authenticated=True)
        held = reply.get("ok") and reply.get("state") in LIVE and reply.get("version") == args.get("version")
        return reply, min(float(args.get("timeout", 10.0)), HOLD_S) if held else 0.0

    def settled(self, job: str, version: int) -> bool:
        """Whether a wait of `job` held at `version` may have its answer now: its view moved,
        the job ended, the core stopped. Read without the core's lock (a hint the server polls;
        the answer itself comes from `wait_now`)."""
        core = self.core
        j = core.jobs.get(job)
        return (j is None or j.state not in LIVE or core.versions.get(job, 0) + self._base != version
                or core.closed or core.fatal is not None)

    def _job_lock(self, job: str):
        return self._stripes[hash(job) % len(self._stripes)]

    def _once(self, op: str, args: dict, msg: dict, caller) -> dict:
        scope = args.get("job", "")
        with self._job_lock(scope):
            now = time.monotonic()
            with self._lock:
                kept = self._ops.get(scope, (now, {}))[1]
            if msg["id"] in kept:
                reply = {**kept[msg["id"]], "replayed": True}
                if reply.get("ok") and scope:
                    view = self._out(self._core("heartbeat", job=scope))
                    reply = {**view, **reply} if view.get("ok") else reply
                return reply
            reply = self._do(op, args, msg, caller)
            if reply.get("code") not in ("unavailable", "busy", "internal"):
                with self._lock:
                    kept = self._ops.setdefault(scope, (now, collections.OrderedDict()))[1]
                    kept[msg["id"]] = {k: v for k, v in reply.items() if k not in _VIEW}
                    while len(kept) > self.keep_ops:
                        kept.popitem(last=False)
                    self._ops[scope] = (now, kept)
                    if now - self._swept > self.keep_s / 10:  # forget the jobs quiet for keep_s
                        self._swept = now
                        for k in [k for k, (t, _) in self._ops.items() if now - t > self.keep_s]:
                            del self._ops[k]
            return reply

    def _core(self, op: str, **args) -> dict:
        return self.core.handle({"op": op, **args})

    def _do(self, op: str, args: dict, msg: dict, caller) -> dict:
        if op == "drain":
            self.draining = bool(args.get("on", True))
            return {"ok": True, "draining": self.draining}
        if op == "register":
            return self._register(args, caller, bool(msg.get("retry")))
        if msg.get("retry"):
            done = self._reconcile(op, args)
            if done is not None:
                return done
        if "version" in args:
            v = args["version"] - self._base
            args = {**args, "version": v if 0 <= v < 1 << 20 else -2}  # (-2: no version: answer at once)
        reply = self._core(op, **args)
        if op in ("ping", "status") and reply.get("ok"):
            reply["draining"] = self.draining
        return self._out(reply)

    def _out(self, reply: dict) -> dict:
        if isinstance(reply.get("version"), int):
            reply["version"] += self._base
        return reply

    def _register(self, args: dict, caller, retry: bool = False) -> dict:
        job = args["job"]
        with self._job_lock(job):
            known = self._core("heartbeat", job=job) if args.get("attach") or retry else None
            if known is not None and known.get("ok"):
                if args.get("attach"):
                    if caller is ADMIN and known["state"] != "queued" and self.token is not None:
                        raise SchedError(f"job {job!r} is {known['state']}: attaching to it needs its secret", "auth")
                elif self._registered_by(job, args):  # a resend whose first reply was lost in a restart
                    return {**self._out(known), "secret": self.secret(job), "reconciled": True}
            elif self.draining:
                raise SchedError("the scheduler is draining: it takes no new job", "draining")
            reply = self._out(self._core("register", **args))
            if reply.get("ok"):
                reply["secret"] = self.secret(job)
            return reply

    def _registered_by(self, job: str, args: dict) -> bool:
        """Whether the live job `job` is the one these register fields made (same process)."""
        if args.get("pid") is None:
            return False
        rows = [r for r in self._core("status").get("jobs", []) if r.get("job") == job]
        return bool(rows) and rows[0].get("pid") == args["pid"] and rows[0].get("state") in LIVE

    def _reconcile(self, op: str, args: dict) -> dict | None:
        """What a resent op already did, when the state shows it (None: do it now)."""
        job = args.get("job")
        if op not in ("request", "release", "withdraw", "finish", "cancel") or job is None:
            return None
        v = self._out(self._core("heartbeat", job=job))
        if not v.get("ok"):
            return None
        if op == "request":
            held = [p["id"] for p in v["pending"] if p["phase"] == args["phase"]]
            held += [le["request"] for le in v["leases"] if le["phase"] == args["phase"] and le["request"]]
            return {**v, "request": held[0], "reconciled": True} if held else None
        if op == "release":
            gone = all(le["id"] != args["lease"] for le in v["leases"])
            return {**v, "reconciled": True} if gone and v["state"] in LIVE else None
        if op == "withdraw":
            gone = all(p["id"] != args["request"] for p in v["pending"])
            return {**v, "reconciled": True} if gone and v["state"] in LIVE else None
        ended = v["state"] in ("done", "failed") if op == "finish" else \
            v["state"] == "cancelled" or (args.get("graceful") and v["state"] == "stopping")
        return {**v, "reconciled": True} if ended else None
