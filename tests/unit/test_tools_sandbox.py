"""run_python's limits (docs/tools.md), each run bounded by a wall limit of a few seconds. Runs as
the caller's uid (sys.executable) and, where the caller is root and a system interpreter is open
to other users, as a fresh uid of its own: the two modes guarantee different things."""

import os
import socket
import sys

import pytest

from rlcu.tools import SandboxLimits, run_python
from rlcu.tools.confine import others_can_run

SYSTEM_PY = "/usr/bin/python3"
MODES = [pytest.param(sys.executable, id="caller-python")]
if os.geteuid() == 0 and os.path.exists(SYSTEM_PY) and others_can_run(SYSTEM_PY):
    MODES.append(pytest.param(SYSTEM_PY, id="own-uid"))


@pytest.fixture(params=MODES)
def python(request):
    return request.param


def test_normal_code_returns_its_stdout(python):
    r = run_python("import sys\nprint(sum(range(10)))\nprint(sys.flags.isolated)", python=python, timeout_s=10)
    assert (r.stdout, r.stderr, r.exit_status, r.limit) == ("45\n1\n", "", 0, None)
    assert r.ok and r.text() == "45\n1\n"


def test_syntax_error_comes_back_as_stderr(python):
    r = run_python("def f(:\n", python=python, timeout_s=10)
    assert r.exit_status == 1 and r.limit is None and "SyntaxError" in r.stderr
    assert "SyntaxError" in r.text() and "[exit status 1]" in r.text()


def test_fork_bomb_ends_within_the_wall_limit_and_leaves_no_process(python):
    code = ("import os\nprint(os.getpgid(0), flush=True)\n"
            "while True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n")
    r = run_python(code, python=python, timeout_s=2.0, cpu_s=10)
    assert r.wall_s < 2.0 + 3.0, r
    assert r.limit == "wall" or r.own_uid  # a fresh uid's RLIMIT_NPROC stops it first
    assert _live_in_group(int(r.stdout.split()[0])) == []


def _live_in_group(pgid: int) -> list[str]:
    """The processes of group `pgid` that are not zombies (a zombie holds a pid slot only, and
    reaping the orphans is the init's job: see docs/tools.md)."""
    live = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid and fields[0] not in ("Z", "X"):
            live.append(pid)
    return live


def test_infinite_loop_ends_by_cpu_or_wall_limit(python):
    r = run_python("while True:\n    pass\n", python=python, timeout_s=4.0, cpu_s=1)
    assert r.limit == "cpu" and r.wall_s < 4.0, r
    r = run_python("import time\ntime.sleep(60)\n", python=python, timeout_s=1.0)
    assert r.limit == "wall" and r.wall_s < 3.0 and "wall limit" in r.text(), r


def test_huge_allocation_fails_and_the_parent_is_unaffected(python):
    r = run_python("x = bytearray(10 * 2**30)\nprint('allocated')\n", python=python, timeout_s=10, memory_mb=512)
    assert r.limit == "memory" and "MemoryError" in r.stderr and "allocated" not in r.stdout, r
    big = bytearray(64 << 20)  # the parent's own address space has no such limit
    assert len(big) == 64 << 20


def test_huge_output_is_truncated_to_the_limit(python):
    r = run_python("import sys\nsys.stdout.write('a' * 100_000_000)\nsys.stderr.write('e' * 5000)\n",
                   python=python, timeout_s=20, output_bytes=1000)
    assert r.exit_status == 0 and r.stdout == "a" * 1000 and r.stdout_truncated
    assert r.stderr == "e" * 1000 and r.stderr_truncated
    assert "[stdout truncated]" in r.text()


def test_network_connect_and_dns_fail(python):
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(1)
    port = srv.getsockname()[1]
    try:
        for network in ("auto", "audit"):
            code = f"import socket\ns = socket.create_connection(('127.0.0.1', {port}), timeout=2)\nprint('connected')"
            r = run_python(code, python=python, timeout_s=10, network=network)
            assert r.exit_status == 1 and "connected" not in r.stdout, (network, r)
            r = run_python("import socket\nprint(socket.getaddrinfo('example.com', 80))", python=python,
                           timeout_s=10, network=network)
            assert r.exit_status == 1 and ("gaierror" in r.stderr or "PermissionError" in r.stderr), (network, r)
        srv.settimeout(0.1)
        with pytest.raises(TimeoutError):
            srv.accept()
    finally:
        srv.close()


def test_audit_mode_refuses_new_programs(python):
    r = run_python("import subprocess\nsubprocess.run(['true'])\nprint('ran')", python=python, timeout_s=10,
                   network="audit")
    assert r.exit_status == 1 and "ran" not in r.stdout and "subprocess.Popen is not allowed" in r.stderr, r


def test_parent_files_and_environment(python, tmp_path, monkeypatch):
    """The guarantee: the environment is never inherited; files readable only by their owner are
    closed to a fresh uid; the filesystem is not hidden (a world-readable file stays readable)."""
    monkeypatch.setenv("HF_TOKEN", "hf_secret_value")
    secret = tmp_path / "secret.txt"
    secret.write_text("top secret")
    secret.chmod(0o600)
    public = tmp_path / "public.txt"
    public.write_text("public")
    public.chmod(0o644)
    code = f"import os\nprint('HF_TOKEN' in os.environ)\nprint(open({str(secret)!r}).read())\n"
    r = run_python(code, python=python, timeout_s=10)
    assert r.stdout.splitlines()[0] == "False"
    if r.own_uid:
        assert "PermissionError" in r.stderr and "top secret" not in r.stdout, r
    else:
        assert r.stdout.splitlines()[1] == "top secret", r  # the caller's uid: documented as readable
    code = "print(open('/etc/passwd').read()[:4])\nopen('out.txt', 'w').write('x')\nimport os\nprint(os.getcwd())"
    r = run_python(code, python=python, timeout_s=10)
    assert r.exit_status == 0 and r.stdout.startswith("root"), r
    assert not os.path.exists(r.stdout.split()[1])  # the working folder is removed afterwards


def test_limits_are_validated():
    with pytest.raises(ValueError, match="memory_mb"):
        SandboxLimits(memory_mb=0)
    with pytest.raises(ValueError, match="network"):
        run_python("pass", network="none")
