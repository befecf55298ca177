"""The live dashboard (rlcu.sched.dashboard): behind the service's token, read-only, loopback
only; its JSON carries the jobs, the per-device lease timeline and the yields; the page,
loaded in headless Chromium, shows them (and refuses without the token), and a screenshot
is written under the test's folder. The Chromium tests skip, with the reason, only where no
Chromium is installed (.ci/run installs Debian's `chromium`). Under hostile connections
(issue 14, item 6): a bounded number of them, strangers closed first, a back-off when out of
descriptors, and a cookie that is not the token."""

import json
import os
import shutil
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from support.sched_util import cpu_share

import rlcu.sched
from rlcu.sched.client import SchedClient
from rlcu.sched.core import Core
from rlcu.sched.dashboard import Dashboard
from rlcu.sched.server import SchedServer

TOKEN = "dash-t0ken"
SPEC = {"actor": {"devices": 1, "resident": 0.1, "peak": 0.6}}


@pytest.fixture(scope="module")
def live(tmp_path_factory):
    """A service on two CPU slots with three jobs' history (one yield), a rollout and an
    actor_train lease held, and a dashboard on an ephemeral loopback port."""
    tmp = tmp_path_factory.mktemp("dash")
    core = Core([1.0, 1.0], state=tmp / "s.db", device_names=["cpu0", "cpu1"])
    srv = SchedServer(core, f"unix:{tmp / 's.sock'}", TOKEN, tick_s=0.05).start()
    c = SchedClient(srv.address, TOKEN, retry_s=5.0)
    jobs = [c.job(n, SPEC, heartbeat_s=0.5, poll_s=0.0) for n in ("exp-a", "exp-b", "exp-c")]
    for _ in range(2):
        for j in jobs:
            j.release(j.acquire("rollout", mem=0.2))
            j.release(j.acquire("actor_train", mem=0.3))
    # a yield: b's rollout and then c's actor_train on b's device
    dev_b = next(d["index"] for d in c.status()["devices"] if "exp-b:resident" in d["leases"])
    rb = jobs[1].acquire("rollout", mem=0.5)
    hog = c.job("hog", {"h": 1})
    got = []
    t = threading.Thread(target=lambda: got.append(hog.acquire("actor_train", mem=0.6, only=[dev_b])))
    t.start()
    end = time.monotonic() + 5
    while not jobs[1].should_yield(rb):
        assert time.monotonic() < end, "no yield"
        time.sleep(0.02)
    jobs[1].release(rb)
    t.join(5)
    hog.release(got[0])
    hog.finish()
    jobs[0].acquire("rollout", mem=0.2)
    jobs[2].acquire("actor_train", mem=0.3)
    dash = Dashboard(c, "127.0.0.1:0", TOKEN, refresh_s=0.2).start()
    yield dash, c, tmp
    dash.stop()
    for j in jobs:
        j.close()
    srv.stop()


def _get(url, headers=None, method="GET"):
    req = urllib.request.Request(url, headers=headers or {}, method=method)
    opener = urllib.request.build_opener(_NoRedirect)
    try:
        with opener.open(req, timeout=10) as r:
            return r.status, dict(r.headers), r.read()
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers), e.read()


class _NoRedirect(urllib.request.HTTPRedirectHandler):
    def redirect_request(self, *a, **kw):
        return None


def test_token_required_and_read_only(live):
    dash, _, _ = live
    for path in ("", "api/state"):
        code, _, body = _get(dash.url + path)
        assert code == 401 and b"exp-a" not in body
        code, _, body = _get(dash.url + path, {"Authorization": "Bearer wrong"})
        assert code == 401
        code, _, body = _get(dash.url + path, {"Cookie": "rlcu_sched_token=wrong"})
        assert code == 401
    code, _, _ = _get(dash.url + "?token=wrong")
    assert code == 401
    code, h, _ = _get(dash.url + f"?token={TOKEN}")
    assert code == 303 and h["Location"] == "/"
    assert "HttpOnly" in h["Set-Cookie"] and "SameSite=Strict" in h["Set-Cookie"]
    code, h, body = _get(dash.url, {"Cookie": h["Set-Cookie"].split(";")[0]})
    assert code == 200 and b"<svg id=\"timeline\"" in body
    assert "script-src 'sha256-" in h["Content-Security-Policy"] and "default-src 'none'" in h[
        "Content-Security-Policy"]
    for method in ("POST", "PUT", "DELETE"):
        assert _get(dash.url + "api/state", {"Authorization": f"Bearer {TOKEN}"}, method)[0] == 405
    # DNS rebinding: a page of another name that resolves to 127.0.0.1 is refused
    assert _get(dash.url, {"Authorization": f"Bearer {TOKEN}", "Host": "evil.example:80"})[0] == 421


