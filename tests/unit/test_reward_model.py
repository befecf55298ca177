"""The reward model (model/reward_model.py) against HF transformers' sequence classification, the
oracle, on tiny random checkpoints of every dense family at odd shapes, fp32, CPU: scores at each
sequence's last token, every parameter's gradient, and the HF folder round trip both ways."""

import json

import pytest
import torch
from support.hf_util import SEQ_CLS_CASES, hf_scores, make_hf_model, make_seq_cls_model, rel_err

from rlcu.model.reward_model import RewardModel

transformers = pytest.importorskip("transformers")

SEQS = [[int(t) for t in torch.randint(1, 333, (L,), generator=torch.Generator().manual_seed(L))]
        for L in (23, 1, 9, 17)]


@pytest.mark.parametrize("case", list(SEQ_CLS_CASES))
def test_scores_grads_and_folder_match_hf(case, tmp_path):
    hf, folder = make_seq_cls_model(tmp_path, case, seed=len(case))
    rm = RewardModel.from_pretrained(folder)
    assert "lm_head" not in rm.trunk.layout.slots  # no [V, H] matrix a reward model never reads
    ref = hf_scores(hf, SEQS)
    got = rm.score(SEQS)
    assert got.dtype == torch.float32 and got.shape == (4,)
    assert rel_err(got, ref.detach()) < 1e-5
    assert rel_err(rm.score(SEQS, max_tokens=10), got) < 1e-6  # several packed batches: the same scores

    # every parameter's gradient of sum(dr * r) against HF autograd
    dr = torch.randn(4, generator=torch.Generator().manual_seed(1))
    tokens = torch.tensor([t for s in SEQS for t in s])
    cu = torch.tensor([0, 23, 24, 33, 50], dtype=torch.int32)
    rm.gradient_checkpointing = case != "qwen3"  # both modes
    rm.zero_grad()
    rm.forward(tokens, cu)
    rm.backward(dr)
    hf.zero_grad()
    (hf_scores(hf, SEQS) * dr).sum().backward()
    for name, p in hf.named_parameters():
        mine = rm.dhead_w.view(1, -1) if name == "score.weight" else rm.trunk.grads[name]
        assert rel_err(mine, p.grad) < 1e-4, name
    assert float(rm.dhead_b.abs().sum()) == 0  # HF's score has no bias

    # rlcu's save loads into transformers with the same scores
    out = tmp_path / "saved"
    rm.save_pretrained(out)
    d = json.loads((out / "config.json").read_text())
    assert d["architectures"] == [type(hf).__name__] and d["pad_token_id"] == 0 and d["num_labels"] == 1
    back = transformers.AutoModelForSequenceClassification.from_pretrained(out, attn_implementation="eager").float()
    assert type(back) is type(hf) and back.config.num_labels == 1
    assert rel_err(hf_scores(back, SEQS).detach(), got) < 1e-5


def test_from_causal_lm_and_refusals(tmp_path):
    hf_lm, folder = make_hf_model(tmp_path)
    rm = RewardModel.from_causal_lm(folder, seed=3, pad_token_id=0)
    assert 0.005 < float(rm.head_w.std()) < 0.05  # HF's initializer_range
    rm.save_pretrained(tmp_path / "rm")
    back = transformers.AutoModelForSequenceClassification.from_pretrained(tmp_path / "rm", attn_implementation="eager")
    assert torch.equal(back.model.embed_tokens.weight, hf_lm.model.embed_tokens.weight)
    assert not any("lm_head" in n for n, _ in back.named_parameters())
    assert rel_err(hf_scores(back.float(), SEQS).detach(), rm.score(SEQS)) < 1e-5
    again = RewardModel.from_pretrained(tmp_path / "rm")
    assert torch.equal(again.flat, rm.flat) and again.pad_token_id == 0

    with pytest.raises(ValueError, match="from_causal_lm"):
        RewardModel.from_pretrained(folder)
    d = json.loads((tmp_path / "rm" / "config.json").read_text())
    d["id2label"] = {"0": "a", "1": "b"}
    (tmp_path / "rm" / "config.json").write_text(json.dumps(d))
    with pytest.raises(ValueError, match="one label"):
        RewardModel.from_pretrained(tmp_path / "rm")
    with pytest.raises(ValueError, match="empty sequence"):
        rm.score([[3, 4], []])
