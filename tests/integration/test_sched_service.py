"""The scheduler service: restart recovery, dead-job reclaim, every invalid request refused
with a clear error, loopback TCP with a token, and the CLI (status, cancel, metrics, trace,
submit). Servers listen on Unix sockets in tmp folders or on 127.0.0.1, and are stopped."""

import json
import socket
import sys
import threading
import time

import pytest
from support.sched_util import hello, services

from rlcu.sched.cli import main
from rlcu.sched.client import JobEnded, SchedClient, SchedError
from rlcu.sched.core import Core
from rlcu.sched.server import SchedServer, load_token

TOKEN = "t0ken"


@pytest.fixture
def service(tmp_path):
    with services(tmp_path, TOKEN) as start:
        yield start


def wait_for(cond, timeout=5.0):
    end = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > end:
            raise AssertionError("condition not met in time")
        time.sleep(0.02)


def test_phases_share_and_yield(service):
    _srv, c = service()
    spec = {"actor": {"devices": 1, "resident": 10, "peak": 40}}
    a, b = c.job("a", spec, heartbeat_s=0.2), c.job("b", spec, heartbeat_s=0.2)
    for j in (a, b):
        with j.phase("init", mem=1):
            pass
    ra, rb = a.acquire("rollout", mem=30), b.acquire("rollout", mem=30)
    assert c.status()["devices"][0]["used"] == 80.0
    a.release(ra)
    got = []
    t = threading.Thread(target=lambda: got.append(a.acquire("actor_train", mem=40)))
    t.start()
    wait_for(lambda: b.should_yield(rb))
    b.release(rb)
    t.join(5)
    assert got and got[0].phase == "actor_train"
    a.release(got[0])
    a.finish()
    b.finish()
    m = c.metrics()
    assert m["jobs_done"] == 2 and m["yields"] == 1 and m["mem_in_use"] == [0.0]
    ev = c.trace()["traceEvents"]
    assert {e["name"] for e in ev if e["ph"] == "X"} >= {"init", "rollout", "actor_train", "resident:actor"}


def test_restart_recovers_jobs_requests_and_leases(service):
    srv, c = service(capacity=(1.0,))
    a = c.job("a", {"c": 1}, heartbeat_s=0.1)
    b = c.job("b", {"c": 1}, heartbeat_s=0.1)
    la = a.acquire("actor_train")  # whole device
    rid = c.call("request", job="b", phase="values")["request"]
    srv.stop()  # the service dies with a lease held and a request pending
    _srv2, c2 = service(capacity=None)  # same state folder: the pool comes from the database
    st = {j["job"]: j for j in c2.status()["jobs"]}
    assert st["a"]["phases"] == ["actor_train"] and st["b"]["waiting"][0]["phase"] == "values"
    a.release(la)  # the old handle finds the new service
    view = c.call("wait", job="b", version=-1, timeout=0)  # (the job's secret holds across the restart)
    wait_for(lambda: any(le["request"] == rid for le in c.call("heartbeat", job="b")["leases"]))
    assert view["state"] == "running"
    with pytest.raises(SchedError, match="already released"):
        a.release(la)
    a.finish()
    b.finish()


def test_state_of_another_pool_is_refused(tmp_path):
    Core([1.0, 1.0], state=tmp_path / "s.db").close()
    with pytest.raises(ValueError, match="belongs to a pool"):
        Core([1.0], state=tmp_path / "s.db")


def test_dead_job_lease_reclaimed(service):
    _srv, c = service(capacity=(1.0,), hb=0.4)
    a = c.job("a", {"c": 1}, heartbeat_s=0.1)
    b = c.job("b", {"c": 1}, heartbeat_s=0.1)
    la = a.acquire("actor_train")
    a.close()  # a stops heartbeating (as if its process died)
    t0 = time.monotonic()
    lb = b.acquire("actor_train", timeout=5)  # granted once a is declared dead
    assert 0.3 < time.monotonic() - t0 < 3.0
    assert c.status()["jobs"][0]["state"] == "dead"
    with pytest.raises(JobEnded, match="dead"):
        a.release(la)
    b.release(lb)
    b.finish()


