"""A reward model: a scalar head (no bias) on a causal-LM trunk of any dense family, read from and
written as an HF `*ForSequenceClassification` folder with one label (transformers' `score.weight`
[1, H] beside the trunk's `model.*` tensors, no LM head), so that transformers loads what rlcu
trains, and the reverse, with the same scores.

A sequence's reward is the head at its LAST token: w . rmsnorm(x[last]). HF pools at the last
token that is not `pad_token_id`, which is the same token unless a sequence ends with the pad id
(then HF scores an earlier token): `pad_token_id` should be a token sequences do not end with
(the tokenizer's pad token, not its end of turn).

The trunk has no LM head slot (its config is made tied; the config.json written keeps the
source's `tie_word_embeddings`), so a reward model holds no [V, H] matrix it never reads. The
head and its backward are model/scalar_head.py's, shared with PPO's critic.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import torch
from safetensors import safe_open

from rlcu.model import io
from rlcu.model.causal_lm import CausalLM
from rlcu.model.config import CausalLMConfig
from rlcu.model.family import BY_ARCHITECTURE
from rlcu.model.scalar_head import HeadLayout, ScalarHeadModel

SCORE = "score.weight"
_SEQ_CLS, _CAUSAL = "ForSequenceClassification", "ForCausalLM"


class RewardModel(ScalarHeadModel):
    bias = False
    name = "reward model"

    def __init__(self, cfg: CausalLMConfig, flat: torch.Tensor, pad_token_id: int | None = None,
                 tie_word_embeddings: bool = False):
        if cfg.fam.moe:
            raise ValueError(f"a reward model on {cfg.fam.architecture} is not supported (dense families only)")
        super().__init__(_headless(cfg), flat)
        self.pad_token_id = pad_token_id
        self.tie_word_embeddings = tie_word_embeddings
        self.source: Path | None = None

    @property
    def tie_word_embeddings(self) -> bool:
        """The source's (config.json's, written back); `cfg` says it and the trunk's is always tied."""
        return self.cfg.tie_word_embeddings

    @tie_word_embeddings.setter
    def tie_word_embeddings(self, on: bool) -> None:
        self.cfg = dataclasses.replace(self.cfg, tie_word_embeddings=bool(on))

    # ---------------------------------------------------------------- construction / I/O
    @classmethod
    def from_pretrained(cls, path, device="cpu", dtype=torch.float32, revision: str | None = None) -> RewardModel:
        """An HF `*ForSequenceClassification` folder with one label (or a Hub id)."""
        from rlcu.hub import model_folder

        folder = model_folder(path, revision)
        d = _read_json(folder / "config.json")
        archs = d.get("architectures") or []
        if not any(str(a).endswith(_SEQ_CLS) for a in archs):
            raise ValueError(f"{folder}/config.json: architectures {archs} is not a sequence-classification model; "
                             f"a causal LM starts a reward model through RewardModel.from_causal_lm (a fresh head)")
        labels = len(d["id2label"]) if isinstance(d.get("id2label"), dict) else d.get("num_labels", 1)
        if labels != 1:
            raise ValueError(f"{folder}/config.json: a reward model has one label, this config has {labels}")
        arch = next(a for a in archs if str(a).endswith(_SEQ_CLS)).replace(_SEQ_CLS, _CAUSAL)
        if arch not in BY_ARCHITECTURE:
            raise ValueError(f"{folder}/config.json: unsupported architecture {archs[0]!r}; rlcu reads "
                             + ", ".join(a.replace(_CAUSAL, _SEQ_CLS) for a in BY_ARCHITECTURE))
        cfg = CausalLMConfig.from_hf_dict(d, str(folder / "config.json"))
        m = cls(cfg, torch.zeros(HeadLayout(_headless(cfg)).numel, device=device, dtype=dtype),
                d.get("pad_token_id"), cfg.tie_word_embeddings)
        m.load_pretrained(folder)
        m.source = folder
        return m

    def load_pretrained(self, folder) -> None:
        """This model's weights, in place, from an HF sequence-classification folder of its shape
        (a checkpoint's model/ on resume)."""
        folder = Path(folder)
        io.load_into(folder, self.trunk.layout, self.flat[: self.layout.head_offset], skip=frozenset({SCORE}))
        self.head_w.copy_(_read_score(folder, self.cfg.hidden_size))

    @classmethod
    def from_causal_lm(cls, path_or_model, device="cpu", dtype=torch.float32, head_init_std: float = 0.02,
                       seed: int = 0, pad_token_id: int | None = None, revision: str | None = None) -> RewardModel:
        """A causal LM's trunk (a folder, Hub id or CausalLM; its LM head dropped) with a fresh head
        drawn N(0, head_init_std) as transformers initialises `score` (initializer_range 0.02)."""
        if isinstance(path_or_model, CausalLM):
            lm = path_or_model
        else:
            lm = CausalLM.from_pretrained(path_or_model, device=device, dtype=dtype, revision=revision)
        if pad_token_id is None and lm.source is not None:
            pad_token_id = _read_json(lm.source / "config.json").get("pad_token_id")
        m = cls._with_trunk(_headless(lm.cfg), lm.params, lm.device, lm.dtype, head_init_std, seed)
        m.pad_token_id, m.tie_word_embeddings, m.source = pad_token_id, lm.cfg.tie_word_embeddings, lm.source
        m.gradient_checkpointing = lm.gradient_checkpointing
        return m

    def hf_config(self) -> dict:
        """The config.json of the HF folder: the family's, as `...ForSequenceClassification` with
        one label and `pad_token_id` (the end of sequence when none was given: HF needs one to
        score a padded batch)."""
        d = self.cfg.to_hf_dict()
        pad = self.pad_token_id if self.pad_token_id is not None else (self.cfg.eos_token_ids or [None])[0]
        d.update(architectures=[self.cfg.fam.architecture.replace(_CAUSAL, _SEQ_CLS)], num_labels=1,
                 id2label={"0": "LABEL_0"}, label2id={"LABEL_0": 0}, pad_token_id=pad)
        return d

    def save_pretrained(self, path, dtype: torch.dtype | None = None) -> None:
        """An HF sequence-classification folder (weights, config.json; the source's tokenizer files)."""
        io.save_folder(path, self.trunk.layout, self.trunk.flat, dtype=dtype,
                       extra={SCORE: self.head_w.view(1, -1)}, config=self.hf_config())
        if self.source is not None:
            io.copy_side_files(self.source, path)

    # ---------------------------------------------------------------- scoring
    @staticmethod
    def last_rows(cu_seqlens: torch.Tensor) -> torch.Tensor:
        """Each sequence's last token: cu_seqlens[1:] - 1 (LongTensor [S])."""
        return cu_seqlens[1:].long() - 1

    def forward(self, tokens: torch.Tensor, cu_seqlens: torch.Tensor, grad: bool = True) -> torch.Tensor:
        """tokens [N], cu_seqlens [S+1] int32 (no empty sequence) -> rewards [S] fp32, each at its
        sequence's last token."""
        if bool((cu_seqlens[1:] <= cu_seqlens[:-1]).any()):
            raise ValueError("a reward model scores non-empty sequences only (cu_seqlens has an empty one)")
        return self._head_fwd(tokens, cu_seqlens, self.last_rows(cu_seqlens), grad)

    def backward(self, dr: torch.Tensor) -> None:
        """Accumulate d(sum(dr * r))/dθ for the r of the last forward: the head's gradient in
        `dhead_w`, the trunk's in its gradient buffer (or its adapters')."""
        if self._ctx is not None and dr.shape != self._ctx["rows"].shape:
            raise ValueError(f"dr must have shape {list(self._ctx['rows'].shape)}, got {list(dr.shape)}")
        self._head_bwd(dr)

    @torch.no_grad()
    def score(self, sequences: list[list[int]], max_tokens: int = 16384) -> torch.Tensor:
        """Rewards of token-id sequences -> float32 [B] (on the CPU), packed varlen in batches of
        at most `max_tokens` tokens (a longer sequence is a batch of its own)."""
        if any(len(s) == 0 for s in sequences):
            raise ValueError("RewardModel.score: an empty sequence has no last token to score")
        out, i = [], 0
        while i < len(sequences):
            j, n = i, 0
            while j < len(sequences) and (j == i or n + len(sequences[j]) <= max_tokens):
                n += len(sequences[j])
                j += 1
            batch = sequences[i:j]
            tokens = torch.tensor([t for s in batch for t in s], dtype=torch.long, device=self.device)
            lens = torch.tensor([0] + [len(s) for s in batch], dtype=torch.int32)
            cu = torch.cumsum(lens, 0, dtype=torch.int32).to(self.device)
            out.append(self.forward(tokens, cu, grad=False).cpu())
            i = j
        return torch.cat(out) if out else torch.zeros(0)


def _headless(cfg: CausalLMConfig) -> CausalLMConfig:
    """The trunk's config: tied, so that its layout has no LM head slot."""
    return cfg if cfg.tie_word_embeddings else dataclasses.replace(cfg, tie_word_embeddings=True)


def _read_json(path: Path) -> dict:
    try:
        return json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise FileNotFoundError(f"{path}: config.json not found") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: invalid JSON at line {e.lineno}: {e.msg}") from None


def _read_score(folder: Path, H: int) -> torch.Tensor:
    """score.weight [1, H] from whichever of the folder's files holds it."""
    for p in sorted(folder.glob("*.safetensors")):
        with safe_open(str(p), framework="pt") as f:
            if SCORE in f.keys():
                t = f.get_tensor(SCORE)
                if tuple(t.shape) != (1, H):
                    raise ValueError(f"{p}: {SCORE} has shape {list(t.shape)}, a one-label head on hidden size {H} "
                                     f"is [1, {H}]")
                return t.view(-1)
    raise ValueError(f"{folder}: no {SCORE} tensor (the sequence-classification head)")
