"""A pipeline step's length: the schedule's own action lists, simulated.

Every schedule the engine runs is data (`lists.build_schedule`: each rank's forwards,
backwards, weight-gradient passes and messages, in order), and the schedule simulator
(`parallel/pipeline/simulate.py`) plays such lists with given action costs and buffered
messages. So one function prices every
schedule, a new one included as soon as `build_schedule` knows it: no bubble formula per
schedule, and stages that cost different amounts (the first holds the embedding, the last
the head and the loss) are priced as they are, not as the average. The theory, (p−1)/m for
AFAB and 1F1B, (p−1)/(v·m) interleaved, (p−1)(F+B−W)/(m(F+B+W)) zero bubble, is what the
simulation gives for equal stages (tests/test_plan_time.py).

`costs[c]` holds chunk c's seconds for one micro-batch: F (forward), B (backward; under the
split schedules, zb, zbv and dualpipev, the input gradients only: a B the list does not
split, as most of DualPipeV's, costs B + W) and W (the weight gradients), each with the
messages its rank sends after it. As the executor runs them, a split backward whose input
gradient nobody reads before its W (the first chunk's, a V's turn: `lists.deferred`)
costs nothing at B and B + W at W.

Past a warm-up the lists repeat with a period of pp micro-batches, and once the ranks have
settled into it the step grows by the same amount for each further period: for many
micro-batches three short simulations (m₀, m₀ + pp, m₀ + 2·pp, m₀ ≡ m mod pp) extrapolate
exactly to m when their two increments agree (otherwise the whole step is simulated),
which keeps `--search` fast. The tests check the extrapolation against the full simulation.
"""

from __future__ import annotations

import functools

from ndtrain.parallel.pipeline.lists import build_schedule, deferred
from ndtrain.parallel.pipeline.partition import local_chunks
from ndtrain.parallel.pipeline.schedules import vshape
from ndtrain.parallel.pipeline.simulate import schedule_time

Costs = tuple[tuple[float, float, float], ...]  # per chunk: (F, B, W) seconds


def _simulated(name: str, pp: int, v: int, m: int, costs: Costs) -> float:
    f, b, w = ([c[k] for c in costs] for k in range(3))
    return schedule_time(name, pp, v, m, f, b, w, defer=True)[0]


@functools.lru_cache(maxsize=8192)
def makespan(name: str, pp: int, v: int, m: int, costs: Costs) -> float:
    """Seconds from the first forward to the last action of the step (compute and the
    messages charged to it), for schedule `name` over pp ranks, v chunks each, m micro-batches."""
    base = 2 * pp * v + pp  # past the warm-up and cool-down of every schedule here
    if m <= base + 3 * pp:
        return _simulated(name, pp, v, m, costs)
    m0 = base + (m - base) % pp
    t0, t1, t2 = (_simulated(name, pp, v, m0 + k * pp, costs) for k in range(3))
    if abs((t2 - t1) - (t1 - t0)) > 1e-9 * t2:  # not settled yet: no shortcut
        return _simulated(name, pp, v, m, costs)
    return t0 + (t1 - t0) * (m - m0) / pp


def bubble_fraction(name: str, pp: int, v: int, m: int, costs: Costs) -> tuple[float, float]:
    """(the step's length, its idle time over the busiest rank's busy time)."""
    busy = max(sum(sum(costs[c]) for c in local_chunks(r, pp, v, vshape(name))) for r in range(pp)) * m
    span = makespan(name, pp, v, m, costs)
    return span, (span - busy) / busy if busy > 0 else 0.0


@functools.lru_cache(maxsize=1024)
def deferred_backwards(name: str, pp: int, v: int, m: int, rank: int) -> frozenset:
    """(chunk, micro) of the split backwards rank `rank` defers (`lists.deferred`): B does
    nothing, W the whole backward. The memory replay (plan/memory.py) runs them so."""
    return frozenset(deferred(build_schedule(name, pp, v, m)[rank]))
