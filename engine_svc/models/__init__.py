"""Model definitions written for the engine: flattened batches, paged KV cache."""
