"""Random sampling: temperature, top-k, top-p and min-p, then one draw per row from what is
left, by the inverse of its cumulative distribution.

A row samples from vLLM's distribution: logits / temperature; the top_k most likely tokens;
of those, renormalized, the most likely ones until their mass reaches top_p (a token stays
while the mass ranked above it is under top_p, so the most likely always does); of those,
the ones at least min_p times as likely as the most likely. The draw takes one uniform number
u per row and picks the first token whose cumulative weight exceeds u times the total.

An exponential race over the whole vocabulary (argmax of p / Exp(1) noise) and a sort of every
row for top-k and top-p cost more than the model: at 64 rows of SmolLM2's 49,152 tokens on
2 CPU cores, 3.1 M exponential draws took 52 ms a step and the sort 92 ms. Here a row costs a
softmax and a cumulative sum over the vocabulary (about 1 ms each for all 64 rows), or a
top-k and then work on its k candidates; top-p without top-k draws by rejection
(_draw_from_nucleus) and sorts nothing. Rows are grouped by how they draw, so a row's
numbers never depend on the rest of the batch (a seeded request draws the same tokens alone
or in a crowd).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch

# Draws a top-p row without top-k takes before it sorts the tokens it has left.
NUCLEUS_ROUNDS = 4


@dataclasses.dataclass(frozen=True, slots=True)
class RowFilters:
    """One row's sampling parameters, as SamplingParams holds them (top_k 0 or -1: every
    token)."""

    temperature: float
    top_k: int
    top_p: float
    min_p: float


def sample(
    logits: torch.Tensor,
    filters: Sequence[RowFilters],
    uniforms: torch.Tensor,
    kernel: bool = False,
) -> torch.Tensor:
    """The sampled token of each row of `logits` ([rows, vocab]; the math in float32 for
    float32, bfloat16 and float16 logits), each drawn with its own uniform number in [0, 1)
    from `uniforms` ([rows]). With `kernel` (the CPU kernels are loaded), rows without
    top-k on CPU draw in C++ (engine_svc/kernels/csrc/sample_rows.cpp) from the same
    distribution, without the [rows, vocab] intermediates."""
    rows, vocab = logits.shape
    in_kernel = kernel_takes(logits, kernel)
    tokens = torch.empty(rows, dtype=torch.long, device=logits.device)
    groups: dict[int, list[int]] = {}  # candidates a row takes: k, 0 for all, -1 for a nucleus
    for row, f in enumerate(filters):
        k = f.top_k if 0 < f.top_k < vocab else 0
        groups.setdefault(-1 if k == 0 and f.top_p < 1.0 else k, []).append(row)
    for k, members in groups.items():
        if len(members) == rows:  # one group: no copies
            index, part, u, chosen = None, logits, uniforms, list(filters)
        else:
            index = torch.tensor(members, device=logits.device)
            part, u = logits.index_select(0, index), uniforms.index_select(0, index)
            chosen = [filters[row] for row in members]
        if k <= 0 and in_kernel:
            picked = _draw_in_kernel(part, chosen, u)
        elif k > 0:
            # The top k of the logits are those of logits / temperature: only they are divided.
            values, ids = part.topk(k, dim=-1)
            scaled = values / _column(chosen, "temperature", part.device)
            picked = _draw_from_candidates(torch.softmax(scaled, dim=-1), ids, chosen, u)
        else:
            # float32 whatever the logits' dtype (bfloat16 promotes): no rounding of the quotient.
            scaled = part / _column(chosen, "temperature", part.device)
            if k == 0:
                picked = _draw_from_vocabulary(scaled, chosen, u)
            else:
                picked = _draw_from_nucleus(scaled, chosen, u)
        if index is None:
            return picked
        tokens.index_copy_(0, index, picked)
    return tokens


def kernel_takes(logits: torch.Tensor, kernel: bool) -> bool:
    """Whether the CPU kernels' row operators (sample_rows.cpp, race_rows.cpp, logprobs.cpp)
    take `logits`: the kernels loaded, CPU, float32 or bfloat16, contiguous rows."""
    return (
        kernel
        and logits.device.type == "cpu"
        and logits.dtype in (torch.float32, torch.bfloat16)
        and logits.stride(-1) == 1
    )


def filter_columns(
    filters: Sequence[RowFilters], device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Temperature, top_p and min_p of each row, float32 [rows] each, as the kernels take
    them."""
    return (
        row_values(filters, "temperature", device),
        row_values(filters, "top_p", device),
        row_values(filters, "min_p", device),
    )


