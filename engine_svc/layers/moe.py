"""Mixture-of-experts feed-forward (Mixtral, Qwen3-MoE, OLMoE): a router scores every
expert for each token and keeps its top k; each expert then runs only on the tokens routed
to it, and its outputs, weighted by the router, are added into theirs. Never a dense loop
of every expert over every token.

The checkpoint holds one gate/up/down trio per expert (Mixtral names them w1/w3/w2); after
loading they are stacked into two [experts, in, out] tensors, so an expert's step is two
matmuls on a contiguous weight. Under tensor parallelism each rank holds its columns of every
expert (as of the dense MLP) and the whole router; one all-reduce adds the ranks' parts.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine_svc.distributed.collectives import SINGLE, Collectives
from engine_svc.models.model_spec import ModelSpec
from engine_svc.models.sharding import RankShards

# The checkpoint's names of each expert's gate, up and down projections.
_MIXTRAL_NAMES = ("w1", "w3", "w2")
_NAMES = ("gate_proj", "up_proj", "down_proj")


class Matrix(nn.Module):
    """A weight under its checkpoint name (`<name>.weight`), used only once stacked."""

    def __init__(self, rows: int, columns: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(rows, columns))


class Expert(nn.Module):
    """One expert's weights as the checkpoint names them (stacked by SparseMoE.fuse)."""

    def __init__(self, hidden: int, intermediate: int, names: tuple[str, str, str]) -> None:
        super().__init__()
        gate, up, down = names
        self.add_module(gate, Matrix(intermediate, hidden))
        self.add_module(up, Matrix(intermediate, hidden))
        self.add_module(down, Matrix(hidden, intermediate))

    def weight(self, name: str) -> torch.Tensor:
        matrix: Matrix = getattr(self, name)
        return matrix.weight.detach()


class Router(nn.Module):
    """The experts' scores for each token: [tokens, experts] logits (checkpoint: gate.weight)."""

    def __init__(self, hidden: int, num_experts: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, hidden))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)


class SparseMoE(nn.Module):
    gate_up: torch.Tensor  # [experts, hidden, 2 * intermediate], set by fuse()
    down: torch.Tensor  # [experts, intermediate, hidden]

    def __init__(
        self, spec: ModelSpec, shards: RankShards, collectives: Collectives = SINGLE
    ) -> None:
        super().__init__()
        self.collectives = collectives
        mixtral = spec.architecture == "MixtralForCausalLM"
        self.names = _MIXTRAL_NAMES if mixtral else _NAMES
        self.top_k = spec.num_experts_per_tok
        self.normalize = spec.norm_topk_prob
        # Mixtral weighs the experts' outputs with the float32 router scores; the others
        # cast the scores to the model's dtype first (transformers does each).
        self.float32_scores = mixtral
        # Under tensor parallelism, this rank's columns of every expert (the router whole).
        self.intermediate = shards.moe_rows[1] - shards.moe_rows[0]
        self.gate = Router(spec.hidden_size, spec.num_experts)
        self.experts = nn.ModuleList(
            Expert(spec.hidden_size, self.intermediate, self.names) for _ in range(spec.num_experts)
        )

    def fuse(self) -> None:
        gate, up, down = self.names
        experts: list[Expert] = list(self.experts)  # type: ignore[arg-type]
        stacked_gate_up = [torch.cat([e.weight(gate), e.weight(up)]).t() for e in experts]
        self.register_buffer("gate_up", torch.stack(stacked_gate_up).contiguous(), False)
        stacked_down = [e.weight(down).t() for e in experts]
        self.register_buffer("down", torch.stack(stacked_down).contiguous(), False)
        del self.experts

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = self.gate(x)
        probs = F.softmax(logits, dim=-1, dtype=torch.float32)
        scores, chosen = torch.topk(probs, self.top_k, dim=-1)  # [tokens, k]
        if self.normalize:
            scores = scores / scores.sum(dim=-1, keepdim=True)
        if not self.float32_scores:
            scores = scores.to(x.dtype)
        out = torch.zeros_like(x)
        by_rank = chosen.t()  # [k, tokens]: tokens in (rank, token) order, as transformers
        for expert in torch.unique(chosen).tolist():
            rank, tokens = torch.where(by_rank == expert)
            gate, up = (x[tokens] @ self.gate_up[expert]).chunk(2, dim=-1)
            hidden = (F.silu(gate) * up) @ self.down[expert]
            weighted = hidden * scores[tokens, rank].unsqueeze(-1)
            out.index_add_(0, tokens, weighted.to(out.dtype))
        return self.collectives.all_reduce(out)  # the ranks' partial sums
