"""`rlcu generate`: JSONL in and out, errors named by file and line."""

import json

import pytest

from rlcu.cli import main as rlcu_main
from rlcu.engine.cli import main

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def _write(path, lines):
    path.write_text("".join((x if isinstance(x, str) else json.dumps(x)) + "\n" for x in lines))
    return str(path)


def test_tiny_smoke_run(tmp_path, capsys):
    inp = _write(tmp_path / "p.jsonl", [
        {"prompt": "what is two add three ?"},
        {"prompt": [{"role": "user", "content": "find the sum"}]},
        "",
        {"prompt_token_ids": [5, 6, 7]},
    ])
    out = tmp_path / "o.jsonl"
    rc = rlcu_main(["generate", "--input", inp, "--output", str(out), "--max-tokens", "5", "--n", "2",
                    "--seed", "1", "--logprobs", "--temperature", "0.8", "--ignore-eos"])
    assert rc == 0
    recs = [json.loads(x) for x in out.read_text().splitlines()]
    assert [r["index"] for r in recs] == [0, 1, 2]
    for r in recs:
        assert len(r["outputs"]) == 2
        for c in r["outputs"]:
            assert len(c["token_ids"]) == 5 == len(c["logprobs"]) and c["finish_reason"] == "length"
            assert isinstance(c["text"], str)
    assert recs[0]["prompt"] == "what is two add three ?" and recs[2]["num_prompt_tokens"] == 3
    assert "tok/s" in capsys.readouterr().err
    # same seed, same output
    out2 = tmp_path / "o2.jsonl"
    main(["generate", "--input", inp, "--output", str(out2), "--max-tokens", "5", "--n", "2", "--seed", "1",
          "--logprobs", "--temperature", "0.8", "--ignore-eos", "--no-progress"])
    assert out2.read_text() == out.read_text()
    # --no-prefill-graphs is taken (the CPU has no graphs either way: the same output)
    out3 = tmp_path / "o3.jsonl"
    main(["generate", "--input", inp, "--output", str(out3), "--max-tokens", "5", "--n", "2", "--seed", "1",
          "--logprobs", "--temperature", "0.8", "--ignore-eos", "--no-progress", "--no-prefill-graphs"])
    assert out3.read_text() == out.read_text()


def test_builtin_prompts_to_stdout(capsys):
    assert main(["generate", "--max-tokens", "3", "--no-progress"]) == 0
    assert len(capsys.readouterr().out.splitlines()) == 3


@pytest.mark.parametrize("line, msg", [
    ("{not json", "invalid JSON"),
    ('{"text": "x"}', 'expected an object with "prompt"'),
    ('{"prompt_token_ids": [1, "a"]}', "must be a list of integers"),
    ('{"prompt": 5}', '"prompt" must be a string'),
])
def test_malformed_line_names_file_and_line(tmp_path, capsys, line, msg):
    inp = _write(tmp_path / "bad.jsonl", [{"prompt": "the answer"}, line])
    assert main(["generate", "--input", inp, "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert f"{inp}:2:" in err and msg in err


def test_bad_request_reported_others_generated(tmp_path, capsys):
    inp = _write(tmp_path / "p.jsonl", [{"prompt_token_ids": [5, 6]}, {"prompt_token_ids": []},
                                        {"prompt_token_ids": [10 ** 6]}, {"prompt": "the answer"}])
    out = tmp_path / "o.jsonl"
    assert main(["generate", "--input", inp, "--output", str(out), "--max-tokens", "2", "--no-progress"]) == 1
    recs = [json.loads(x) for x in out.read_text().splitlines()]
    assert "outputs" in recs[0] and "outputs" in recs[3]
    assert "empty prompt" in recs[1]["error"] and "outside the vocabulary" in recs[2]["error"]
    err = capsys.readouterr().err
    assert f"{inp}:2: empty prompt" in err and f"{inp}:3:" in err


def test_model_folder(tmp_path):
    from rlcu.engine.cli import tiny_model_and_tokenizer

    model, _ = tiny_model_and_tokenizer("cpu")
    folder = tmp_path / "tiny"
    model.save_pretrained(folder)  # no tokenizer.json
    inp = _write(tmp_path / "p.jsonl", [{"prompt_token_ids": [5, 6, 7]}])
    out = tmp_path / "o.jsonl"
    assert main(["generate", "--model", str(folder), "--input", inp, "--output", str(out), "--max-tokens", "4",
                 "--temperature", "0", "--no-progress", "--num-kv-blocks", "16"]) == 0
    assert len(json.loads(out.read_text())["outputs"][0]["token_ids"]) == 4
    inp = _write(tmp_path / "t.jsonl", [{"prompt": "hello"}])  # no tokenizer.json in the folder
    assert main(["generate", "--model", str(folder), "--input", inp, "--no-progress", "--num-kv-blocks", "16"]) == 2
    assert main(["generate", "--model", str(tmp_path / "nope"), "--input", inp]) == 2


def test_exact_flag_and_a_stale_rlcu_exact(monkeypatch, capsys):
    """--exact runs the engine's model in exact mode (the model's `exact`); RLCU_EXACT, the old
    process-wide switch, is refused by name rather than ignored, by the commands that run a model."""
    from rlcu import engine

    made = []

    class Spy(engine.LLM):
        def __init__(self, *a, **kw):
            super().__init__(*a, **kw)
            made.append(self)

    monkeypatch.setattr(engine, "LLM", Spy)
    for flag in ([], ["--exact"]):
        assert main(["generate", "--max-tokens", "3", "--no-progress", "--seed", "1", *flag]) == 0
    assert [m.model.exact for m in made] == [False, True]
    capsys.readouterr()
    monkeypatch.setenv("RLCU_EXACT", "1")
    assert rlcu_main(["generate", "--max-tokens", "3", "--no-progress"]) == 2
    assert "RLCU_EXACT is no longer read" in capsys.readouterr().err and len(made) == 2
    assert rlcu_main(["info"]) == 0  # a command that runs no model goes on
