"""Per-op benchmark suites; each module has `run(ceil) -> list[dict]`."""

SUITES = ["elementwise", "attention", "logprob_adamw", "engine_ops"]
