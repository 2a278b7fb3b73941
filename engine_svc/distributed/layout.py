"""A worker's place in the parallel layout (no torch here: the service process that
checks a layout against a model loads none).

Ranks are laid out pipeline stage by pipeline stage: global rank = pp_rank * tp_size +
tp_rank, so the tensor-parallel group of a stage is a run of consecutive ranks (one machine,
when a stage fits one).
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class ParallelLayout:
    tp_size: int = 1
    pp_size: int = 1
    tp_rank: int = 0
    pp_rank: int = 0

    @classmethod
    def of_rank(cls, rank: int, tp_size: int, pp_size: int) -> ParallelLayout:
        return cls(tp_size, pp_size, rank % tp_size, rank // tp_size)

    @property
    def world_size(self) -> int:
        return self.tp_size * self.pp_size

    @property
    def rank(self) -> int:
        return self.pp_rank * self.tp_size + self.tp_rank

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp_size - 1

    @property
    def samples(self) -> bool:
        """The rank that samples and answers the executor: tensor rank 0 of the last stage."""
        return self.is_last_stage and self.tp_rank == 0

    def previous_stage_rank(self) -> int:
        return self.rank - self.tp_size

    def next_stage_rank(self) -> int:
        return self.rank + self.tp_size


def split(total: int, parts: int, index: int) -> tuple[int, int]:
    """[start, end) of part `index` of `total` items in `parts` contiguous parts, the first
    ones one item larger when `total` does not divide."""
    base, extra = divmod(total, parts)
    start = index * base + min(index, extra)
    return start, start + base + (1 if index < extra else 0)
