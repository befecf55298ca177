"""Qwen3: config, flat weight layout, HF folder I/O, forward and manual backward."""
