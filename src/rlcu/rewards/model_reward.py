"""A reward model in the reward set: `rewards: [{model: FOLDER, weight: ...}]` scores each sample
with an HF `*ForSequenceClassification` folder of one label (rlcu.model.reward_model, any family
rlcu runs), in the trainer's process and on its device, beside the function rewards.

What the model reads is what it was trained on:
- the policy's own token ids (prompt + completion, or an episode's whole conversation, the
  environment's tokens included), with no re-tokenisation, when the folder has no tokenizer of its
  own or its tokenizer is the policy's (the same vocabulary and chat template); a chat sample that
  ends at the end-of-turn token gets what the template renders after it (ChatML's newline,
  `turn_end`), as the conversations the model was trained on (data/preference.py) end;
- else the sample rendered by its own tokenizer: a chat prompt's messages with the completion as
  an assistant turn (an episode's messages after its prompt) through its chat template (`kwargs`
  are the template's variables, e.g. enable_thinking), a text prompt and completion as one text
  (with the tokenizer's special tokens, as TRL's RewardTrainer tokenizes text).

Scoring is batched by tokens: sequences in their order, a forward at most `max_tokens` tokens
(one longer sequence alone) and at most `batch_size` sequences; each score is read at the
sequence's last token. A sample the model cannot score (a token outside its vocabulary, longer
than its context, a non-finite score) fails alone and is masked as a function's failure is
(rewards/reward_set.py); an error of the forward fails the samples of its batch.

Memory (rlcu.memory: the reward-model part): its weights, and one scoring forward's activations
in the rollout phase. With `offload` the weights live in host memory between scorings: `sleep()`
frees the device storage of the flat buffer (its views stay valid) and `wake()` copies it back
from a host copy made once (the model is frozen), as the engine's pool comes and goes; `auto`
lets the trainer choose (rlcu.train.sizing: offloaded only where the memory model says the job
does not fit with them resident). At the 4B shape the copy back costs 0.3 s a step
(bench/results/ppo_rm_offload.json).
"""

from __future__ import annotations

import math
from pathlib import Path

import torch

OFFLOAD = ("auto", True, False)
SPEC_KEYS = ("model", "name", "weight", "batch_size", "max_tokens", "offload", "kwargs")
DEFAULT_MAX_TOKENS = 16384


class ModelRewardError(ValueError):
    """A reward model's folder or options that cannot be used: `field` (rewards[i].model, ...) and
    `detail`, read as a ConfigError reads."""

    def __init__(self, field: str, detail: str):
        self.field, self.detail = field, detail
        super().__init__(f"{field} {detail}")


def check_folder(path, field: str) -> Path:
    """The folder of a one-label sequence-classification model, or a ModelRewardError naming
    `field`: not a folder, not a sequence-classification model, num_labels != 1."""
    import json

    p = Path(str(path)).expanduser()
    if not p.is_dir():
        raise ModelRewardError(field, f"{path!r} is not a folder (an HF *ForSequenceClassification folder)")
    try:
        d = json.loads((p / "config.json").read_text())
    except FileNotFoundError:
        raise ModelRewardError(field, f"{p} has no config.json (an HF *ForSequenceClassification folder)") from None
    except json.JSONDecodeError as e:
        raise ModelRewardError(field, f"{p}/config.json is not JSON ({e.msg} at line {e.lineno})") from None
    arch = (d.get("architectures") or [None])[0]
    if not isinstance(arch, str) or not arch.endswith("ForSequenceClassification"):
        raise ModelRewardError(field, f"{p} is not a sequence-classification model (architectures: "
                               f"{d.get('architectures')}; a reward model is an HF *ForSequenceClassification "
                               f"folder with one label)")
    labels = len(d["id2label"]) if isinstance(d.get("id2label"), dict) else d.get("num_labels", 2)
    if labels != 1:
        raise ModelRewardError(field, f"{p} has num_labels {labels}; a reward model has one label (a scalar "
                               f"score)")
    return p


def _positive(v, field: str) -> int | None:
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise ModelRewardError(field, f"must be a positive integer, got {v!r}")
    return v


def check_spec(spec: dict, field: str) -> None:
    """A `{model: ...}` entry's keys and values (not the folder: `check_folder`)."""
    bad = [k for k in spec if k not in SPEC_KEYS]
    if bad:
        raise ModelRewardError(f"{field}.{bad[0]}", f"is not an option of a reward model (allowed: "
                                                    f"{', '.join(SPEC_KEYS)})")
    _positive(spec.get("batch_size"), f"{field}.batch_size")
    _positive(spec.get("max_tokens"), f"{field}.max_tokens")
    if spec.get("offload", "auto") not in OFFLOAD:
        raise ModelRewardError(f"{field}.offload", f"must be auto, true or false, got {spec.get('offload')!r}")
    if not isinstance(spec.get("kwargs") or {}, dict):
        raise ModelRewardError(f"{field}.kwargs", f"must be a mapping (the chat template's variables), got "
                                                 f"{spec.get('kwargs')!r}")