def test_cancel_reaches_the_job(service, capsys):
    srv, c = service(capacity=(1.0,))
    a = c.job("a", {"c": 1}, heartbeat_s=0.1, poll_s=0.0)
    la = a.acquire("rollout")
    # --now ends it at once (a plain cancel's graceful stop: tests/test_sched_cancel.py)
    assert main(["sched", "cancel", "a", "--now", "--addr", srv.address, "--token", TOKEN]) == 0
    with pytest.raises(JobEnded, match="cancelled"):
        a.should_yield(la)
    assert main(["sched", "cancel", "a", "--addr", srv.address, "--token", TOKEN]) == 1
    assert "already cancelled" in capsys.readouterr().err
    a.close()


def raw(srv, msg: bytes, shake: bool = True) -> dict:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.connect(srv.address[len("unix:"):])
    if shake:
        hello(s)
    s.sendall(msg)
    buf = b""
    while not buf.endswith(b"\n"):
        buf += s.recv(65536)
    s.close()
    return json.loads(buf)


@pytest.mark.parametrize("op, args, msg", [
    ("request", {"job": "ghost", "phase": "rollout"}, "needs the job's secret"),
    ("request", {"job": "a", "phase": "rollout", "only": [5]}, "device 5 is outside the pool"),
    ("request", {"job": "a", "phase": "actor_train", "mem": 500}, "only 0 devices have that much"),
    ("request", {"job": "a", "phase": "actor_train", "devices": 3}, "wants 3 devices; the pool has 2"),
    ("request", {"job": "a", "phase": "lunch"}, "unknown phase 'lunch'"),
    ("request", {"job": "a", "phase": "rollout", "cluster": "critic"}, "no cluster 'critic'"),
    ("release", {"job": "a", "lease": 12345}, "unknown lease 12345"),
    ("release", {"job": "a", "lease": "x"}, "lease must be a lease or request id"),
    ("register", {"job": "a", "clusters": {"c": 1}}, "already exists"),
    ("register", {"job": "b", "clusters": {"c": 3}}, "wants 3 devices; the pool has 2"),
    ("register", {"job": "b", "clusters": {"c": {"devices": 1, "resident": 100}}}, "largest device has 80"),
    ("register", {"job": "bad name!", "clusters": {"c": 1}}, "job must be 1-128 characters"),
    ("frobnicate", {}, "unknown op 'frobnicate'"),
    ("request", {"job": "a"}, "needs 'phase'"),
    ("request", {"job": "a", "phase": "rollout", "colour": 1}, "takes no argument 'colour'"),
    ("request", {"job": "a", "phase": ["rollout"]}, "phase must be 1-128 characters"),
    ("request", {"job": "a", "phase": "rollout", "devices": "two"}, "devices must be an integer"),
])
def test_invalid_requests(service, op, args, msg):
    _srv, c = service(capacity=(80.0, 80.0))
    c.call("register", job="a", clusters={"c": 1})
    with pytest.raises(SchedError, match=msg):
        c.call(op, **args)
    assert c.status()["devices"][0]["used"] == 0.0  # nothing changed


def test_double_release_and_resident_release(service):
    _srv, c = service()
    a = c.job("a", {"actor": {"devices": 1, "resident": 5}}, heartbeat_s=1)
    le = a.acquire("init", mem=1)
    a.release(le)
    with pytest.raises(SchedError, match="already released"):
        a.release(le)
    res = next(x for x in a.view["leases"] if x["phase"] == "resident")
    with pytest.raises(SchedError, match="resident memory .* ends with the job"):
        a.release(res["id"])
    b = c.job("b", {"c": 1}, heartbeat_s=1)
    with pytest.raises(SchedError, match="belongs to job 'a'"):
        b.release(res["id"])
    a.finish()
    b.finish()


def test_protocol_errors(service):
    srv, _ = service()
    assert raw(srv, b"not json\n")["code"] == "protocol"
    assert raw(srv, b"[1, 2]\n")["code"] == "protocol"
    r = raw(srv, b'{"op": "ping", "token_proof": "%s"}\n' % (b"0" * 64))
    assert not r["ok"] and r["code"] == "auth" and "token" in r["error"]
    assert raw(srv, b'{"op": "ping"}\n')["code"] == "auth"
    r = raw(srv, b'{"op": "ping", "token": "t0ken"}\n')  # a client of protocol 1: the token in clear
    assert r["code"] == "auth" and "never takes" in r["error"] and "upgrade rlcu on the client" in r["error"], r
    assert raw(srv, b'{"op": "ping"}\n', shake=False)["code"] == "hello"  # no handshake


