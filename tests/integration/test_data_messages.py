"""What a trainer says about its data: a token id outside the vocabulary is the one in the row;
SFT's dropped examples are named by row (file:line), as GRPO's dropped prompts are; an empty data
set names its file."""

import json

import pytest
from support.trainers import V, grpo_trainer, sft_config, tiny

from rlcu.train.sft import SFTTrainer

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def _write(path, rows) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


@pytest.mark.parametrize("bad", [-5, V, V + 7])
def test_sft_names_the_token_id_outside_the_vocabulary(tmp_path, bad):
    data = _write(tmp_path / "ids.jsonl", [{"prompt_token_ids": [1, 2], "completion_token_ids": [3, 4]},
                                           {"prompt_token_ids": [3, bad, 1], "completion_token_ids": [2]}])
    with pytest.raises(ValueError) as e:
        SFTTrainer(sft_config(tmp_path / "run", f"data.path={data}"), model=tiny())
    assert str(e.value) == f"{data}:2: token id {bad} outside the model's vocabulary [0, {V})"


def test_sft_dropped_examples_are_named_by_row(tmp_path):
    ok = {"prompt_token_ids": [1, 2], "completion_token_ids": [3]}
    rows = [ok, {"prompt_token_ids": list(range(1, 40)), "completion_token_ids": [3]}, ok,
            {"prompt_token_ids": [5], "completion_token_ids": []}, ok]
    data = tmp_path / "sft.jsonl"
    data.write_text("\n".join(json.dumps(r) for r in rows[:2]) + "\n\n" + "".join(json.dumps(r) + "\n"
                                                                               for r in rows[2:]))
    tr = SFTTrainer(sft_config(tmp_path / "run", f"data.path={data}", "max_seq_len=16"), model=tiny())
    assert len(tr.examples) == 3
    notes = "\n".join(tr._notes)
    assert f"{data}: dropped 1 of 5 examples longer than max_seq_len=16 tokens: {data}:2 (40 tokens)" in notes
    # line 3 is blank: the rows are named by their line, not their index
    assert f"{data}: dropped 1 examples with no completion token to train on: {data}:5" in notes
    listed = SFTTrainer(sft_config(tmp_path / "run2", "max_seq_len=16"), rows, model=tiny())  # rows of a list
    notes = "\n".join(listed._notes)
    assert "dataset: dropped 1 of 5 examples longer than max_seq_len=16 tokens: dataset[1] (40 tokens)" in notes
    assert "no completion token to train on: dataset[3]" in notes


def test_empty_data_sets_name_their_file(tmp_path):
    empty = _write(tmp_path / "empty.jsonl", [])
    with pytest.raises(ValueError, match=f"^{empty}: no rows"):
        SFTTrainer(sft_config(tmp_path / "run", f"data.path={empty}"), model=tiny())
    with pytest.raises(ValueError, match=f"^{empty}: no rows"):
        grpo_trainer(tmp_path, rows=empty)
    one = _write(tmp_path / "one.jsonl", [{"prompt": "sort 1 2 :", "answer": "1 2"}])
    with pytest.raises(ValueError, match=f"^{empty}: no rows"):
        grpo_trainer(tmp_path, rows=one, data=dict(eval_path=empty))


def test_rl_pre_tokenised_prompt_outside_the_vocabulary_is_named_at_load(tmp_path):
    rows = [{"prompt_token_ids": [3, 4], "answer": "1"}, {"prompt_token_ids": [3, -5], "answer": "1"}]
    with pytest.raises(ValueError, match=r"^dataset\[1\]: .*token id -5 outside the model's vocabulary \[0, "):
        grpo_trainer(tmp_path, rows=rows)
