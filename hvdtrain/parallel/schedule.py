"""The order in which one stage runs its micro-batches' forward (F) and backward (B) passes.

Both schedules end every stage with the backward of the last micro-batch, in the order 0..m-1, so
the gradient reducer, armed for the last backward, launches its buckets at the same point on every
replica of a stage.
"""

from __future__ import annotations

SCHEDULES = ("1f1b", "gpipe")


def actions(kind: str, stage: int, stages: int, micro_batches: int) -> list[tuple[str, int]]:
    """("F", j) and ("B", j) in run order for `stage` of `stages`, over `micro_batches` micro-batches.

    gpipe: all forwards, then all backwards: every micro-batch's activations are alive at once.
    1f1b: stage s runs S-1-s forwards ahead, then alternates one forward and one backward, so at
    most S-s micro-batches' activations are alive on it. Both have the same bubble, (S-1)/(m+S-1)
    of a step, with a blocking receive before each pass that needs one and sends that never block.
    """
    m = micro_batches
    if kind == "gpipe":
        return [("F", j) for j in range(m)] + [("B", j) for j in range(m)]
    if kind != "1f1b":
        raise ValueError(f"schedule {kind!r}; choose one of {SCHEDULES}")
    warm = min(stages - stage - 1, m)
    out = [("F", j) for j in range(warm)]
    for i in range(m - warm):
        out += [("F", warm + i), ("B", i)]
    return out + [("B", j) for j in range(m - warm, m)]


def peak_in_flight(order: list[tuple[str, int]]) -> int:
    """The most micro-batches whose forward has run and backward has not, at any point of `order`."""
    alive = peak = 0
    for kind, _ in order:
        alive += 1 if kind == "F" else -1
        peak = max(peak, alive)
    return peak
