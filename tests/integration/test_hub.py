"""Hugging Face Hub ids and dataset folders as model and data sources (rlcu.hub), read from a
Hub cache the tests build (tests/support/hub_util.py), offline: every place that takes a model path
takes a Hub id (Qwen3.from_pretrained, LLM, the tokenizer, rlcu generate, model.path, the
scheduler's estimate), with revisions; data.path takes a Hub dataset id or a dataset folder with
a split; a local path never needs huggingface_hub; errors name the field and its value."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from support.hub_util import CHAT_ROWS, MATH_ROWS, add_dataset, add_model, hub_env

import rlcu


@pytest.fixture
def hub(tmp_path, monkeypatch):
    return hub_env(monkeypatch, tmp_path / "hf")


def test_model_by_hub_id_and_revision(hub):
    main, v2 = add_model(hub, "org/tiny"), add_model(hub, "org/tiny", revision="v2", seed=1)
    m = rlcu.Qwen3.from_pretrained("org/tiny")
    assert Path(m.source) == main
    assert torch.equal(m.flat, rlcu.Qwen3.from_pretrained(main).flat)
    at = rlcu.Qwen3.from_pretrained("org/tiny@v2")
    assert Path(at.source) == v2 and not torch.equal(at.flat, m.flat)
    assert torch.equal(rlcu.Qwen3.from_pretrained("org/tiny", revision="v2").flat, at.flat)
    with pytest.raises(ValueError, match="names revision 'v2', but the revision option says 'main'"):
        rlcu.Qwen3.from_pretrained("org/tiny@v2", revision="main")
    with pytest.raises(FileNotFoundError, match="has no revision|not in the Hugging Face cache"):
        rlcu.Qwen3.from_pretrained("org/tiny@v3")


def test_llm_tokenizer_and_generate_by_hub_id(hub, tmp_path, capsys):
    from rlcu.data.tokenizer import Tokenizer
    from rlcu.engine import LLM, SamplingParams
    from rlcu.engine.cli import main

    add_model(hub, "org/tiny")
    llm = LLM("org/tiny", device="cpu", num_kv_blocks=16, warmup=False)
    out = llm.generate(["what is two add three ?"], SamplingParams(max_tokens=3, temperature=0))
    assert len(out[0].outputs[0].token_ids) == 3  # the tokenizer came from the snapshot too
    assert Tokenizer.from_pretrained("org/tiny").encode("the answer") == llm.tokenizer.encode("the answer")
    (tmp_path / "p.jsonl").write_text('{"prompt": "the answer is"}\n')
    assert main(["--model", "org/tiny", "--input", str(tmp_path / "p.jsonl"), "--max-tokens", "2",
                 "--num-kv-blocks", "16", "--no-progress", "--device", "cpu"]) == 0
    assert main(["--model", "org/nope", "--input", str(tmp_path / "p.jsonl")]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("rlcu generate: --model: org/nope: is not a local path") and "HF_HUB_OFFLINE" in err


def test_model_path_errors_name_the_field(hub, tmp_path):
    from rlcu.config import ModelConfig
    from rlcu.train.checkpoint import build_model

    with pytest.raises(FileNotFoundError) as e:
        build_model(ModelConfig(path="models/qwen3-0.6b"), device="cpu")
    msg = str(e.value)
    assert msg.startswith("model.path: models/qwen3-0.6b: is not a local path, and the model models/qwen3-0.6b is "
                          "not in the Hugging Face cache") and "HF_HUB_OFFLINE is set" in msg and "\n" not in msg
    with pytest.raises(FileNotFoundError, match=f"^model.path: {tmp_path / 'nope'}: not a folder"):
        build_model(ModelConfig(path=str(tmp_path / "nope")), device="cpu")
    add_model(hub, "org/tiny", revision="v2")
    assert build_model(ModelConfig(path="org/tiny", revision="v2"), device="cpu").cfg.num_hidden_layers == 2


def test_a_local_folder_never_needs_huggingface_hub(tmp_path, monkeypatch):
    from rlcu.engine.cli import tiny_model_and_tokenizer

    model, _ = tiny_model_and_tokenizer("cpu")
    model.save_pretrained(tmp_path / "m")
    monkeypatch.setitem(sys.modules, "huggingface_hub", None)  # importing it fails
    assert torch.equal(rlcu.Qwen3.from_pretrained(tmp_path / "m").flat, model.flat)
    with pytest.raises(ImportError, match=r"org/tiny: reading it needs the huggingface_hub package \(pip install"):
        rlcu.Qwen3.from_pretrained("org/tiny")


def test_scheduler_jobs_read_a_hub_models_config(hub, capsys):
    from rlcu.config import GRPOConfig
    from rlcu.sched.job import estimate_memory, run_grpo_exit_code

    add_model(hub, "org/tiny")
    est = estimate_memory(GRPOConfig(model={"path": "org/tiny"}))
    assert est["resident"] > 0

    class NoScheduler:  # the estimate comes before the scheduler is asked
        def job(self, *a, **k):
            raise AssertionError("registered a job whose model is not there")

    assert run_grpo_exit_code("rlcu grpo", {"model": {"path": "org/nope"}}, client=NoScheduler(), name="j") == 2
    err = capsys.readouterr().err
    assert err.startswith("rlcu grpo: model.path: org/nope: is not a local path") and err.count("\n") == 1


# ---------------------------------------------------------------- data sets
def test_hub_dataset_by_id_with_split(hub):
    pytest.importorskip("datasets")
    from rlcu.data.datasets import load_prompt_items, load_sft_rows

    add_dataset(hub, "org/math", {"train": MATH_ROWS[:4], "test": MATH_ROWS[4:]})
    items = load_prompt_items("org/math", split="test")
    assert [r for _, r in items] == MATH_ROWS[4:]
    assert items[0][0] == "org/math[test]:row 1"
    assert len(load_prompt_items("org/math", split="train[:2]")) == 2
    with pytest.raises(ValueError, match=r"^data.path: org/math: cannot read it as a dataset \(split 'dev'\)"):
        load_prompt_items("org/math", split="dev", field="data.path")
    with pytest.raises(ValueError, match=r"org/math\[train\]:row 1: missing field 'question' \(fields: prompt"):
        load_prompt_items("org/math", "question")
    add_dataset(hub, "org/chat", {"train": CHAT_ROWS})
    assert load_sft_rows("org/chat") == CHAT_ROWS
    add_dataset(hub, "org/chat", {"train": CHAT_ROWS[:1]}, revision="v1")
    assert load_sft_rows("org/chat@v1") == CHAT_ROWS[:1]
    with pytest.raises(FileNotFoundError, match="^data.path: org/none: is not a local path, and the dataset "
                                                "org/none is not in the Hugging Face cache"):
        load_prompt_items("org/none", field="data.path")


def test_dataset_folders(tmp_path):
    datasets = pytest.importorskip("datasets")
    from rlcu.data.datasets import load_prompts

    datasets.Dataset.from_list(MATH_ROWS).save_to_disk(str(tmp_path / "one"))
    assert load_prompts(tmp_path / "one") == MATH_ROWS
    datasets.DatasetDict({"train": datasets.Dataset.from_list(MATH_ROWS[:2]),
                          "test": datasets.Dataset.from_list(MATH_ROWS[2:])}).save_to_disk(str(tmp_path / "two"))
    assert load_prompts(tmp_path / "two", split="test") == MATH_ROWS[2:]
    with pytest.raises(ValueError, match=r"has no split 'dev' \(splits: train, test\); set data.split"):
        load_prompts(tmp_path / "two", split="dev")
    (tmp_path / "files" / "data").mkdir(parents=True)  # a folder of data files, as a Hub repository holds them
    datasets.Dataset.from_list(MATH_ROWS).to_parquet(str(tmp_path / "files" / "data" / "train-00000.parquet"))
    assert load_prompts(tmp_path / "files") == MATH_ROWS


def test_data_path_errors_name_the_field(tmp_path, monkeypatch):
    from rlcu.data.datasets import load_prompts
    from rlcu.hub import MissingPackage

    with pytest.raises(FileNotFoundError, match="^data.path: data/sft.jsonl: no such data file; give a .jsonl"):
        load_prompts("data/sft.jsonl", field="data.path")
    (tmp_path / "ds").mkdir()
    monkeypatch.setitem(sys.modules, "datasets", None)
    with pytest.raises(MissingPackage, match=r"ds: reading it needs the datasets package \(pip install "
                                             r"'rlcu\[datasets\]'\)") as e:
        load_prompts(tmp_path / "ds", field="data.path")
    assert isinstance(e.value, ValueError)  # so the commands exit with 2 and its one line


def test_rlcu_generate_honours_the_environment(tmp_path, monkeypatch):
    """From outside: HF_HUB_CACHE and HF_HUB_OFFLINE as a user sets them, in a fresh process."""
    hub = hub_env(monkeypatch, tmp_path / "hf")
    add_model(hub, "org/tiny")
    env = {k: v for k, v in os.environ.items() if not k.startswith("HF_")}
    env.update(HF_HOME=str(tmp_path / "hf"), HF_HUB_CACHE=str(hub), HF_HUB_OFFLINE="1")
    cmd = [sys.executable, "-m", "rlcu", "generate", "--model", "org/tiny", "--max-tokens", "2", "--num-kv-blocks",
           "16", "--no-progress", "--no-warmup", "--device", "cpu", "--input", "-"]
    r = subprocess.run(cmd, input='{"prompt": "the answer is"}\n', capture_output=True, text=True, env=env,
                       timeout=120)
    assert r.returncode == 0, r.stderr
    assert '"finish_reason"' in r.stdout