def row_values(filters: Sequence[RowFilters], field: str, device: torch.device) -> torch.Tensor:
    """One field of each row's filters, float32 [rows]."""
    values = [getattr(f, field) for f in filters]
    return torch.tensor(values, dtype=torch.float32, device=device)


def _column(filters: list[RowFilters], field: str, device: torch.device) -> torch.Tensor:
    return row_values(filters, field, device).unsqueeze(1)


def _draw_in_kernel(
    logits: torch.Tensor, filters: list[RowFilters], u: torch.Tensor
) -> torch.Tensor:
    """Rows without top-k through sample_rows.cpp, which rejects as _draw_from_nucleus does, as
    many rounds."""
    return torch.ops.duoserve.sample_rows(
        logits, *filter_columns(filters, logits.device), u.double().contiguous(), NUCLEUS_ROUNDS
    )


def _draw_from_vocabulary(
    scaled: torch.Tensor, filters: list[RowFilters], u: torch.Tensor
) -> torch.Tensor:
    """Rows with neither top-k nor top-p: the softmax of every token, less min-p's."""
    probs = torch.softmax(scaled, dim=-1)
    if any(f.min_p > 0.0 for f in filters):
        probs = apply_min_p(probs, probs.amax(dim=-1, keepdim=True), filters)
    return inverse_cdf(probs, u)


def _draw_from_nucleus(
    scaled: torch.Tensor, filters: list[RowFilters], u: torch.Tensor
) -> torch.Tensor:
    """Rows with top-p and no top-k, by rejection rather than a sort of the vocabulary. A row
    draws from the tokens more likely than its pivot (at first, all of them) and keeps the
    token if it is in the nucleus (the tokens more likely than it weigh under top_p) and passes
    min-p. Else no token as likely or less can be: the pivot rises to it, and the row draws
    again with the part of its uniform number that fell in the rejected token's interval
    (uniform again, given where it fell). A draw proportional to p over a superset of the
    kept tokens that lands in them is proportional to p over them. At top_p 0.9 a draw lands
    outside at most one time in ten, and each miss drops every token below it; rows still
    missing after NUCLEUS_ROUNDS sort the tokens above their pivot."""
    probs = torch.softmax(scaled, dim=-1)
    rows, device = probs.shape[0], probs.device
    top_p = torch.tensor([f.top_p for f in filters], device=device)
    floor = torch.zeros(rows, device=device)
    if any(f.min_p > 0.0 for f in filters):
        floor = torch.tensor([f.min_p for f in filters], device=device) * probs.amax(dim=-1)
    pivot = torch.zeros(rows, device=device)
    u = u.double()
    picked = torch.empty(rows, dtype=torch.long, device=device)
    pending = torch.arange(rows, device=device)
    for round_ in range(NUCLEUS_ROUNDS):
        part = probs if round_ == 0 else probs.index_select(0, pending)
        weights = part if round_ == 0 else part.masked_fill(part <= pivot[pending, None], 0.0)
        index, u_within, total = _draw_with_remainder(weights, u[pending])
        chosen = part.gather(1, index.unsqueeze(1)).squeeze(1)
        kept = _in_nucleus(part, chosen, total, top_p[pending]) & (chosen >= floor[pending])
        picked[pending[kept]] = index[kept]
        missed = ~kept
        pending = pending[missed]
        if len(pending) == 0:
            return picked
        pivot[pending] = chosen[missed]
        u[pending] = u_within[missed]
    for row in pending.tolist():
        above = (probs[row] > pivot[row]).nonzero().squeeze(1)
        if len(above) == 0:  # NaN probabilities (a broken model's): nothing to draw from
            picked[row] = probs[row].argmax()
            continue
        ranked, order = probs[row, above].sort(descending=True)
        candidates = (ranked.unsqueeze(0), above[order].unsqueeze(0))
        picked[row] = _draw_from_candidates(*candidates, [filters[row]], u[row : row + 1])[0]
    return picked