def same_tokenizer(a, b) -> bool:
    """Whether two rlcu Tokenizers map text to the same ids and render chats alike."""
    if a is None or b is None:
        return a is b
    return a.chat_template == b.chat_template and a.vocab_size == b.vocab_size and \
        a.backend.get_vocab(with_added_tokens=True) == b.backend.get_vocab(with_added_tokens=True)


def _is_chat(prompt) -> bool:
    return isinstance(prompt, (list, tuple)) and (not prompt or isinstance(prompt[0], dict))


def turn_end(tok) -> tuple[int | None, list[int]]:
    """(the end-of-turn token, the ids a chat template renders after it when an assistant turn
    closes a conversation), e.g. (<|im_end|>, ["\\n"]) for ChatML: what a reward model trained on
    rendered conversations saw after a completion that the policy's sampled ids end at its EOS.
    (None, []) without a chat template."""
    if tok is None or tok.chat_template is None or tok.eos_token_id is None:
        return None, []
    try:
        ids = list(tok.apply_chat_template([{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}],
                                           tokenize=True))
    except Exception:  # noqa: BLE001 - a template that needs more than this probe: no tail
        return None, []
    at = max((i for i, t in enumerate(ids) if t == tok.eos_token_id), default=None)
    return (None, []) if at is None else (tok.eos_token_id, ids[at + 1:])


