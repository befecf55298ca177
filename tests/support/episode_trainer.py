"""The multi-turn tests' trainers: GRPO (`trainer`) and PPO (`ppo_trainer`) episodes on a ChatML
word tokenizer (the sort task's words plus user, assistant and again) with a tiny model, and
`Again`, an environment that asks again twice and scores the last answer."""

from rlcu.data import synthetic as syn
from rlcu.data.tokenizer import make_word_tokenizer
from rlcu.train.grpo import GRPOTrainer
from support.trainers import TINY, grpo_config

CHATML = ("{%- for m in messages %}{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}{%- endfor %}"
          "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")


def chat_tokenizer():
    return make_word_tokenizer(syn.WORDS + ["user", "assistant", "again"],
                               special_tokens=["<|endoftext|>", "<|im_end|>", "<|im_start|>"], chat_template=CHATML)


class Again:
    """Asks again twice, then ends; its reward is 1 when the last answer starts with 7."""

    def __init__(self):
        self.n = 0

    def step(self, messages):
        self.n += 1
        return "again" if self.n < 3 else None

    def reward(self, messages):
        return float(messages[-1]["content"].split()[:1] == ["7"])


def trainer(tmp_path, rewards=None, eos_digits=False, environment=Again, multi_turn=None, **kw):
    """A GRPOTrainer of episodes of `environment` on the chat word tokenizer; eos_digits: every digit
    ends a turn too (so that a random tiny model's turns end within max_new_tokens)."""
    tok = chat_tokenizer()
    eos = [tok.eos_token_id] + ([tok.token_to_id(d) for d in syn.DIGITS] if eos_digits else [])
    cfg, _ = grpo_config(tmp_path, model=dict(tiny=dict(TINY, vocab_size=tok.vocab_size, eos_token_id=eos,
                                                        max_position_embeddings=96)),
                         multi_turn={"max_episode_tokens": 40, **(multi_turn or {})}, **kw)
    return GRPOTrainer(cfg, syn.sort_rows(16, "train", min_len=2, max_len=3), rewards, tokenizer=tok,
                       environment=environment), tok


def ppo_trainer(tmp_path, rewards=(), eos_digits=True, environment=Again, multi_turn=None, **kw):
    """A PPOTrainer of episodes of `environment` on the chat word tokenizer, as `trainer`'s GRPO
    (one step of 2 prompts x 2 episodes, a critic copied from the policy); `rewards`, the
    functions beside the environment's reward (none: its reward alone)."""
    from rlcu.config import PPOConfig, _build
    from rlcu.train.ppo import PPOTrainer

    tok = chat_tokenizer()
    eos = [tok.eos_token_id] + ([tok.token_to_id(d) for d in syn.DIGITS] if eos_digits else [])
    d = dict(model=dict(tiny=dict(TINY, vocab_size=tok.vocab_size, eos_token_id=eos, max_position_embeddings=96),
                        init_seed=3),
             steps=1, prompts_per_step=2, group_size=2, max_new_tokens=3, micro_batch_tokens=128,
             optim=dict(lr=3e-3), critic=dict(optim=dict(lr=3e-3)), kl_coef=0.05,
             multi_turn={"max_episode_tokens": 40, **(multi_turn or {})},
             log=dict(out_dir=str(tmp_path / "run"), progress=False, tensorboard=False, plot=False),
             checkpoint=dict(save_at_end=False), engine=dict(block_size=16), seed=5)
    d.update(kw)
    return PPOTrainer(_build(PPOConfig, d), syn.sort_rows(16, "train", min_len=2, max_len=3), list(rewards),
                      tokenizer=tok, environment=environment), tok
