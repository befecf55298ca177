"""data.chat_template_kwargs: the chat template's variables (Qwen3's enable_thinking: false) reach
every place a trainer renders chat messages: GRPO's and PPO's prompts (and so their rollouts and
evaluation) and SFT's conversations, as `rlcu generate --chat-template-kwargs` and TRL take them."""

import pytest
from support.trainers import TINY

from rlcu.config import load_config
from rlcu.data.tokenizer import make_word_tokenizer

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py

# a template variable in the manner of Qwen3's enable_thinking, which it reads only where it renders
# a generation prompt (here: the conversation's head, so that SFT's whole conversations show it too)
TEMPLATE = ("{% if enable_thinking is defined and enable_thinking is false %}think over {% endif %}"
            "{% for m in messages %}<|im_start|>{{ m.role }} {{ m.content }}<|im_end|>{% endfor %}"
            "{% if add_generation_prompt %}<|im_start|>assistant{% endif %}")
WORDS = ["user", "assistant", "think", "over", "hello", "world", "yes"]
CHAT = [{"role": "user", "content": "hello world"}]


def _tok():
    return make_word_tokenizer(WORDS, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                               chat_template=TEMPLATE)


def _sets(tmp_path, thinking: bool | None) -> list[str]:
    tok = _tok()
    tiny = dict(TINY, vocab_size=tok.vocab_size, eos_token_id=tok.eos_token_id)
    out = [f"log.out_dir={tmp_path / 'run'}", "log.progress=false", "log.plot=false", "log.tensorboard=false",
           f"model.tiny={tiny}", "steps=1"]
    kw = [] if thinking is None else [f"data.chat_template_kwargs={{enable_thinking: {str(thinking).lower()}}}"]
    return out + kw


@pytest.mark.parametrize("kind", ["grpo", "ppo"])
def test_rl_prompts_and_rollouts_take_the_template_kwargs(tmp_path, kind):
    from rlcu.config import GRPOConfig, PPOConfig
    from rlcu.train import grpo, ppo

    cls, trainer = {"grpo": (GRPOConfig, grpo.GRPOTrainer),
                    "ppo": (PPOConfig, ppo.PPOTrainer)}[kind]
    rows = [{"prompt": CHAT}]
    texts = {}
    for thinking in (None, False):
        cfg = load_config(cls, None, _sets(tmp_path / str(thinking), thinking) + [
            "prompts_per_step=1", "group_size=2", "max_new_tokens=2",
            "rewards=[{fn: 'support.trainers:first_is_seven'}]"])
        tr = trainer(cfg, rows, tokenizer=_tok())
        ids, texts[thinking] = tr._encode(rows[0])
        samples = tr._engine_phase(lambda tr=tr: tr.rollout(rows, 2, seed=0))
        assert all(s.prompt_ids == ids for s in samples)  # what the engine was given
    assert texts[None].startswith("<|im_start|>user hello world") and texts[None].endswith("assistant")
    assert texts[False] == "think over " + texts[None]


def test_sft_conversations_take_the_template_kwargs(tmp_path):
    from rlcu.config import SFTConfig
    from rlcu.train.sft import SFTTrainer

    tok = _tok()
    rows = [{"messages": CHAT + [{"role": "assistant", "content": "yes"}]}]
    think = tok.encode("think over")
    for thinking, has in ((None, False), (False, True)):
        tr = SFTTrainer(load_config(SFTConfig, None, _sets(tmp_path / str(thinking), thinking)), rows, tokenizer=tok)
        ids, mask = tr.examples[0]
        found = any(ids[i:i + len(think)] == think for i in range(len(ids)))
        assert found == has, tok.decode(ids)
        assert [t for t, m in zip(ids, mask) if m] == tok.encode("yes <|im_end|>")  # the loss: the answer only