def test_loopback_only(live):
    _, c, _ = live
    for addr in ("0.0.0.0:0", "192.0.2.1:8080", "unix:/tmp/x.sock"):
        with pytest.raises(ValueError, match="loopback"):
            Dashboard(c, addr, TOKEN)
    with pytest.raises(ValueError, match="token"):
        Dashboard(c, "127.0.0.1:0", "")


def test_state_json(live):
    dash, _, _ = live
    code, _, body = _get(dash.url + "api/state", {"Authorization": f"Bearer {TOKEN}"})
    s = json.loads(body)
    assert code == 200 and s["policy"] == "phase"
    assert [j["job"] for j in s["jobs"]] == ["exp-a", "exp-b", "exp-c", "hog"]
    assert {j["job"]: j["phases"] for j in s["jobs"]}["exp-a"] == ["rollout"]
    phases = {(le["job"], le["phase"]) for le in s["leases"]}
    assert {("exp-a", "rollout"), ("exp-c", "actor_train"), ("hog", "actor_train"),
            ("exp-b", "resident:actor")} <= phases
    held = [le for le in s["leases"] if le["held"]]
    assert {(le["job"], le["phase"]) for le in held} >= {("exp-a", "rollout"), ("exp-c", "actor_train")}
    assert all(le["end"] == pytest.approx(s["now"]) for le in held)
    assert [y["job"] for y in s["yields"]] == ["exp-b"]
    assert 0.0 <= s["window"]["idle_frac"] <= 1.0 and s["metrics"]["yields"] == 1
    assert 0.0 < s["window"]["mem_used_frac"] < 1.0


def _chromium():
    exe = shutil.which("chromium") or shutil.which("chromium-browser")
    if exe is None:
        pytest.skip("no Chromium here: `apt-get install chromium` (.ci/run installs it when missing)")
    return exe


def _browse(exe, tmp, url, *extra):
    prof = tmp / f"profile-{time.monotonic_ns()}"
    cmd = [exe, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
           "--disable-background-networking", "--disable-component-update", "--disable-sync",
           f"--user-data-dir={prof}", "--window-size=1280,800", "--virtual-time-budget=5000", *extra, url]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=90, check=False)
    assert r.returncode == 0, r.stderr[-2000:]
    return r.stdout


def test_page_in_chromium(live):
    dash, _, tmp = live
    exe = _chromium()
    dom = _browse(exe, tmp, dash.url + f"?token={TOKEN}", "--dump-dom")
    for job in ("exp-a", "exp-b", "exp-c", "hog"):
        assert f">{job}</td>" in dom, job  # the jobs table
        assert f'data-job="{job}"' in dom, job  # its leases on the timeline
    assert 'data-phase="rollout"' in dom and 'data-phase="actor_train"' in dom
    assert 'class="yield"' in dom and ">cpu0<" in dom and ">cpu1<" in dom
    assert "CPU slots idle (window)" in dom and "GPU idle" not in dom  # a pool of CPU slots has no GPU
    shot = tmp / "dashboard.png"
    _browse(exe, tmp, dash.url + f"?token={TOKEN}", f"--screenshot={shot}")
    data = shot.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000
    print(f"dashboard screenshot: {shot}")


def test_page_refused_without_token_in_chromium(live):
    dash, _, tmp = live
    dom = _browse(_chromium(), tmp, dash.url, "--dump-dom")
    assert "token required" in dom and "exp-a" not in dom and "<svg" not in dom