def test_tcp_loopback_with_token(service, tmp_path):
    srv, c = service(addr="127.0.0.1:0", state=None)
    assert srv.address.startswith("127.0.0.1:") and c.ping()["ok"]
    with pytest.raises(SchedError, match="did not prove it knows the key: the token differs"):
        SchedClient(srv.address, "nope").ping()
    with pytest.raises(ValueError, match="loopback only"):
        SchedServer(Core([1.0]), "0.0.0.0:0", TOKEN)


def test_token_file_found_beside_socket(tmp_path):
    tok = load_token(tmp_path)
    assert (tmp_path / "token").stat().st_mode & 0o777 == 0o600
    srv = SchedServer(Core([1.0]), f"unix:{tmp_path / 'sched.sock'}", tok).start()
    try:
        assert SchedClient(srv.address).ping()["ok"]  # token read from the file beside the socket
        assert (tmp_path / "sched.sock").stat().st_mode & 0o777 == 0o600
    finally:
        srv.stop()
    assert not (tmp_path / "sched.sock").exists()


def test_cli_status_metrics_trace(service, tmp_path, capsys):
    srv, c = service(capacity=(80.0,))
    a = c.job("exp-1", {"actor": {"devices": 1, "resident": 8, "peak": 30}}, heartbeat_s=1)
    a.acquire("rollout", mem=20)
    c.call("register", job="exp-2", clusters={"actor": {"devices": 1, "resident": 8, "peak": 30}})
    c.call("request", job="exp-2", phase="actor_train", mem=30)
    base = ["--addr", srv.address, "--token", TOKEN]
    assert main(["sched", "status", *base]) == 0
    out = capsys.readouterr().out
    assert "exp-1" in out and "rollout" in out and "slot0" in out and "fragmentation" in out
    assert main(["sched", "status", "--json", *base]) == 0
    st = json.loads(capsys.readouterr().out)
    assert [j["job"] for j in st["jobs"]] == ["exp-1", "exp-2"]
    assert main(["sched", "metrics", "--json", *base]) == 0
    m = json.loads(capsys.readouterr().out)
    assert {"gpu_idle_frac", "jobs_per_hour", "mean_latency_s", "mem_in_use", "frag_now", "frag"} <= set(m)
    assert main(["sched", "trace", str(tmp_path / "t.json"), *base]) == 0
    assert json.loads((tmp_path / "t.json").read_text())["traceEvents"]
    a.finish()


def test_cli_submit_launches_a_command_job(service, tmp_path, capsys):
    srv, c = service(capacity=(1.0,))
    worker = tmp_path / "worker.py"
    worker.write_text(  # speaks the wire protocol itself (importing rlcu would import torch: slow here)
        "import hashlib, hmac, json, os, secrets, socket, sys\n"
        "assert 'RLCU_SCHED_TOKEN' not in os.environ\n"  # the worker acts with its job's secret alone
        "key, job = os.environ['RLCU_SCHED_JOB_SECRET'].encode(), os.environ['RLCU_SCHED_JOB']\n"
        "def proof(role, s, c):\n"  # protocol 2's handshake (rlcu.sched.auth): the secret never travels
        "    return hmac.new(key, f'rlcu-sched/2 {role}\\n{s}\\n{c}'.encode(), hashlib.sha256).hexdigest()\n"
        "def call(**m):\n"
        "    s = socket.socket(socket.AF_UNIX); s.connect(sys.argv[1][len('unix:'):]); f = s.makefile()\n"
        "    c = secrets.token_hex(16)\n"
        "    s.sendall((json.dumps({'op': 'hello', 'nonce': c, 'job': job}) + '\\n').encode())\n"
        "    h = json.loads(f.readline())\n"
        "    assert hmac.compare_digest(h['proof'], proof('service', h['nonce'], c)), h\n"
        "    s.sendall((json.dumps({**m, 'secret_proof': proof('client', h['nonce'], c)}) + '\\n').encode())\n"
        "    r = json.loads(f.readline()); s.close(); assert r['ok'], r; return r\n"
        "assert job == sys.argv[2]\n"
        "call(op='register', job=job, clusters={}, attach=True)\n"
        "rid = call(op='request', job=job, phase='actor_train')['request']\n"
        "v = call(op='wait', job=job, timeout=5)\n"
        "while not any(le['request'] == rid for le in v['leases']):\n"
        "    v = call(op='wait', job=job, version=v['version'], timeout=5)\n"
        "call(op='release', job=job, lease=[le for le in v['leases'] if le['request'] == rid][0]['id'])\n"
        "call(op='finish', job=job)\n")
    job = tmp_path / "job.yaml"
    job.write_text(f"name: cmd-job\nclusters: {{c: 1}}\n"
                   f"command: [{sys.executable}, {worker}, '{{addr}}', '{{name}}']\n")
    assert main(["sched", "submit", str(job), "--addr", srv.address, "--token", TOKEN]) == 0
    assert "submitted cmd-job" in capsys.readouterr().out
    wait_for(lambda: c.status()["jobs"][0]["state"] == "done", timeout=60)
    log = tmp_path / "logs" / "cmd-job.log"  # the worker's log is its user's alone
    assert log.stat().st_mode & 0o777 == 0o600 and (tmp_path / "logs").stat().st_mode & 0o777 == 0o700
    assert main(["sched", "submit", str(job), "--addr", srv.address, "--token", TOKEN, "--no-launch"]) == 1
    assert "already exists" in capsys.readouterr().err
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: x\ncommand: [true]\n")
    assert main(["sched", "submit", str(bad), "--addr", srv.address, "--token", TOKEN]) == 2
    assert "needs clusters" in capsys.readouterr().err