def _in_nucleus(
    probs: torch.Tensor, chosen: torch.Tensor, total: torch.Tensor, top_p: torch.Tensor
) -> torch.Tensor:
    """Whether the tokens more likely than each row's chosen one weigh under top_p. They weigh
    at most what the draw's tokens weigh less the chosen one: the sum over the vocabulary is
    taken only for the rows where that bound does not settle it."""
    kept = total - chosen < top_p
    unsure = (~kept).nonzero().squeeze(1)
    if len(unsure):
        rows = probs.index_select(0, unsure)
        above = rows.masked_fill(rows <= chosen[unsure, None], 0.0).sum(dim=-1)
        kept[unsure] = above < top_p[unsure]
    return kept


def _draw_with_remainder(
    weights: torch.Tensor, u: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """inverse_cdf's indices; where in its token's interval each u fell, scaled to [0, 1)
    (float64: each rejection spends the bits that chose the token); each row's total weight."""
    cdf = weights.cumsum(dim=-1)
    index = inverse_cdf(weights, u, cdf)
    high = cdf.gather(1, index.unsqueeze(1)).squeeze(1).double()
    low = high - weights.gather(1, index.unsqueeze(1)).squeeze(1).double()
    target = u * cdf[:, -1].double()
    within = ((target - low) / (high - low)).clamp_(0.0, 1.0 - 2.0**-53)
    return index, within, cdf[:, -1]


def _draw_from_candidates(
    probs: torch.Tensor, ids: torch.Tensor, filters: list[RowFilters], u: torch.Tensor
) -> torch.Tensor:
    """probs: [rows, k] in descending order, the candidates' probabilities after top-k; ids:
    their token ids. Top-p and min-p keep a prefix of them; one is drawn."""
    weights = kept_candidates(probs, filters)
    return ids.gather(1, inverse_cdf(weights, u).unsqueeze(1)).squeeze(1)


def kept_candidates(probs: torch.Tensor, filters: Sequence[RowFilters]) -> torch.Tensor:
    """The weights top-p and min-p leave of candidates in descending order (probs: [rows, k]):
    top-p a prefix, each token whose mass ranked above it is under top_p (a row at top_p 1
    keeps every candidate, however its float32 sums round, so its draw does not depend on
    the rows beside it); min-p those at least min_p times the first."""
    weights = probs
    if any(f.top_p < 1.0 for f in filters):
        top_p = row_values(filters, "top_p", probs.device).unsqueeze(1)
        mass_above = probs.cumsum(dim=-1) - probs
        weights = weights.masked_fill((mass_above >= top_p) & (top_p < 1.0), 0.0)
    if any(f.min_p > 0.0 for f in filters):
        weights = apply_min_p(weights, probs[:, :1], filters)
    return weights


def apply_min_p(
    probs: torch.Tensor, most_likely: torch.Tensor, filters: Sequence[RowFilters]
) -> torch.Tensor:
    min_p = torch.tensor([f.min_p for f in filters], device=probs.device).unsqueeze(1)
    return probs.masked_fill(probs < min_p * most_likely, 0.0)


def inverse_cdf(
    weights: torch.Tensor, u: torch.Tensor, cdf: torch.Tensor | None = None
) -> torch.Tensor:
    """Per row of non-negative `weights` ([rows, n], some positive), the first index whose
    cumulative weight exceeds u times the row's total: index i with probability
    weights[i] / total. A zero weight is never picked: its cumulative weight equals the
    previous one. u * total may round up to the total; it is held just below it."""
    if cdf is None:
        cdf = weights.cumsum(dim=-1)
    total = cdf[:, -1:]
    target = torch.minimum(
        u.to(cdf.dtype).unsqueeze(1) * total, torch.nextafter(total, torch.zeros_like(total))
    )
    # A row of NaN (a broken model's) crosses nothing: its last index, not one past it.
    return torch.searchsorted(cdf, target, right=True).squeeze(1).clamp_(max=cdf.shape[-1] - 1)
