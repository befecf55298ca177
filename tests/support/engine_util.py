"""What the engine's end-to-end tests on a tiny HF checkpoint generate: greedy sampling of 10
tokens with their logprobs, from prompts of odd lengths (3, 21, 9, 30 and 1 tokens; one a run
of a single token)."""

from rlcu.engine import SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, logprobs=True)
PROMPTS = [[5, 17, 3], list(range(40, 61)), [7] * 9, [100 + (i * 37) % 200 for i in range(30)], [1]]
