"""A live, read-only web page of the scheduler: `rlcu sched serve --dashboard 127.0.0.1:PORT`.

    http://127.0.0.1:PORT/?token=TOKEN     # once: the token becomes a cookie, the URL drops it

What it shows (dashboard.html, one static page of HTML, CSS, JS and SVG, no CDN): the jobs
with their state, phases and waits; a per-device timeline of the leases over the last
`window_s` seconds (one lane per job, resident memory as a thin bar, yields as red marks);
the GPU idle fraction (over the window and since the start), memory in use per device and
its fragmentation, and the yields. The page polls `GET /api/state` (JSON) every 2 s.

Built on the public client API only (`SchedClient.status()` and `.trace()`); the state is
cached for `refresh_s` so any number of open pages cost the service one status and one trace
call a second. Standard library only (`http.server`).

Security. Loopback only (anything else is refused, as the service's TCP is); GET and HEAD
only; every request needs the service's token: `Authorization: Bearer TOKEN`, the
`rlcu_sched_token` cookie (HttpOnly, SameSite=Strict), or `?token=` on the page, which sets
that cookie and redirects. Without it: 401 and no data. The cookie is not the token but an
HMAC of it keyed per start of the dashboard: a page left polling while the dashboard is down
sends it to whoever took the port, who can use it nowhere (not at the service, not at the
next dashboard); the page then asks for the link again. (Bearer sends the token itself, as
any HTTP client does: for scripts.) A Host header other than the loopback address is refused
(DNS rebinding); the page's one inline script is allowed by its hash in a
Content-Security-Policy that allows nothing else from anywhere.

Connections. A thread per connection (the standard library's), at most `max_conns` of them:
at the cap the connection open longest without an authorized request (a *stranger*) is
closed to make room once it is a second old, and until then newcomers wait in the listen
queue, first come first served: strangers cannot keep the page from its user. Out of
descriptors (EMFILE), accepting pauses with a growing back-off (up to 1 s) instead of
spinning on a listening socket that stays readable: the dashboard runs in the service's
process, whose loop it would otherwise starve.
"""

from __future__ import annotations

import base64
import collections
import errno
import hashlib
import hmac
import http.server
import json
import re
import secrets
import socket
import threading
import time
import urllib.parse
from pathlib import Path

from rlcu.sched import metrics as mx
from rlcu.sched.client import SchedClient, SchedError
from rlcu.sched.protocol import is_loopback, parse_address

COOKIE = "rlcu_sched_token"
PAGE = Path(__file__).with_name("dashboard.html")
_ACCEPT_ERRORS = (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM)


def _csp(page: str) -> str:
    scripts = re.findall(r"<script>(.*?)</script>", page, re.DOTALL)
    hashes = " ".join(f"'sha256-{base64.b64encode(hashlib.sha256(s.encode()).digest()).decode()}'" for s in scripts)
    return (f"default-src 'none'; script-src {hashes}; style-src 'unsafe-inline'; connect-src 'self'; "
            "img-src 'self' data:; base-uri 'none'; form-action 'none'; frame-ancestors 'none'")


def timeline(trace: dict, now: float, window_s: float) -> tuple[list[dict], list[dict]]:
    """The trace's lease slices and yield marks in the last `window_s` seconds (times in
    seconds since the service's t0, the trace's origin): (leases, yields)."""
    t0 = now - window_s
    leases, yields = [], []
    for e in trace.get("traceEvents", []):
        if e.get("ph") == "X":
            a, b = e["ts"] / 1e6, (e["ts"] + e["dur"]) / 1e6
            held = not e["args"].get("end")
            if held:
                b = now
            if b < t0:
                continue
            leases.append({"dev": e["pid"], "job": e["args"]["job"], "phase": e["name"], "start": a, "end": b,
                           "mem": e["args"]["mem"], "lease": e["args"]["lease"], "held": held,
                           "resident": e.get("cat") == mx.RESIDENT, "reason": e["args"].get("end", "")})
        elif e.get("ph") == "i" and e["name"].startswith("yield ") and e["ts"] / 1e6 >= t0:
            _, job, _, lid = e["name"].split(" ", 3)
            yields.append({"t": e["ts"] / 1e6, "job": job, "lease": int(lid)})
    return leases, yields