def test_serve_dashboard_flag(tmp_path):
    """`rlcu sched serve --dashboard 127.0.0.1:PORT` serves the page beside the service."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env_state = tmp_path / "state"
    p = subprocess.Popen([sys.executable, "-m", "rlcu.cli", "sched", "serve", "--cpu-slots", "1", "--state",
                          str(env_state), "--token", TOKEN, "--dashboard", f"127.0.0.1:{port}"],
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        lines = []
        end = time.monotonic() + 30
        while not any("dashboard on" in ln for ln in lines):
            assert time.monotonic() < end and p.poll() is None, "".join(lines)
            lines.append(p.stdout.readline())
        url = f"http://127.0.0.1:{port}/"
        assert _get(url)[0] == 401
        code, _, body = _get(url + "api/state", {"Authorization": f"Bearer {TOKEN}"})
        assert code == 200 and json.loads(body)["devices"][0]["name"] == "cpu0"
    finally:
        p.terminate()
        p.wait(10)


def test_serve_refuses_a_dashboard_off_loopback(tmp_path, capsys):
    from rlcu.sched.cli import main

    state = tmp_path / "state"
    assert main(["sched", "serve", "--cpu-slots", "1", "--state", str(state), "--dashboard", "0.0.0.0:8080"]) == 2
    assert "loopback only" in capsys.readouterr().err
    assert not (state / "sched.sock").exists()  # the service it had opened is closed again


# ---------------------------------------------------------------------- hostile connections (issue 14, item 6)
def test_strangers_cannot_keep_the_page_from_its_user(live):
    """Connections that never send an authorized request used to take a thread each, without
    bound. Now at most `max_conns` (64) are open, strangers the first to go: with 100 of them
    idle, the page's own request is still answered."""
    dash, _, _ = live
    base = threading.active_count()
    idle = [socket.create_connection(("127.0.0.1", dash.srv.server_address[1]), timeout=5) for _ in range(100)]
    try:
        time.sleep(1.2)  # past a stranger's grace
        assert threading.active_count() - base <= 64, threading.active_count() - base
        t = time.monotonic()
        code, _, _ = _get(dash.url + "api/state", {"Authorization": f"Bearer {TOKEN}"})
        assert code == 200 and time.monotonic() - t < 3.0
        assert dash.srv.evicted >= 100 + 1 - 64
    finally:
        for s in idle:
            s.close()


def test_the_cookie_is_not_the_token(live):
    """A page left polling sends its cookie to whoever holds the port once the dashboard is
    down: it must not be the token (nor good at another start of the dashboard)."""
    dash, c, _ = live
    _, h, _ = _get(dash.url + f"?token={TOKEN}")
    cookie = h["Set-Cookie"].split(";")[0]
    assert TOKEN not in cookie
    assert _get(dash.url + "api/state", {"Cookie": cookie})[0] == 200
    other = Dashboard(c, "127.0.0.1:0", TOKEN).start()
    try:
        assert _get(other.url + "api/state", {"Cookie": cookie})[0] == 401
    finally:
        other.stop()


SRC = str(Path(rlcu.sched.__file__).resolve().parents[1])
# a child that imports the scheduler without rlcu/__init__ (which imports torch: seconds here)
LIGHT = f"import sys, types; _p = types.ModuleType('rlcu'); _p.__path__ = [{SRC!r}]; sys.modules['rlcu'] = _p\n"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_out_of_descriptors_the_dashboard_backs_off(tmp_path):
    """Out of descriptors, the dashboard's accept loop used to spin at 100% of a core (the
    listening socket stays readable), in the service's own process."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    state = tmp_path / "state"
    child = subprocess.Popen([sys.executable, "-c", LIGHT + (
        "import resource\n"
        "resource.setrlimit(resource.RLIMIT_NOFILE, (48, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))\n"
        "from rlcu.sched.cli import main\n"
        "sys.exit(main(sys.argv[1:]))\n"), "sched", "serve", "--cpu-slots", "1", "--state", str(state),
        "--dashboard", f"127.0.0.1:{port}"], env={**os.environ, "RLCU_SCHED_TOKEN": TOKEN},
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    held = []
    try:
        end = time.monotonic() + 30
        while "dashboard on" not in child.stdout.readline():
            assert time.monotonic() < end and child.poll() is None
        c = SchedClient(f"unix:{state / 'sched.sock'}", TOKEN, retry_s=5)
        assert c.ping()["ok"]  # (its connection kept: it is served through the flood)
        for _ in range(80):  # more than the child has descriptors for (one at a time: none refused)
            s = socket.socket()
            s.setblocking(False)
            s.connect_ex(("127.0.0.1", port))
            held.append(s)
            time.sleep(0.003)
        end = time.monotonic() + 5
        while len(os.listdir(f"/proc/{child.pid}/fd")) < 46:  # (the limit is 48)
            assert time.monotonic() < end, "the dashboard never took the descriptors"
            time.sleep(0.05)
        time.sleep(0.2)
        used = cpu_share(child.pid)
        assert used < 0.3, f"the service's process used {used:.0%} of a core while out of descriptors"
        assert c.ping()["ok"]
        for s in held:
            s.close()
        held = []
        t = time.monotonic()
        c.job("after", {"c": 1}, heartbeat_s=30).finish()  # a new job gets in at once
        assert time.monotonic() - t < 3.0
        end = time.monotonic() + 10
        while _get(f"http://127.0.0.1:{port}/api/state", {"Authorization": f"Bearer {TOKEN}"})[0] != 200:
            assert time.monotonic() < end, "the dashboard never served again"
            time.sleep(0.2)
    finally:
        for s in held:
            s.close()
        child.kill()
        child.wait()
