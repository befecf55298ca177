"""Preference pairs (data/preference.py) in TRL's forms: text and chat messages, explicit and
implicit prompts, margins, pre-tokenised rows, JSONL and parquet; errors naming file and line."""

import json

import pytest

from rlcu.data.preference import PreferencePair, encode_preference_row, load_preference_pairs
from rlcu.data.tokenizer import make_word_tokenizer

CHATML = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
WORDS = ["what", "is", "two", "plus", "three", "five", "six", "ok", "user", "assistant", "?", "."]
TOK = make_word_tokenizer(WORDS, special_tokens=["<|im_start|>", "<|im_end|>", "<|endoftext|>"], chat_template=CHATML)
EOS = TOK.eos_token_id


def enc(s):
    return list(TOK.encode(s))


def chat(msgs, gen=False):
    return list(TOK.apply_chat_template(msgs, add_generation_prompt=gen, tokenize=True))


def test_text_explicit_and_implicit_with_margin():
    p = encode_preference_row({"prompt": "what is two plus three ?", "chosen": "five", "rejected": "six",
                               "margin": 1.5}, TOK)
    assert p == PreferencePair(enc("what is two plus three ?"), enc("five") + [EOS], enc("six") + [EOS], 1.5)
    q = encode_preference_row({"chosen": "what is two plus three ? five", "rejected": "what is two plus three ? six"},
                              TOK)
    assert q.prompt_ids == p.prompt_ids and q.chosen_ids == p.chosen_ids and q.margin == 0.0
    assert q.chosen == enc("what is two plus three ? five") + [EOS]
    ids = encode_preference_row({"prompt_token_ids": [1, 2], "chosen_token_ids": [3], "rejected_token_ids": [4, 5]},
                                None)
    assert ids == PreferencePair([1, 2], [3], [4, 5])


def test_chat_explicit_implicit_and_mixed_render_the_template():
    user = [{"role": "user", "content": "what is two plus three ?"}]
    a5, a6 = [{"role": "assistant", "content": "five"}], [{"role": "assistant", "content": "six"}]
    p = encode_preference_row({"prompt": user, "chosen": a5, "rejected": a6}, TOK)
    assert p.prompt_ids == chat(user, gen=True)
    assert p.chosen == chat(user + a5) and p.rejected == chat(user + a6)
    assert encode_preference_row({"chosen": user + a5, "rejected": user + a6}, TOK) == p  # implicit prompt
    assert encode_preference_row({"prompt": "what is two plus three ?", "chosen": a5, "rejected": a6}, TOK) == p
    assert encode_preference_row({"prompt": user, "chosen": "five", "rejected": "six"}, TOK) == p


def test_files_and_errors_name_the_row(tmp_path):
    rows = [{"prompt": "what is two", "chosen": "five", "rejected": "six", "margin": 2},
            {"chosen": [{"role": "user", "content": "ok"}, {"role": "assistant", "content": "five"}],
             "rejected": [{"role": "user", "content": "ok"}, {"role": "assistant", "content": "six"}]}]
    f = tmp_path / "p.jsonl"
    f.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    got = load_preference_pairs(f, TOK)
    assert [w for w, _ in got] == [f"{f}:1", f"{f}:2"] and got[0][1].margin == 2.0
    pq = pytest.importorskip("pyarrow.parquet")
    import pyarrow as pa

    pq.write_table(pa.Table.from_pylist(rows[:1] * 2), tmp_path / "p.parquet")
    assert [p for _, p in load_preference_pairs(tmp_path / "p.parquet", TOK)] == [got[0][1]] * 2

    bad = [({"prompt": "ok", "chosen": "five"}, "missing field.*'rejected'"),
           ({"chosen": "five", "rejected": "six", "margin": "big"}, "'margin' must be a number"),
           ({"chosen": "five", "rejected": [{"role": "assistant", "content": "six"}]}, "both be strings or both chat"),
           ({"prompt": "ok", "chosen": 5, "rejected": "six"}, "'chosen' must be a string or a list"),
           ({"chosen": [{"content": "x"}], "rejected": "six"}, r"chosen\[0\] must be"),
           ({"chosen_token_ids": [1], "rejected_token_ids": "2"}, "'rejected_token_ids' must be a list"),
           ({"prompt": "ok", "chosen": "five .", "rejected": "five ."}, "same completion"),
           ({"chosen": "ok five", "rejected": "ok five"}, "the same after the prompt")]
    for row, msg in bad:
        f.write_text(json.dumps(rows[0]) + "\n\n" + json.dumps(row) + "\n")
        with pytest.raises(ValueError, match=f"^{f}:3: .*{msg}"):
            load_preference_pairs(f, TOK)
