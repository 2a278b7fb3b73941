"""Which share of each weight a rank holds, for tensor and pipeline parallelism.

Tensor parallelism splits attention by heads and the MLP by its intermediate columns (each
expert of a mixture likewise, the router whole on every rank):
q/k/v and gate/up are column-parallel (each rank computes its heads or columns), o and down
are row-parallel (each rank's partial sums, added by one all-reduce per block). K/V heads
are split too, or replicated when there are fewer of them than ranks (each rank then keeps
the one its query heads read). The embedding and the LM head are split by vocabulary rows,
padded to equal shares so that the logits gather in one call. Pipeline parallelism gives each
stage a contiguous run of layers; the first holds the embedding, the last the final norm and
the LM head.

A rank reads only its share of each tensor from the checkpoint (`slices`): no rank holds the
whole model.
"""

from __future__ import annotations

import dataclasses
import re

from engine_svc.distributed.layout import ParallelLayout, split
from engine_svc.models.model_spec import ModelSpec
from shared.errors import InvalidRequestError

# (start, end) rows of dimension `dim` of a checkpoint tensor; several pieces are concatenated.
Piece = tuple[int, int]
_LAYER = re.compile(r"^model\.layers\.(\d+)\.")
_EXPERT = re.compile(r"\.experts\.\d+\.(\w+)\.weight$")
_EXPERT_ROW_PARALLEL = ("w2", "down_proj")  # Mixtral's and the others' down projection


@dataclasses.dataclass(frozen=True)
class RankShards:
    layout: ParallelLayout
    num_heads: int  # query heads on this rank
    num_kv_heads: int
    q_rows: Piece  # of the [num_heads * head_dim] query rows
    kv_rows: Piece
    mlp_rows: Piece  # of the intermediate columns
    moe_rows: Piece  # of each expert's intermediate columns
    vocab_rows: Piece  # this rank's real vocabulary rows
    vocab_per_rank: int  # its padded share: every rank's logits have this width
    layers: Piece  # this stage's layers

    @classmethod
    def of(cls, spec: ModelSpec, layout: ParallelLayout) -> RankShards:
        check_divisible(spec, layout)
        tp, rank = layout.tp_size, layout.tp_rank
        head_dim = spec.head_dim
        num_heads = spec.num_heads // tp
        if spec.num_kv_heads >= tp:
            num_kv = spec.num_kv_heads // tp
            kv_head = rank * num_kv
        else:  # replicated: the K/V head this rank's query heads belong to
            num_kv = 1
            kv_head = rank * spec.num_kv_heads // tp
        mlp = spec.intermediate_size // tp
        moe = spec.moe_intermediate_size // tp
        per_rank = -(-spec.vocab_size // tp)
        vocab_start = min(rank * per_rank, spec.vocab_size)
        return cls(
            layout=layout,
            num_heads=num_heads,
            num_kv_heads=num_kv,
            q_rows=(rank * num_heads * head_dim, (rank + 1) * num_heads * head_dim),
            kv_rows=(kv_head * head_dim, (kv_head + num_kv) * head_dim),
            mlp_rows=(rank * mlp, (rank + 1) * mlp),
            moe_rows=(rank * moe, (rank + 1) * moe),
            vocab_rows=(vocab_start, min(vocab_start + per_rank, spec.vocab_size)),
            vocab_per_rank=per_rank,
            layers=split(spec.num_layers, layout.pp_size, layout.pp_rank),
        )

    def has_layer(self, index: int) -> bool:
        return self.layers[0] <= index < self.layers[1]

    def holds(self, name: str) -> bool:
        """Whether this rank has the checkpoint tensor `name` (or a share of it)."""
        match = _LAYER.match(name)
        if match is not None:
            return self.has_layer(int(match.group(1)))
        return True

    def slices(self, name: str, spec: ModelSpec) -> tuple[int, list[Piece]] | None:
        """The dimension and the row pieces of checkpoint tensor `name` this rank reads, or
        None for the whole tensor."""
        if self.layout.tp_size == 1:
            return None
        expert = _EXPERT.search(name)
        if expert is not None:
            return (1 if expert.group(1) in _EXPERT_ROW_PARALLEL else 0), [self.moe_rows]
        q, kv, mlp = self.q_rows, self.kv_rows, self.mlp_rows
        q_size = spec.num_heads * spec.head_dim
        kv_size = spec.num_kv_heads * spec.head_dim
        size = spec.intermediate_size
        for suffix, dim, pieces in (
            ("self_attn.q_proj", 0, [q]),
            ("self_attn.k_proj", 0, [kv]),
            ("self_attn.v_proj", 0, [kv]),
            ("self_attn.qkv_proj", 0, [q, _shift(kv, q_size), _shift(kv, q_size + kv_size)]),
            ("self_attn.o_proj", 1, [q]),
            ("mlp.gate_proj", 0, [mlp]),
            ("mlp.up_proj", 0, [mlp]),
            ("mlp.gate_up_proj", 0, [mlp, _shift(mlp, size)]),
            ("mlp.down_proj", 1, [mlp]),
        ):
            if f".{suffix}." in name:
                if dim == 1 and name.endswith(".bias"):
                    return None  # a row-parallel bias is whole (added after the sum)
                return dim, pieces
        if name in ("model.embed_tokens.weight", "lm_head.weight"):
            return 0, [self.vocab_rows]
        return None


def check_divisible(spec: ModelSpec, layout: ParallelLayout) -> None:
    """Whether the model splits into this layout's shares (InvalidRequestError if not)."""
    tp, pp = layout.tp_size, layout.pp_size
    problems = []
    if spec.num_heads % tp:
        problems.append(f"{spec.num_heads} attention heads")
    if spec.num_kv_heads % tp and tp % spec.num_kv_heads:
        problems.append(f"{spec.num_kv_heads} key/value heads")
    if spec.intermediate_size % tp:
        problems.append(f"an MLP of {spec.intermediate_size}")
    if spec.num_experts and spec.moe_intermediate_size % tp:
        problems.append(f"experts of {spec.moe_intermediate_size}")
    if problems:
        raise InvalidRequestError(
            "tensor_parallel_size", f"{tp} does not divide the model's {' and '.join(problems)}"
        )
    if tp > 1 and spec.qk_norm_whole:
        raise InvalidRequestError(
            "tensor_parallel_size",
            f"{spec.architecture} normalises q and k across all heads, which this engine "
            "does not split over ranks yet: run it with tensor_parallel_size 1",
        )
    if pp > spec.num_layers:
        raise InvalidRequestError(
            "pipeline_parallel_size", f"{pp} exceeds the model's {spec.num_layers} layers"
        )


def _shift(piece: Piece, offset: int) -> Piece:
    return piece[0] + offset, piece[1] + offset
