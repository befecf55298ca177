"""The published Qwen3 shapes the memory tests size (head_dim 128, vocab 151936; 0.6B is
Qwen3Config's default), and the bf16 memory mode's precisions."""

SHAPES = {
    "4b": dict(hidden_size=2560, num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8,
               intermediate_size=9728, tie_word_embeddings=True),
    "8b": dict(hidden_size=4096, num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8,
               intermediate_size=12288, tie_word_embeddings=False),
    "14b": dict(hidden_size=5120, num_hidden_layers=40, num_attention_heads=40, num_key_value_heads=8,
                intermediate_size=17408, tie_word_embeddings=False),
    "32b": dict(hidden_size=5120, num_hidden_layers=64, num_attention_heads=64, num_key_value_heads=8,
                intermediate_size=25600, tie_word_embeddings=False),
}
BF16 = dict(master=False, state_bytes=2, grad_bytes=2)  # the bf16 memory mode (JobShape's fields)
