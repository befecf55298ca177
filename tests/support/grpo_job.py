"""A tiny GRPO job on the sort task for the scheduler's tests (one rank in
tests/integration/test_sched_job.py, two in test_sched_dp.py): its tokenizer, prompt rows, the
memory it asks for by phase and its config as the dict a job file holds."""

from rlcu.data.synthetic import make_tokenizer, sort_rows

TOK = make_tokenizer()
ROWS = sort_rows(16, seed=1)
MEM = {"resident": 2.0, "init": 1.0, "rollout": 4.0, "ref_logprobs": 2.0, "actor_train": 4.0}


def config(out, steps=2):
    return {"model": {"tiny": {"vocab_size": TOK.vocab_size, "hidden_size": 32, "intermediate_size": 64,
                               "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1,
                               "head_dim": 16, "max_position_embeddings": 32, "eos_token_id": TOK.eos_token_id,
                               "bos_token_id": None}, "device": "cpu", "dtype": "float32"},
            "steps": steps, "prompts_per_step": 2, "group_size": 4, "max_new_tokens": 8, "temperature": 1.0,
            "kl_coef": 0.05, "optim": {"lr": 1e-2, "warmup_steps": 0}, "chat_template": False,
            "log": {"out_dir": str(out), "tensorboard": False, "plot": False, "progress": False},
            "checkpoint": {"save_at_end": False}}
