"""The join channel of a LoRA host under the scheduler: how a LoRA job submitted later reaches a
host already running on its base (rlcu.sched.host) and gets its status back.

    host side:  srv = JoinServer(token).start(); ...; srv.bind(host); ...; srv.close()
    job side:   status = join(srv.address, token, cfg_dict, name=..., import_dir=...)  # None: no host

The host listens on a Unix socket in a fresh folder only its user may enter (0700), and puts the
socket's address in its registration's spec, which the scheduler shows to token holders in
`status` (each job row's `host`). One connection is one job: JSON lines, both ways proven by the
scheduler's token as the scheduler's own handshake proves them (auth.py: nonces, HMACs, the
token never sent), so only someone who may submit jobs to that scheduler can put a job (whose
reward functions the host imports and runs) into the host:

    job  -> {"nonce": C}
    host -> {"nonce": S, "proof": HMAC(token, "service", S, C)}
    job  -> {"proof": HMAC(token, "client", S, C), "config": {...}, "name": N, "import_dir": D}
    host -> {"joined": N'}            (queued: LoraHost.join; N' its name in the host)
    host -> {"status": K, "error": E} (once the job ended; K as `rlcu grpo` gives it alone)

A host that has ended (HostClosed), or has no room left under its declared peak for the job's
memory, answers {"closed": true}, and the job then runs elsewhere
(a host of its own); so does one that is unreachable or went away before the status came.
"""

from __future__ import annotations

import json
import os
import socket
import tempfile
import threading
from pathlib import Path

from rlcu.sched import auth
from rlcu.sched.protocol import MAX_BODY, SchedError

CONNECT_S = 10.0  # the handshake; the host's answer may wait for its first jobs' build, the status for the run


def _send(f, msg: dict) -> None:
    f.write(json.dumps(msg).encode() + b"\n")
    f.flush()


def _recv(f) -> dict | None:
    line = f.readline(MAX_BODY + 1)
    if not line or len(line) > MAX_BODY:
        return None
    try:
        msg = json.loads(line)
    except ValueError:
        return None
    return msg if isinstance(msg, dict) else None


class JoinServer:
    """The host's listener (module docstring). `token`: the scheduler's; `bind(host)` once the
    LoraHost exists (connections before it wait); each job's status is sent when it ends."""

    def __init__(self, token: str):
        if not token:
            raise SchedError("a LoRA host's join channel needs the scheduler's token (its proofs)")
        self.token = token
        self._dir = Path(tempfile.mkdtemp(prefix="rlcu-host-"))  # 0700: this user's only
        self.path = self._dir / "join.sock"
        self.address = f"unix:{self.path}"
        self.host = None
        self.admit = None  # admit(GRPOConfig) -> whether the host takes it (its memory: rlcu.sched.host)
        self._bound = threading.Event()
        self._sock: socket.socket | None = None
        self._stop = False

    def start(self) -> JoinServer:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.bind(str(self.path))
        os.chmod(self.path, 0o600)
        s.listen(16)
        self._sock = s
        threading.Thread(target=self._accept, name="lora-host-join", daemon=True).start()
        return self

    def bind(self, host) -> None:
        self.host = host
        self._bound.set()

    def close(self) -> None:
        self._stop = True
        self._bound.set()
        if self._sock is not None:
            try:
                self._sock.close()
            except OSError:
                pass
        for p in (self.path, self._dir):
            try:
                p.unlink() if p.is_socket() else p.rmdir()
            except OSError:
                pass

    def _accept(self) -> None:
        while not self._stop:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn,), name="lora-host-joiner", daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        from rlcu.config import GRPOConfig
        from rlcu.train.core import coerce_config
        from rlcu.train.lora_host import HostClosed

        f = conn.makefile("rwb")
        keep, order = False, threading.Lock()
        try:
            conn.settimeout(CONNECT_S)
            hi = _recv(f)
            if hi is None or not isinstance(hi.get("nonce"), str) or not auth.NONCE.match(hi["nonce"]):
                return
            s = auth.nonce()
            _send(f, {"nonce": s, "proof": auth.proof(self.token, "service", s, hi["nonce"])})
            req = _recv(f)
            if req is None or not auth.same(req.get("proof"), auth.proof(self.token, "client", s, hi["nonce"])):
                _send(f, {"error": "auth"})
                return
            self._bound.wait()
            if self._stop or self.host is None:
                _send(f, {"closed": True})
                return
            if req.get("import_dir"):
                from rlcu.rewards import add_import_dir

                add_import_dir(req["import_dir"])  # the config's folder: its reward modules
            try:
                cfg = coerce_config(GRPOConfig, req.get("config") or {})
                if self.admit is not None and not self.admit(cfg):
                    _send(f, {"closed": True, "full": True})  # no room left under the host's declared peak
                    return
                with order:  # "joined" goes out before the job's status (a refusal can be quick)
                    job = self.host.join(cfg, name=req.get("name"), source=req.get("source"),
                                         on_end=lambda j: self._ended(conn, f, j, order))
                    conn.settimeout(None)
                    _send(f, {"joined": job.name})
                    keep = True  # open until the job ends: _ended closes it
            except HostClosed:
                _send(f, {"closed": True})
                return
            except Exception as e:  # noqa: BLE001 (a config that does not make a job: its error, status 2)
                if keep:
                    return
                _send(f, {"status": 2, "error": f"{type(e).__name__}: {e}" if not str(e) else str(e)})
                return
        except OSError:
            return
        finally:
            if not keep:
                f.close()
                conn.close()

    @staticmethod
    def _ended(conn, f, job, order: threading.Lock) -> None:
        with order:
            pass
        try:
            _send(f, {"status": int(job.status if job.status is not None else 1),
                      "error": None if job.error is None else str(job.error)})
        except OSError:
            pass
        finally:
            f.close()
            conn.close()


def join(address: str, token: str, config: dict, *, name: str | None = None, source: str | None = None,
         import_dir: str | None = None, on_joined=None) -> tuple[int, str | None] | None:
    """Put a job into the host at `address` and wait for its end: (status, error or None), or None
    when the host did not take it (unreachable, ended, closed) and the job should run elsewhere;
    a host that took it and went away before its end gives status 1.
    on_joined(name) is called once the host queued it. Raises SchedError on a failed proof."""
    path = address.removeprefix("unix:")
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        conn.settimeout(CONNECT_S)
        conn.connect(path)
        f = conn.makefile("rwb")
        c = auth.nonce()
        _send(f, {"nonce": c})
        hi = _recv(f)
        if hi is None:
            return None
        if not isinstance(hi.get("nonce"), str) or not auth.same(hi.get("proof"),
                                                                 auth.proof(token, "service", hi["nonce"], c)):
            raise SchedError(f"the LoRA host at {address} did not prove the scheduler's token")
        _send(f, {"proof": auth.proof(token, "client", hi["nonce"], c), "config": config, "name": name,
                  "source": source, "import_dir": import_dir})
        conn.settimeout(None)  # a host still building its first jobs answers once it can take this one
        first = _recv(f)
        if first is None or first.get("closed"):
            return None
        if first.get("error") == "auth":
            raise SchedError(f"the LoRA host at {address} refused this token")
        if "status" in first:
            return int(first["status"]), first.get("error")
        if on_joined is not None:
            on_joined(first.get("joined"))
        end = _recv(f)
        if end is None or "status" not in end:  # queued, maybe trained: not run again elsewhere
            return 1, f"the LoRA host at {address} went away before the job ended"
        return int(end["status"]), end.get("error")
    except (OSError, ValueError):
        return None
    finally:
        conn.close()
