"""The estimators against TRL 1.16's own code on the same batch: GRPOTrainer._compute_loss
(importance_sampling_level="sequence" for GSPO, loss_type="dr_grpo" for Dr. GRPO's constant
normaliser), its loss and its gradient at the per-token logprobs, against rlcu's fused loss
with the token weights of the matching loss_agg; RLOOTrainer's leave-one-out advantages (its
_generate_and_score_completions on fixed completions and rewards) against rlcu's. TRL's model
forward is replaced by the batch's logprobs (a leaf tensor), so the comparison is of the loss
as a function of the logprobs; the model's backward from dlp is tested elsewhere. Skipped where
TRL is not installed. The first test pays TRL's import (~20 s on a loaded 2-core machine, once
per process: test_sched_trl pays it too); each test's own work is under a second."""

from __future__ import annotations

import math

import pytest
import torch
from support.hf_util import rel_err

from rlcu.ops.rl_loss import policy_loss, sequence_policy_loss
from rlcu.train import losses

V = 48
B, P, T = 6, 3, 7  # sequences (3 prompts x 2 samples), prompt tokens, most completion tokens


def _tiny_parts():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast, Qwen3Config, Qwen3ForCausalLM

    vocab = {"<unk>": 0, "<eos>": 1, **{f"t{i}": i for i in range(2, V)}}
    wl = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    wl.pre_tokenizer = pre_tokenizers.Whitespace()
    tok = PreTrainedTokenizerFast(tokenizer_object=wl, unk_token="<unk>", eos_token="<eos>", pad_token="<eos>")
    torch.manual_seed(0)
    cfg = Qwen3Config(vocab_size=V, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                      num_key_value_heads=1, head_dim=8, max_position_embeddings=64, eos_token_id=1, pad_token_id=1,
                      bos_token_id=None)
    return Qwen3ForCausalLM(cfg), tok


def _trl_trainer(kind: str, tmp_path, beta: float = 0.0, **args):
    trl = pytest.importorskip("trl")
    datasets = pytest.importorskip("datasets")
    model, tok = _tiny_parts()
    ds = datasets.Dataset.from_list([{"prompt": "t2 t3 t4"}] * 8)
    cfg_cls, tr_cls = (trl.GRPOConfig, trl.GRPOTrainer) if kind == "grpo" else (trl.RLOOConfig, trl.RLOOTrainer)
    a = cfg_cls(output_dir=str(tmp_path / kind), per_device_train_batch_size=B, num_generations=2,
                max_completion_length=T, report_to=[], save_strategy="no", use_cpu=True, disable_tqdm=True, beta=0.0,
                **args)
    tr = tr_cls(model=model, reward_funcs=[lambda completions, **_: [0.0] * len(completions)], args=a,
                train_dataset=ds, processing_class=tok)
    tr.beta = beta  # set after: TRL would load a reference model from the Hub by the config's name
    tr.model.eval()  # TRL's "eval" mode: no gradient-accumulation normaliser
    return tr


def _batch(seed=0):
    """A padded [B, T] completion batch (ragged lengths) and its packed form for rlcu."""
    g = torch.Generator().manual_seed(seed)
    lens = torch.tensor([7, 3, 5, 7, 1, 6])
    cmask = (torch.arange(T)[None] < lens[:, None]).float()
    old = -torch.rand(B, T, generator=g) * 2
    lp = old + 0.1 * torch.randn(B, T, generator=g)
    ref = old + 0.2 * torch.randn(B, T, generator=g)
    adv = torch.tensor([1.0, -1.0, 0.5, -0.5, 2.0, -2.0])
    # packed: each sequence P prompt tokens (mask 0) then its completion tokens
    cu = torch.tensor([0, *(P + lens).cumsum(0).tolist()], dtype=torch.int32)
    pk = lambda x: torch.cat([torch.cat([torch.zeros(P), x[i, : lens[i]]]) for i in range(B)])  # noqa: E731
    mask = pk(cmask)
    return dict(lp=lp, old=old, ref=ref, adv=adv, cmask=cmask, lens=lens, cu=cu, mask=mask, pk=pk,
                adv_tok=pk(adv[:, None].expand(B, T).contiguous()))


