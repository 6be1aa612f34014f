"""DSP's schedule as data: which batch each stage forwards and updates with at each tick, and
where the pipeline drains (the runner walks it; a test can walk the same generators)."""
from __future__ import annotations

from typing import Iterator, List, Optional, Tuple

Tick = Tuple[Optional[int], Optional[int]]


def ticks(stage: int, stages: int, first: int, end: int, locked: bool = False) -> Iterator[Tick]:
    """(batch forwarded, batch updated with) by `stage` at each tick of the segment of batches
    [first, end); None where the stage has no such batch then (filling and draining). Locked:
    each batch forward and backward through every stage before the next one enters (one run
    per batch and stage; the queues order them). Three stages, batches 0-2 (f: forward, b:
    backward with):

        tick     0    1    2    3     4     5     6
        stage 0  f0   f1   f2   .     b0    b1    b2
        stage 1  .    f0   f1   f2,b0 b1    b2    .
        stage 2  .    .    f0b0 f1b1  f2b2  .     .
    """
    if locked:
        yield from ((b, b) for b in range(first, end))
        return
    lag = 2 * (stages - 1 - stage)
    for t in range(end - first + 2 * (stages - 1)):
        forward, backward = first + t - stage, first + t - stage - lag
        yield (forward if first <= forward < end else None, backward if first <= backward < end else None)


def segments(start: int, steps: int, hooks) -> List[Tuple[int, int]]:
    """[first, end) ranges of batches, split after every batch where a hook saves state."""
    bounds = [start] + [b for b in range(start + 1, steps) if any(h.saves_at(b) for h in hooks)] + [steps]
    return [(a, b) for a, b in zip(bounds, bounds[1:]) if b > a]
