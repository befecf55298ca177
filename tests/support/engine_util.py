"""What the engine's end-to-end tests on a tiny HF checkpoint generate: greedy sampling of 10
tokens with their logprobs, from prompts of odd lengths (3, 21, 9, 30 and 1 tokens; one a run
of a single token)."""

import os

from rlcu.engine import LLM, SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, logprobs=True)
PROMPTS = [[5, 17, 3], list(range(40, 61)), [7] * 9, [100 + (i * 37) % 200 for i in range(30)], [1]]


def assert_kernels_equal_twins(m, monkeypatch) -> None:
    """m's engine on the Triton kernels (interpreted on the CPU) gives the twins' tokens, and their
    logprobs within 1e-5 interpreted (1e-3 on a GPU, whose kernels sum in another order)."""
    sp = SamplingParams(n=1, temperature=0.8, max_tokens=3, ignore_eos=True, seed=3, logprobs=True)
    outs = {}
    for backend in ("torch", "triton"):
        monkeypatch.setenv("RLCU_BACKEND", backend)
        llm = LLM(m, num_kv_blocks=16, block_size=4, max_num_batched_tokens=12, enforce_eager=True)
        outs[backend] = llm.generate([{"prompt_token_ids": p} for p in ([5, 17, 3, 9, 11], list(range(40, 52)))],
                                     sp, use_tqdm=False)
    tol = 1e-5 if os.environ.get("TRITON_INTERPRET") == "1" else 1e-3
    for a, b in zip(outs["torch"], outs["triton"]):
        x, y = a.outputs[0], b.outputs[0]
        assert x.token_ids == y.token_ids
        assert max(abs(p - q) for p, q in zip(x.logprobs, y.logprobs)) < tol
