"""Data: JSONL / JSON / parquet rows, errors naming file and line, long-prompt filtering,
and SFT tokenisation with the completion mask (text, chat messages, pre-tokenised)."""

import json

import pytest

from rlcu.data.datasets import encode_prompt, encode_sft_row, filter_long, load_prompts, load_rows, load_sft_rows
from rlcu.data.tokenizer import make_word_tokenizer

CHATML = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
# like Qwen3's: the final assistant turn gets an empty think block, earlier ones do not
THINKY = ("{% for m in messages %}<|im_start|>{{ m.role }}\n"
          "{% if m.role == 'assistant' and loop.last %}<think>\n\n</think>\n\n{% endif %}"
          "{{ m.content }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
WORDS = ["what", "is", "two", "plus", "three", "five", "six", "ok", "user", "assistant", "system", "<", ">",
         "think", "</", "?", "."]


def tok(template=CHATML):
    return make_word_tokenizer(WORDS, special_tokens=["<|im_start|>", "<|im_end|>", "<|endoftext|>"],
                               chat_template=template)


def _write(path, lines):
    path.write_text("\n".join(lines) + "\n")
    return path


def test_jsonl_rows_keep_fields(tmp_path):
    f = _write(tmp_path / "d.jsonl", [json.dumps({"prompt": "what is two", "answer": "2", "id": 1}), "",
                                      json.dumps({"prompt": [{"role": "user", "content": "hi"}], "answer": "3"})])
    rows = load_prompts(f)
    assert rows[0] == {"prompt": "what is two", "answer": "2", "id": 1} and rows[1]["answer"] == "3"
    assert load_rows(f) == rows
    j = tmp_path / "d.json"
    j.write_text(json.dumps([{"q": "a"}, {"q": "b"}]))
    assert load_prompts(j, prompt_field="q") == [{"q": "a"}, {"q": "b"}]


@pytest.mark.parametrize("lines, msg", [
    (['{"prompt": "a"}', '{"prompt": "b",}'], r"d.jsonl:2: invalid JSON"),
    (['{"prompt": "a"}', "", '[1, 2]'], r"d.jsonl:3: a row must be a JSON object"),
    (['{"prompt": "a"}', '{"question": "b"}'], r"d.jsonl:2: missing field 'prompt' \(fields: question\)"),
    (['{"prompt": 5}'], r"d.jsonl:1: field 'prompt' must be a string or a list of chat messages"),
    (['{"prompt": [{"role": "user"}]}'], r"d.jsonl:1: prompt\[0\] must be a"),
])
def test_malformed_names_file_and_line(tmp_path, lines, msg):
    f = _write(tmp_path / "d.jsonl", lines)
    with pytest.raises(ValueError, match=msg):
        load_prompts(f)


def test_formats_and_missing(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.jsonl"):
        load_prompts(tmp_path / "nope.jsonl")
    (tmp_path / "d.csv").write_text("a,b\n")
    with pytest.raises(ValueError, match="unsupported data format '.csv'"):
        load_prompts(tmp_path / "d.csv")


def test_parquet(tmp_path):
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError:
        (tmp_path / "d.parquet").write_bytes(b"PAR1")
        with pytest.raises(ImportError, match="reading parquet needs pyarrow"):
            load_prompts(tmp_path / "d.parquet")
        return
    pq.write_table(pa.table({"prompt": ["a", "b"], "answer": ["1", "2"]}), tmp_path / "d.parquet")
    assert load_prompts(tmp_path / "d.parquet") == [{"prompt": "a", "answer": "1"}, {"prompt": "b", "answer": "2"}]


def test_filter_long():
    t = tok()
    rows = [{"prompt": "what is two plus three ?"}, {"prompt": "ok"},
            {"prompt": [{"role": "user", "content": "what is two"}]}]
    # <|im_start|> user what is two <|im_end|> <|im_start|> assistant
    assert len(encode_prompt(t, rows[2]["prompt"])) == 8
    kept, dropped = filter_long(rows, t, 5)
    assert kept == [rows[1]] and dropped == 2
    assert filter_long(rows, t, None) == (rows, 0)


def test_encode_text_prompt_completion():
    t = tok()
    ids, mask = encode_sft_row({"prompt": "what is two plus three ?", "completion": "five ."}, t)
    assert t.decode(ids, skip_special_tokens=False).split() == "what is two plus three ? five . <|im_end|>".split()
    assert mask == [0] * 6 + [1] * 3  # completion + EOS
    ids, mask = encode_sft_row({"prompt_token_ids": [5, 6], "completion_token_ids": [7]}, None)
    assert (ids, mask) == ([5, 6, 7], [0, 0, 1])


@pytest.mark.parametrize("template", [CHATML, THINKY])
def test_encode_chat(template):
    t = tok(template)
    msgs = [{"role": "user", "content": "what is two plus three ?"}, {"role": "assistant", "content": "five ."},
            {"role": "user", "content": "plus ?"}, {"role": "assistant", "content": "six ."}]
    ids, mask = encode_sft_row({"messages": msgs}, t)
    text = t.apply_chat_template(msgs, tokenize=False)
    assert ids == t.encode(text)
    trained = t.decode([i for i, m in zip(ids, mask) if m], skip_special_tokens=False).split()
    want = "five . <|im_end|> six . <|im_end|>"
    if template is THINKY:
        want = "five . <|im_end|> < think > </ think > six . <|im_end|>"
    assert trained == want.split()
    # prompt messages + a string completion: only the completion turn is trained on
    ids2, mask2 = encode_sft_row({"prompt": msgs[:3], "completion": "six ."}, t)
    assert ids2 == ids
    tail = "< think > </ think > six . <|im_end|>" if template is THINKY else "six . <|im_end|>"
    assert t.decode([i for i, m in zip(ids2, mask2) if m], skip_special_tokens=False).split() == tail.split()


def test_sft_rows_errors(tmp_path):
    f = _write(tmp_path / "s.jsonl", [json.dumps({"prompt": "a", "completion": "b"}),
                                      json.dumps({"messages": [{"role": "user", "content": "a"}]}),
                                      ])
    with pytest.raises(ValueError, match="s.jsonl:2: 'messages' has no assistant turn"):
        load_sft_rows(f)
    _write(f, [json.dumps({"prompt": "a"})])
    with pytest.raises(ValueError, match="s.jsonl:1: an SFT row needs 'prompt' \\+ 'completion'"):
        load_sft_rows(f)
    _write(f, [json.dumps({"prompt_token_ids": [1, "x"], "completion_token_ids": [2]})])
    with pytest.raises(ValueError, match="s.jsonl:1: field 'prompt_token_ids' must be a list of token ids"):
        load_sft_rows(f)


def test_non_utf8_names_file_and_line(tmp_path):
    f = tmp_path / "d.jsonl"
    f.write_bytes(b'{"prompt": "ok"}\n\n{"prompt": "caf\xe9"}\n')  # latin-1, not UTF-8
    with pytest.raises(ValueError, match=rf"{f}:3: not valid UTF-8 \(byte 0xe9 at column 16"):
        load_prompts(f)
    with pytest.raises(ValueError, match=rf"{f}:3: not valid UTF-8"):
        load_sft_rows(f)
    j = tmp_path / "d.json"
    j.write_bytes(b'[{"prompt": "ok"},\n {"prompt": "caf\xe9"}]')
    with pytest.raises(ValueError, match=rf"{j}:2: not valid UTF-8 \(byte 0xe9 at column 17"):
        load_rows(j)
    from rlcu.engine.cli import read_prompts

    with pytest.raises(ValueError, match=rf"{f}:3: not valid UTF-8"):
        read_prompts(str(f))
