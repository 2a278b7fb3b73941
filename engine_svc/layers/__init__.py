"""Building blocks shared by the models: attention over the paged KV cache, RoPE, norms."""
