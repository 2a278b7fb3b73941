"""Everything that touches tensors: the executor, the model runner and the sampler."""
