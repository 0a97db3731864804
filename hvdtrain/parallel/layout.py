"""Which rank holds which pipeline stage of which replica.

N = S x D ranks: rank = replica x S + stage, so one replica's S stages sit on consecutive ranks
(horovodrun fills a host's slots first: activations, sent every micro-batch, stay on one host where
they can), and a stage's D replicas, which average gradients once per step, are S ranks apart.
"""

from __future__ import annotations

from dataclasses import dataclass

from hvdtrain.errors import ConfigError


@dataclass(frozen=True)
class Layout:
    stages: int
    replicas: int

    @classmethod
    def of(cls, stages: int, world_size: int) -> Layout:
        """The layout of `stages` stages over `world_size` ranks; ConfigError if they do not divide."""
        if stages < 1 or world_size % stages:
            raise ConfigError(f"parallel.pipeline_stages={stages} does not divide the {world_size} ranks; "
                              f"choose a divisor of {world_size} (ranks = stages x replicas)")
        return cls(stages, world_size // stages)

    def stage(self, rank: int) -> int:
        return rank % self.stages

    def replica(self, rank: int) -> int:
        return rank // self.stages

    def rank(self, stage: int, replica: int) -> int:
        return replica * self.stages + stage

    def stage_ranks(self, stage: int) -> list[int]:
        """The D ranks that hold `stage` (one per replica): they average its gradients."""
        return [self.rank(stage, d) for d in range(self.replicas)]

    def ends(self) -> list[int]:
        """The ranks of the first and the last stage: they share tied parameters (S > 1)."""
        return sorted(set(self.stage_ranks(0)) | set(self.stage_ranks(self.stages - 1)))

    def describe(self) -> str:
        rows = [f"replica {d}: ranks {self.rank(0, d)}-{self.rank(self.stages - 1, d)}" for d in range(self.replicas)]
        return f"{self.stages} stages x {self.replicas} replicas (rank = replica x {self.stages} + stage); " + \
            "; ".join(rows)
