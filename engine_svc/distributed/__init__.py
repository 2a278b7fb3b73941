"""Tensor and pipeline parallelism: which share of the model a worker holds, and the
collectives (torch.distributed) that join the shares."""
