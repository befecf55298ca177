"""rlcu's DPO step against TRL 1.16's DPOTrainer on the same batch: a tiny random Qwen3 made with
transformers (the reference) and a perturbed copy (the policy), TRL's own tokenisation, collator
and compute_loss with autograd on one side; rlcu.DPOTrainer with ref_model= on the other, fed
TRL's token ids (and TRL's text rows, which it tokenises alike). The loss, every parameter's
gradient and TRL's reward metrics agree, for the sigmoid and IPO losses. Skipped where TRL is not
installed. The first case's time is mostly importing TRL (~20 s on 2 cores; the second takes ~3 s)."""

import pytest
import torch
from support.hf_util import rel_err

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py

V = 40


def _tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<eos>": 1, **{f"t{i}": i for i in range(2, V)}}
    wl = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    wl.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=wl, unk_token="<unk>", eos_token="<eos>", pad_token="<eos>")


def _models(tmp_path):
    """(reference folder, policy HF model, policy folder, reference HF model)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen3Config(vocab_size=V, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=2,
                      num_key_value_heads=1, head_dim=16, max_position_embeddings=64, eos_token_id=1, pad_token_id=1,
                      bos_token_id=None, tie_word_embeddings=False, attn_implementation="eager")
    ref = Qwen3ForCausalLM(cfg).float()
    with torch.no_grad():
        for n, p in ref.named_parameters():
            p.copy_(1 + 0.1 * torch.randn_like(p) if "norm" in n else 0.1 * torch.randn_like(p))
    ref.save_pretrained(tmp_path / "ref")
    pol = Qwen3ForCausalLM(cfg).float()
    pol.load_state_dict(ref.state_dict())
    with torch.no_grad():
        for p in pol.parameters():
            p.add_(0.03 * torch.randn_like(p))
    pol.save_pretrained(tmp_path / "policy")
    return tmp_path / "ref", pol, tmp_path / "policy", ref


ROWS = [{"prompt": "t2 t3 t4", "chosen": " t5 t6", "rejected": " t7 t8 t9 t10"},
        {"prompt": "t11", "chosen": " t12 t13 t14", "rejected": " t15"},
        {"prompt": "t16 t17 t18 t19 t20", "chosen": " t21", "rejected": " t22 t23"}]


@pytest.mark.parametrize("loss_type", ["sigmoid", "ipo"])
def test_dpo_step_equals_trl(tmp_path, loss_type):
    datasets = pytest.importorskip("datasets")
    trl = pytest.importorskip("trl")
    import rlcu
    from rlcu.config import DPOConfig, load_config

    ref_dir, pol, pol_dir, ref = _models(tmp_path)
    beta = 0.5
    args = trl.DPOConfig(output_dir=str(tmp_path / "trl"), loss_type=[loss_type], beta=beta, report_to=[],
                         use_cpu=True, bf16=False, per_device_train_batch_size=len(ROWS), logging_steps=1)
    tok = _tokenizer()
    t = trl.DPOTrainer(model=pol, ref_model=ref, args=args, train_dataset=datasets.Dataset.from_list(ROWS),
                       processing_class=tok)
    ds = t.train_dataset
    batch = t.data_collator([ds[i] for i in range(len(ROWS))])
    t.model.train()
    loss = t.compute_loss(t.model, batch)
    loss.backward()
    grads = {n: p.grad for n, p in t.model.named_parameters()}
    theirs = {k: v[-1] for k, v in t._metrics["train"].items()}

    rows = [{f"{k}_token_ids": ds[i][f"{k}_ids"] for k in ("prompt", "chosen", "rejected")} for i in range(len(ROWS))]
    cfg = load_config(DPOConfig, None, [f"log.out_dir={tmp_path / 'run'}", f"ref_model={ref_dir}", "steps=1",
                                        f"loss_type={loss_type}", f"beta={beta}", "optim.max_grad_norm=0",
                                        "batch_tokens=4096", "data.shuffle=false", "log.progress=false"])
    ours = rlcu.DPOTrainer(cfg, dataset=rows, model=rlcu.CausalLM.from_pretrained(pol_dir))
    m = ours.train_step(0)  # the step's gradient stays in model.grads after the update
    assert m["loss"] == pytest.approx(float(loss.detach()), rel=1e-5)
    for k in ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen",
              "logps/rejected"):
        assert m[k] == pytest.approx(theirs[k], rel=1e-4, abs=1e-6), k
    for name, g in ours.model.grads.items():
        assert rel_err(g, grads[name]) < 1e-4, name
    text = rlcu.DPOTrainer(cfg, dataset=ROWS, model=rlcu.CausalLM.from_pretrained(pol_dir), tokenizer=tok)
    assert text.pairs == ours.pairs  # TRL's text rows tokenised by rlcu.data.preference as TRL does
