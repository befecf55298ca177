"""TRL's GRPOTrainer under the scheduler (rlcu.sched.integrations.trl), on CPU slots: two tiny
GRPO jobs (a random Qwen3 from a transformers config, a word-level tokenizer, a trivial
reward) train side by side under one service; both finish, each holds rollout and
actor_train leases, nothing is double-booked in the trace, and a yield asked of one job is
honoured at its next generation boundary. Skipped where TRL is not installed."""

import threading
import time

import pytest
from support.sched_util import services

from rlcu.sched.client import SchedClient
from rlcu.sched.core import Core
from rlcu.sched.server import SchedServer

TOKEN = "trl-t0ken"
V = 48
MEM = {"resident": 0.1, "rollout": 0.2, "actor_train": 0.3}  # of a CPU slot's 1.0


def _trainer(tmp_path, name: str, steps: int, use_cpu: bool = True, reward=None):
    import datasets
    import torch
    import trl
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast, Qwen3Config, Qwen3ForCausalLM

    vocab = {"<unk>": 0, "<eos>": 1, **{f"t{i}": i for i in range(2, V)}}
    wl = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    wl.pre_tokenizer = pre_tokenizers.Whitespace()
    tok = PreTrainedTokenizerFast(tokenizer_object=wl, unk_token="<unk>", eos_token="<eos>", pad_token="<eos>")
    torch.manual_seed(0)
    cfg = Qwen3Config(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                      num_key_value_heads=1, head_dim=16, max_position_embeddings=64, eos_token_id=1, pad_token_id=1,
                      bos_token_id=None)
    model = Qwen3ForCausalLM(cfg)
    g = torch.Generator().manual_seed(1)
    ds = datasets.Dataset.from_list(
        [{"prompt": " ".join(f"t{i}" for i in torch.randint(2, V, (4,), generator=g).tolist())} for _ in range(32)])

    def distinct(completions, **kw):  # more distinct words, more reward
        return [float(len(set(c.split()))) for c in completions]

    args = trl.GRPOConfig(output_dir=str(tmp_path / name), per_device_train_batch_size=4, num_generations=2,
                          max_completion_length=4, max_steps=steps, learning_rate=1e-3, beta=0.0, logging_steps=1,
                          report_to=[], save_strategy="no", use_cpu=use_cpu, seed=0, disable_tqdm=True)
    return trl.GRPOTrainer(model=model, reward_funcs=[reward or distinct], args=args, train_dataset=ds,
                           processing_class=tok)


def _no_double_booking(trace: dict, capacity: float = 1.0) -> None:
    """Per device: the leases live at any instant sum to at most its capacity."""
    by_dev: dict[int, list] = {}
    for e in trace["traceEvents"]:
        if e["ph"] == "X":
            by_dev.setdefault(e["pid"], []).append((e["ts"], e["ts"] + e["dur"], e["args"]["mem"]))
    assert by_dev
    for dev, spans in by_dev.items():
        for t in sorted({a for a, _, _ in spans}):
            live = sum(m for a, b, m in spans if a <= t < b)
            assert live <= capacity + 1e-6, f"device {dev} holds {live} > {capacity} at {t} us"


@pytest.fixture
def service(tmp_path):
    with services(tmp_path, TOKEN) as start:
        yield start((1.0,), device_names=["cpu0"])