def _trl_loss(tr, b):
    """TRL's loss and d loss / d per_token_logps on the padded batch."""
    lp = b["lp"].clone().requires_grad_(True)
    tr._get_per_token_logps_and_entropies = lambda *a, **k: (lp, torch.zeros_like(lp), None)
    inputs = {"prompt_ids": torch.full((B, P), 2), "prompt_mask": torch.ones(B, P, dtype=torch.long),
              "completion_ids": torch.full((B, T), 3), "completion_mask": b["cmask"].long(),
              "advantages": b["adv"], "old_per_token_logps": b["old"], "ref_per_token_logps": b["ref"],
              "num_items_in_batch": b["cmask"].sum()}
    loss = tr._compute_loss(tr.model, inputs)
    loss.backward()
    return float(loss), lp.grad


@pytest.mark.parametrize("case", ["gspo", "dr_grpo"])
def test_loss_and_gradient_equal_trl(tmp_path, case):
    """GSPO (TRL: importance_sampling_level="sequence", loss_type="grpo"; rlcu: sequence ratio,
    seq_mean) and Dr. GRPO (TRL: loss_type="dr_grpo"; rlcu: seq_mean_token_sum_norm over
    max_new_tokens), with clip-higher and a k3 KL: the same loss and gradient, to fp32. (TRL's
    use_bias_correction_kl, on by default, weights the KL by the ratio; rlcu's KL is not, so it
    is off here.)"""
    cl, ch, beta = 0.02, 0.03, 0.04  # tight, so that sequences (and tokens) clip on both sides
    kw = dict(epsilon=cl, epsilon_high=ch, beta=beta, use_bias_correction_kl=False)
    if case == "gspo":
        tr = _trl_trainer("grpo", tmp_path, importance_sampling_level="sequence", loss_type="grpo", **kw)
    else:
        tr = _trl_trainer("grpo", tmp_path, loss_type="dr_grpo", **kw)
    b = _batch()
    L_trl, g_trl = _trl_loss(tr, b)
    pk = b["pk"]
    lp, old, ref = pk(b["lp"]), pk(b["old"]), pk(b["ref"])
    kw = dict(clip_low=cl, clip_high=ch, kl_coef=beta)
    if case == "gspo":
        w = losses.token_weights(b["cu"], b["mask"], "seq_mean")
        loss, dlp, _, st = sequence_policy_loss(lp, old, ref, b["adv_tok"], w, b["cu"], level="sequence", **kw)
    else:
        w = losses.token_weights(b["cu"], b["mask"], "seq_mean_token_sum_norm", horizon=T)
        loss, dlp, _, st = policy_loss(lp, old, ref, b["adv_tok"], w, **kw)
    assert float(loss.sum()) == pytest.approx(L_trl, rel=1e-5, abs=1e-7)
    assert rel_err(dlp, pk(g_trl)) < 1e-5
    clip = float(st[4] + st[5]) / float(st[-1])
    assert 0 < clip < 1  # the case exercises the clip


def test_rloo_advantages_equal_trl(tmp_path):
    """TRL's RLOOTrainer computes its advantages inside _generate_and_score_completions: run it on
    fixed completions and rewards (one unscorable), as rlcu.train.losses.rloo_advantages."""
    tr = _trl_trainer("rloo", tmp_path)
    tr.model.train()
    tr.num_generations = 3  # groups of 3: each baseline the mean of two siblings, one group with an unscorable
    r = torch.tensor([1.0, 0.0, 0.5, 0.25, 3.0, math.nan])
    tr._generate = lambda prompts: ([[2, 3]] * len(prompts), [[4, 5, 1]] * len(prompts), ["t4 t5"] * len(prompts))
    tr._calculate_rewards = lambda *a, **k: r[:, None].clone()
    theirs = tr._generate_and_score_completions([{"prompt": "t2 t3"}] * B)["advantages"].float()
    ours = losses.rloo_advantages(r, 3)
    assert torch.allclose(ours, theirs, atol=1e-6), (ours, theirs)
    assert ours[0] == pytest.approx(1.0 - 0.25) and ours[5] == 0 and ours[3] == pytest.approx(0.25 - 3.0)