def window_stats(leases: list[dict], capacity: list[float], now: float, window_s: float) -> dict:
    """Idle fraction, memory in use and fragmentation over the window, by metrics.py."""
    t0 = max(0.0, now - window_s)
    spans = [mx.Span(le["lease"], le["job"], mx.RESIDENT if le["resident"] else le["phase"], "", (le["dev"],),
                     (le["mem"],), le["start"], le["end"]) for le in leases]
    mem = mx.memory_stats(spans, capacity, t0, now)
    return {"idle_frac": mx.idle_fraction(spans, len(capacity), t0, now), "mem_used_frac": mem["mem_used_frac"],
            "frag": mem["frag"], "from": t0, "to": now}


class Dashboard:
    """Dashboard(client, "127.0.0.1:8080", token).start() ... .stop(); `.url` is its address."""

    def __init__(self, client: SchedClient, addr: str, token: str, *, window_s: float = 300.0,
                 refresh_s: float = 1.0, max_conns: int = 64):
        kind, where = parse_address(addr)
        if kind != "tcp":
            raise ValueError(f"--dashboard takes a loopback HOST:PORT, e.g. 127.0.0.1:8080, got {addr!r}")
        host, port = where
        if not is_loopback(host):
            raise ValueError(f"refusing to serve the dashboard on {host}: loopback only (127.0.0.1 or ::1)")
        if not token:
            raise ValueError("the dashboard needs the service's token")
        self.client, self.token, self.window_s, self.refresh_s = client, token, float(window_s), float(refresh_s)
        self.cookie = hmac.new(token.encode(), b"rlcu-sched dashboard cookie\0" + secrets.token_bytes(16),
                               hashlib.sha256).hexdigest()  # (a new one each start: one taken is good for no other)
        self.page = PAGE.read_text()
        self.csp = _csp(self.page)
        self._lock = threading.Lock()
        self._cache: tuple[float, bytes] | None = None
        cls = type("_HTTP", (_Server,), {"address_family": socket.AF_INET6 if ":" in host else socket.AF_INET})
        self.srv = cls((host, port), _Handler)
        self.srv.dash, self.srv.max_conns = self, max_conns
        h, p = self.srv.server_address[:2]
        self.hosts = {f"{h}:{p}", f"[{h}]:{p}", f"localhost:{p}"}
        self.url = f"http://{f'[{h}]' if ':' in h else h}:{p}/"
        self._thread: threading.Thread | None = None

    def authorized(self, headers) -> bool:
        auth = headers.get("Authorization", "")
        if auth.startswith("Bearer ") and hmac.compare_digest(auth[len("Bearer "):].strip().encode(),
                                                                self.token.encode()):
            return True
        for part in headers.get("Cookie", "").split(";"):
            k, _, v = part.strip().partition("=")
            if k == COOKIE and hmac.compare_digest(urllib.parse.unquote(v).encode(), self.cookie.encode()):
                return True
        return False

    def state(self) -> bytes:
        """The page's JSON, rebuilt at most every refresh_s."""
        with self._lock:
            if self._cache is not None and time.monotonic() - self._cache[0] < self.refresh_s:
                return self._cache[1]
            try:
                body = json.dumps(self._build()).encode()
            except SchedError as e:
                body = json.dumps({"error": f"the scheduler did not answer: {e}"}).encode()
            self._cache = (time.monotonic(), body)
            return body

    def _build(self) -> dict:
        st = self.client.status()
        m = st["metrics"]
        now = m.get("uptime_s", 0.0)  # the trace's clock: seconds since t0
        leases, yields = timeline(self.client.trace(), now, self.window_s)
        cap = [d["capacity"] for d in st["devices"]]
        return {"policy": st["policy"], "now": now, "window_s": self.window_s, "devices": st["devices"],
                "jobs": st["jobs"], "metrics": m, "window": window_stats(leases, cap, now, self.window_s),
                "leases": leases, "yields": yields}

    def start(self) -> Dashboard:
        self._thread = threading.Thread(target=self.srv.serve_forever, kwargs={"poll_interval": 0.1},
                                        name="sched-dashboard", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self.srv.quit.set()  # (ends a back-off pause at once)
        if self._thread is not None:
            self.srv.shutdown()
            self._thread.join(timeout=5)
            self._thread = None
        self.srv.server_close()

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()


class _Server(http.server.ThreadingHTTPServer):
    """The standard library's threaded server, with a connection cap that closes strangers
    first (and otherwise leaves newcomers in the listen queue, first come first served, rather
    than refusing them), and a back-off when accept() runs out of descriptors."""

    daemon_threads = True
    request_queue_size = 128  # (the listen queue newcomers wait in at the cap)
    max_conns = 64
    grace = 1.0  # a stranger this young keeps its chance (it may be the page's own request)

    def __init__(self, *a, **kw):
        self.quit = threading.Event()
        self.accept_errors, self.evicted, self._backoff = 0, 0, 0.01
        self._open: collections.OrderedDict[socket.socket, list] = collections.OrderedDict()  # -> [born, known]
        self._room = threading.Condition()
        super().__init__(*a, **kw)
        self.socket.setblocking(False)  # (a newcomer that left while we waited for room: no accept blocks)

    def get_request(self):
        with self._room:  # at the cap: wait for a slot, or for the oldest stranger to be past its grace
            while not self.quit.is_set() and len(self._open) >= self.max_conns:
                oldest = next((born for born, known in self._open.values() if not known), None)
                left = 0.1 if oldest is None else oldest + self.grace - time.monotonic()
                if left <= 0:
                    break
                self._room.wait(min(left, 0.1))
        try:
            got = super().get_request()
        except OSError as e:
            if e.errno in _ACCEPT_ERRORS:  # the listening socket stays readable: pause, or spin on it
                self.accept_errors += 1
                self.quit.wait(self._backoff)
                self._backoff = min(1.0, self._backoff * 2)
            raise
        self._backoff = 0.01
        return got

    def process_request(self, request, client_address):
        victim = None
        with self._room:
            if len(self._open) >= self.max_conns:  # (past its grace: get_request waited for that)
                victim = next((s for s, (_, known) in self._open.items() if not known), None)
                if victim is not None:
                    del self._open[victim]
                    self.evicted += 1
            self._open[request] = [time.monotonic(), False]
        if victim is not None:  # its thread reads an end of file and ends
            try:
                victim.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        super().process_request(request, client_address)

    def known(self, request) -> None:
        """The connection sent an authorized request: no longer a stranger."""
        with self._room:
            if request in self._open:
                self._open[request][1] = True

    def shutdown_request(self, request):
        with self._room:
            self._open.pop(request, None)
            self._room.notify()
        super().shutdown_request(request)


class _Handler(http.server.BaseHTTPRequestHandler):
    server_version = "rlcu-sched-dashboard"
    timeout = 10  # seconds a connection may stay silent (no thread held by an idle socket)
    sys_version = ""

    def log_message(self, *a) -> None:  # quiet: the service's own log is what matters
        pass

    def _send(self, code: int, body: bytes, ctype: str, extra: dict | None = None) -> None:
        d = self.server.dash
        self.send_response(code)
        headers = {"Content-Type": ctype, "Content-Length": str(len(body)), "Cache-Control": "no-store",
                   "X-Content-Type-Options": "nosniff", "Referrer-Policy": "no-referrer",
                   "X-Frame-Options": "DENY", "Content-Security-Policy": d.csp, **(extra or {})}
        for k, v in headers.items():
            self.send_header(k, v)
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def _refuse(self, code: int, msg: str) -> None:
        self._send(code, f"<!doctype html><title>rlcu sched</title><p id=refused>{msg}</p>".encode(),
                   "text/html; charset=utf-8")

    def do_GET(self) -> None:
        d = self.server.dash
        if self.headers.get("Host") not in d.hosts:
            return self._refuse(421, "this dashboard answers on its loopback address only")
        url = urllib.parse.urlsplit(self.path)
        q = urllib.parse.parse_qs(url.query)
        if url.path == "/" and "token" in q:  # the one-time link: token -> cookie, then a clean URL
            tok = q["token"][0]
            if not hmac.compare_digest(tok.encode(), d.token.encode()):
                return self._refuse(401, "wrong token")
            self.server.known(self.connection)
            cookie = f"{COOKIE}={d.cookie}; HttpOnly; SameSite=Strict; Path=/"
            return self._send(303, b"", "text/plain", {"Location": "/", "Set-Cookie": cookie})
        if not d.authorized(self.headers):
            return self._refuse(401, "token required: open the link with ?token=TOKEN (the service's token, "
                                     "in &lt;state&gt;/token)")
        self.server.known(self.connection)
        if url.path == "/":
            return self._send(200, d.page.encode(), "text/html; charset=utf-8")
        if url.path == "/api/state":
            return self._send(200, d.state(), "application/json")
        return self._refuse(404, "not found")

    do_HEAD = do_GET

    def _read_only(self) -> None:
        self._refuse(405, "read-only")

    do_POST = do_PUT = do_DELETE = do_PATCH = _read_only


def start_dashboard(client: SchedClient, addr: str, token: str, **kw) -> Dashboard:
    """Serve the dashboard in a daemon thread (what `rlcu sched serve --dashboard` calls)."""
    return Dashboard(client, addr, token, **kw).start()