def test_two_trl_jobs_share_a_slot_and_a_yield_is_honoured(tmp_path, service):
    pytest.importorskip("trl")
    pytest.importorskip("datasets")
    from rlcu.sched.integrations.trl import scheduled

    srv, c = service
    ta = _trainer(tmp_path, "a", 3)
    # after a's first sub-batch a hog asks for 0.7 of the slot: a's rollout must yield at the
    # boundary that follows (the one between that sub-batch and the next)
    asked = threading.Event()
    sub_batch = ta._generate_single_turn

    def sub_batch_then_hog(*args, **kw):
        out = sub_batch(*args, **kw)
        if not asked.is_set():
            asked.set()
            hog = c.job("hog", {"h": 1})
            threading.Thread(target=lambda: (hog.release(hog.acquire("actor_train", mem=0.7)), hog.finish()),
                             daemon=True).start()
            end = time.monotonic() + 10
            while not a.sched.job.should_yield(a.sched.held):  # the service has marked the yield
                assert time.monotonic() < end, f"no yield notice for job a: {c.status()}"
                time.sleep(0.01)
        return out

    ta._generate_single_turn = sub_batch_then_hog
    a = scheduled(ta, srv.address, "a", token=TOKEN, mem=MEM, rollout_chunk=2, poll_s=0.0)
    b = scheduled(_trainer(tmp_path, "b", 3), srv.address, "b", token=TOKEN, mem=MEM, rollout_chunk=2, poll_s=0.0)
    errs = []

    def run(t):
        try:
            t.train()
        except BaseException as e:  # noqa: BLE001  (reported below)
            errs.append(e)

    threads = [threading.Thread(target=run, args=(t,)) for t in (a, b)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errs, errs
    jobs = {j["job"]: j for j in c.status()["jobs"]}
    assert jobs["a"]["state"] == jobs["b"]["state"] == jobs["hog"]["state"] == "done"
    trace = c.trace()
    phases = {(e["args"]["job"], e["name"]) for e in trace["traceEvents"] if e["ph"] == "X"}
    for j in ("a", "b"):
        assert {(j, "rollout"), (j, "actor_train"), (j, "resident:actor")} <= phases
    _no_double_booking(trace)
    # the yield: a's log has the boundary right after the notice, and there it gave the lease back
    ev = a.sched.events
    i = next(k for k, e in enumerate(ev) if e[1] == "yield")
    assert ev[i - 1][1] == "boundary" and ev[i + 1][1] == "release" and ev[i + 1][2]["phase"] == "rollout"
    assert ev[i + 2][1] == "acquire" and ev[i + 2][2]["phase"] == "rollout"  # and it went on
    assert a.sched.yields >= 1 and c.metrics()["yields"] >= 1
    yielded = [e for e in trace["traceEvents"] if e["ph"] == "X" and e["args"]["end"] == "yielded"]
    assert any(e["args"]["job"] == "a" and e["name"] == "rollout" for e in yielded)
    assert a.state.global_step == b.state.global_step == 3


def test_a_failing_trl_job_is_marked_failed_and_frees_its_slot(tmp_path, service):
    pytest.importorskip("trl")
    from rlcu.sched.integrations.trl import scheduled

    srv, c = service
    calls = []

    def breaks(completions, **kw):
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("reward server down")
        return [0.0] * len(completions)

    t = scheduled(_trainer(tmp_path, "f", 3, reward=breaks), srv.address, "f", token=TOKEN, mem=MEM)
    with pytest.raises(RuntimeError, match="reward server down"):
        t.train()
    st = c.status()
    assert [j["state"] for j in st["jobs"]] == ["failed"] and st["devices"][0]["used"] == 0.0
    assert t.sched.events[-1] == (pytest.approx(time.time(), abs=30), "finish", {"failed": True})


@pytest.mark.usefixtures("one_thread")  # tests/conftest.py
def test_a_cancelled_trl_job_stops_after_the_step_with_a_checkpoint(tmp_path, service):
    """`rlcu sched cancel` (graceful) during step 2 of 6: training ends after step 2 with a
    checkpoint of it, and the job is cancelled."""
    pytest.importorskip("trl")
    pytest.importorskip("datasets")
    from rlcu.sched.integrations.trl import scheduled

    srv, c = service
    calls = []

    def reward(completions, **kw):
        calls.append(1)
        if len(calls) == 2:
            assert c.cancel("x", graceful=True)["state"] == "stopping"
        return [float(len(set(x.split()))) for x in completions]

    t = scheduled(_trainer(tmp_path, "x", 6, reward=reward), srv.address, "x", token=TOKEN, mem=MEM, poll_s=0.0)
    t.train()
    assert t.state.global_step == 2 and len(calls) == 2
    assert (tmp_path / "x" / "checkpoint-2").is_dir()
    assert c.status()["jobs"][0]["state"] == "cancelled"


def test_scheduled_refuses_what_it_cannot_drive(tmp_path):
    pytest.importorskip("trl")
    from rlcu.sched.integrations.trl import SchedRun, scheduled

    with pytest.raises(TypeError, match="_generate"):
        scheduled(object(), "unix:/nonexistent/s.sock", "x", token=TOKEN)
    with pytest.raises(ValueError, match="mem: unknown key 'rollot'"):
        SchedRun(None, None, "x", {"rollot": 1.0})
    with pytest.raises(ValueError, match="rollout_chunk"):
        SchedRun(None, None, "x", rollout_chunk=0)


def test_without_trl_a_clear_error(monkeypatch):
    import builtins

    from rlcu.sched.integrations import trl as integ

    real = builtins.__import__

    def no_trl(name, *a, **kw):
        if name == "trl" or name.startswith("trl."):
            raise ImportError("No module named 'trl'")
        return real(name, *a, **kw)

    monkeypatch.setattr(builtins, "__import__", no_trl)
    with pytest.raises(ImportError, match=r"pip install 'rlcu\[trl\]'"):
        integ.scheduled(object(), "unix:/nonexistent/s.sock", "x")



@pytest.mark.gpu
def test_trl_job_on_cuda_measures_its_footprint(tmp_path):
    """On a GPU: the job's leases are on the trainer's device, each phase's peak is measured,
    and the requests after the first of a phase come from the measured peak (x1.1)."""
    pytest.importorskip("trl")
    import torch

    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    from rlcu.sched.integrations.trl import scheduled
    from rlcu.sched.lease import HEADROOM

    core = Core([40.0, 40.0], state=tmp_path / "s.db", device_names=["cuda:1", "cuda:0"])
    with SchedServer(core, f"unix:{tmp_path / 's.sock'}", TOKEN, tick_s=0.05) as srv:
        t = _trainer(tmp_path, "g", 4, use_cpu=False)
        assert t.accelerator.device.type == "cuda"
        scheduled(t, srv.address, "g", token=TOKEN, rollout_chunk=2).train()
        run = t.sched
        ev = [e for e in SchedClient(srv.address, TOKEN).trace()["traceEvents"] if e["ph"] == "X"]
    print("measured GiB", run.measured, "estimated", run.mem, "peak", run.peak)
    assert run.measured["rollout"] > 0 and run.measured["actor_train"] > 0
    assert {e["pid"] for e in ev} == {1}  # the pool's "cuda:0", where the trainer runs
    for phase in ("rollout", "actor_train"):
        mems = [e["args"]["mem"] for e in ev if e["name"] == phase]
        assert mems[0] == pytest.approx(min(run.peak, run.mem[phase]))
        cap = min(run.peak, run.measured[phase] * HEADROOM)
        assert all(0 < m <= cap + 1e-9 for m in mems[1:]), (phase, mems, cap)