def test_no_service_is_a_clear_error(tmp_path, capsys):
    assert main(["sched", "status", "--addr", f"unix:{tmp_path / 'none.sock'}", "--token", "x"]) == 1
    assert "no scheduler at" in capsys.readouterr().err


def test_grpo_cli_reports_missing_scheduler(tmp_path, capsys):
    """`rlcu grpo --scheduler` (the rlcu command hands the scheduler's job to the trainers' CLI)."""
    from rlcu.cli import main

    rc = main(["grpo", "--set", "steps=1", "--scheduler", f"unix:{tmp_path}/none.sock"])
    assert rc == 2
    assert "no scheduler at unix:" in capsys.readouterr().err


@pytest.mark.parametrize("exc, code, msg", [(SchedError("no scheduler at x"), 2, "scheduler error: no scheduler at x"),
                                           (JobEnded("cancelled"), 3, "the scheduler ended the job: cancelled")])
def test_scheduled_job_exit_codes(capsys, exc, code, msg):
    """`rlcu grpo --scheduler` and `python -m rlcu.sched.job` map the scheduler's refusals to
    exit codes (2: an error, 3: the scheduler ended the job) with the reason, no traceback."""
    from rlcu.sched.job import run_grpo_exit_code

    class Refusing:
        def job(self, *a, **k):
            raise exc

    cfg = {"model": {"tiny": {"vocab_size": 64, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
                              "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 16}}}
    assert run_grpo_exit_code("rlcu grpo", cfg, client=Refusing(), name="j") == code
    err = capsys.readouterr().err
    assert err == f"rlcu grpo: {msg}\n"


def test_client_rides_out_a_full_listen_backlog(tmp_path):
    """Many jobs connecting at once can fill the service's listen backlog; a Unix socket then
    refuses at once with EAGAIN. The client retries until the service accepts (within its
    retry_s), and the service listens with room for a pool's worth of jobs."""
    from rlcu.sched.auth import nonce, proof
    from rlcu.sched.client import SocketTransport

    path = str(tmp_path / "s.sock")
    lsn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    lsn.bind(path)
    lsn.listen(0)
    pending = []
    for _ in range(8):  # connections nobody accepts yet: the backlog fills
        c = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        c.setblocking(False)
        try:
            c.connect(path)
        except BlockingIOError:
            c.close()
            break
        pending.append(c)
    else:
        pytest.skip("this kernel never reported a full Unix-socket backlog")

    def reply(conn):  # a service that knows the token "tok": the handshake, then one reply
        with conn, conn.makefile("rb") as f:
            line = f.readline()
            if line:
                s = nonce()
                conn.sendall(json.dumps({"ok": True, "nonce": s,
                                         "proof": proof("tok", "service", s, json.loads(line)["nonce"])}).encode()
                             + b"\n")
            if f.readline():
                conn.sendall(b'{"ok": true}\n')

    def serve():
        time.sleep(0.3)
        while True:
            try:
                conn, _ = lsn.accept()
            except OSError:
                return
            threading.Thread(target=reply, args=(conn,), daemon=True).start()

    threading.Thread(target=serve, daemon=True).start()
    t = time.monotonic()
    try:
        assert SocketTransport(f"unix:{path}", "tok", timeout=5, retry_s=5).call({"op": "status"}) == {"ok": True}
        assert time.monotonic() - t >= 0.25  # it waited for the backlog to drain
    finally:
        for c in pending:
            c.close()
        lsn.close()
