"""The causal LM of every supported family (family.py): config, flat weight layout, HF folder I/O,
forward and manual backward."""