class ModelReward:
    """A reward model as a reward: `rm` a RewardModel (rlcu.model.reward_model: `score(sequences)`,
    `cfg`, `flat`); `tokenizer` its own (None: it reads the policy's ids); `policy_tokenizer` the
    policy's (when equal to `tokenizer`, the ids are used as they are)."""

    def __init__(self, rm, *, tokenizer=None, policy_tokenizer=None, max_tokens: int | None = None,
                 batch_size: int | None = None, offload=False, template_kwargs: dict | None = None):
        self.rm = rm
        self.tokenizer = None if same_tokenizer(tokenizer, policy_tokenizer) else tokenizer
        self.max_tokens = max_tokens or DEFAULT_MAX_TOKENS
        self.batch_size = batch_size
        self.offload = offload
        self.template_kwargs = dict(template_kwargs or {})
        self._host: torch.Tensor | None = None  # the weights' host copy (offload), made once
        self._asleep = False
        self.scored_tokens = 0  # tokens of the last call's sequences
        self.turn_end = turn_end(policy_tokenizer)

    @classmethod
    def load(cls, source, field: str, *, device, dtype, policy_tokenizer=None, **kw) -> ModelReward:
        """From a folder (or a Hub id, fetched) checked by `check_folder`, its tokenizer from the
        folder's tokenizer.json when there is one; or from a RewardModel, which reads the policy's ids."""
        from rlcu.data.tokenizer import Tokenizer
        from rlcu.hub import hub_id, model_folder
        from rlcu.model.reward_model import RewardModel

        tok = None
        if isinstance(source, (str, Path)):
            if not Path(str(source)).expanduser().exists() and hub_id(str(source)) is not None:
                source = model_folder(str(source), None, field)
            folder = check_folder(source, field)
            rm = RewardModel.from_pretrained(folder, device=device, dtype=dtype)
            if (folder / "tokenizer.json").is_file():
                tok = Tokenizer.from_pretrained(folder)
        elif hasattr(source, "score") and hasattr(source, "cfg"):
            rm = source
        else:
            raise ModelRewardError(field, f"must be a folder or a RewardModel, got {source!r}")
        return cls(rm, tokenizer=tok, policy_tokenizer=policy_tokenizer, **kw)

    # ---------------------------------------------------------------- memory
    @property
    def asleep(self) -> bool:
        return self._asleep

    def sleep(self) -> None:
        """Free the weights' device storage (their views stay valid). The host copy (pinned on CUDA)
        is made at the first sleep and kept: the model is frozen in the loop, so a later sleep
        copies nothing back and only `wake` moves its weights."""
        if self._asleep:
            return
        flat = self.rm.flat
        if self._host is None:
            self._host = torch.empty(flat.shape, dtype=flat.dtype, pin_memory=flat.is_cuda)
            self._host.copy_(flat)
        flat.untyped_storage().resize_(0)
        self._asleep = True

    def wake(self) -> None:
        if not self._asleep:
            return
        flat = self.rm.flat
        flat.untyped_storage().resize_(self._host.numel() * self._host.element_size())
        flat.copy_(self._host, non_blocking=True)
        self._asleep = False

    # ---------------------------------------------------------------- rendering
    def render(self, prompts: list, completions: list, sequence_ids: list | None) -> list[list[int] | str]:
        """Each sample's token ids for the model, or why it has none."""
        if self.tokenizer is None:
            if sequence_ids is None:
                return ["no token ids were given for the reward model (it reads the policy's)"] * len(prompts)
            end, tail = self.turn_end
            return [list(map(int, s)) + (tail if end is not None and _is_chat(p) and s and int(s[-1]) == end else [])
                    for p, s in zip(prompts, sequence_ids)]
        return [self._render_one(p, c) for p, c in zip(prompts, completions)]

    def _render_one(self, prompt, completion) -> list[int] | str:
        tok = self.tokenizer
        chat = _is_chat(prompt)
        try:
            if chat:
                if tok.chat_template is None:
                    return "a chat prompt, and the reward model's tokenizer has no chat template"
                turns = list(completion) if isinstance(completion, (list, tuple)) else \
                    [{"role": "assistant", "content": completion}]
                return tok.apply_chat_template(list(prompt) + turns, tokenize=True, **self.template_kwargs)
            if not isinstance(prompt, str) or not isinstance(completion, str):
                return f"cannot render prompt {type(prompt).__name__} and completion {type(completion).__name__} " \
                       f"as text for the reward model's tokenizer"
            return tok.encode(prompt + completion, add_special_tokens=True)
        except Exception as e:  # noqa: BLE001 - a template's error belongs to its sample
            return f"rendering for the reward model failed: {type(e).__name__}: {e}"

    def _why_not(self, ids: list[int]) -> str | None:
        cfg = self.rm.cfg
        if not ids:
            return "an empty sequence"
        if len(ids) > cfg.max_position_embeddings:
            return f"{len(ids)} tokens, longer than the reward model's context ({cfg.max_position_embeddings})"
        bad = next((t for t in ids if not 0 <= t < cfg.vocab_size), None)
        if bad is not None:
            return (f"token id {bad} outside the reward model's vocabulary [0, {cfg.vocab_size}) (give the reward "
                    f"model folder its tokenizer)")
        return None

    # ---------------------------------------------------------------- scoring
    def batches(self, lengths: list[int]) -> list[list[int]]:
        """Indices in order, cut so a batch holds at most max_tokens tokens (a longer sequence
        alone) and batch_size sequences."""
        out, cur, toks = [], [], 0
        for i, n in enumerate(lengths):
            if cur and (toks + n > self.max_tokens or (self.batch_size and len(cur) >= self.batch_size)):
                out.append(cur)
                cur, toks = [], 0
            cur.append(i)
            toks += n
        return out + ([cur] if cur else [])

    def __call__(self, prompts: list, completions: list, sequence_ids: list | None = None
                 ) -> tuple[list[float], dict[int, str]]:
        """-> (a score per sample, nan where none; {sample: why it failed})."""
        n = len(prompts)
        vals, fails = [math.nan] * n, {}
        seqs = self.render(prompts, completions, sequence_ids)
        ok = []
        for i, s in enumerate(seqs):
            why = s if isinstance(s, str) else self._why_not(s)
            if why is None:
                ok.append(i)
            else:
                fails[i] = why
        self.scored_tokens = sum(len(seqs[i]) for i in ok)
        if not ok:
            return vals, fails
        if self.offload is True:  # auto: kept until the trainer decides (train/sizing.py)
            self.wake()
        try:
            for b in self.batches([len(seqs[i]) for i in ok]):
                idx = [ok[j] for j in b]
                try:
                    out = self.rm.score([seqs[i] for i in idx], max_tokens=self.max_tokens).float().cpu().tolist()
                except Exception as e:  # noqa: BLE001 - the model's failure masks its batch, as a function's
                    fails.update({i: f"the reward model raised {type(e).__name__}: {e}" for i in idx})
                    continue
                for i, v in zip(idx, out):
                    if math.isfinite(v):
                        vals[i] = v
                    else:
                        fails[i] = f"the reward model scored {v} (not finite)"
        finally:
            if self.offload is True:
                self.sleep()
        return vals, fails


def model_config(folder):
    """The trunk's config (rlcu.model.config.CausalLMConfig) of a sequence-classification folder,
    read without loading it (the memory model's)."""
    import json

    from rlcu.model.config import CausalLMConfig

    path = Path(folder) / "config.json"
    d = json.loads(path.read_text())
    d["architectures"] = [a.replace("ForSequenceClassification", "ForCausalLM") for a in d.get("architectures") or []]
    return CausalLMConfig.from_hf_dict(d, source=str(path))
