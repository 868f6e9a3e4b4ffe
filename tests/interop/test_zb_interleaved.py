"""`zb-interleaved` against torch's `ScheduleInterleavedZeroBubble`, through torch's own CSV.

torch generates its schedule (order generation only, on stand-in stages), writes it as a
compute-only CSV; zbpp reads it back and both run in zbpp's simulator under the same costs and
memory. zb-interleaved must be at or under torch's bubble with at most its peak memory on every
rank, for every p, m and stages-per-rank tried (torch needs m to be a multiple of its rounds).
"""

from __future__ import annotations

import csv
import types

import pytest

torch = pytest.importorskip("torch")
from torch.distributed.pipelining import schedules as S  # noqa: E402

from zbpp.schedules import Costs, Memory, build, from_torch_csv, simulate, validate  # noqa: E402

from .torch_orders import compute_only  # noqa: E402

# unit tasks, and uneven ones with a slow link (B costlier than F, W cheaper)
COSTS = [Costs(1, 1, 1), Costs(1.0, 1.5, 0.5, comm=0.1)]
MEMORY = Memory(activation=1, wgrad=1 / 3)
# exact comparisons up to float rounding of sums of the same task times
TOL = 1e-9


def _torch_zb_interleaved(tmp_path, p: int, m: int, chunks: int):
    stages = [types.SimpleNamespace(group_size=p, group_rank=0, num_stages=p * chunks, submod=None, stage_index=i)
              for i in range(chunks)]
    order = compute_only(S.ScheduleInterleavedZeroBubble(stages, m, loss_fn=None).pipeline_order)
    path = tmp_path / "torch.csv"
    with open(path, "w", newline="") as fh:
        csv.writer(fh).writerows([str(a) for a in order[r]] for r in range(p))
    return validate(from_torch_csv(path, placement="loop"))


@pytest.mark.parametrize("chunks", [2, 3])
@pytest.mark.parametrize("p", [2, 4, 8])
@pytest.mark.parametrize("m_per_p", [1, 2, 4])
def test_at_or_under_torch_bubble_and_memory(tmp_path, chunks, p, m_per_p):
    m = m_per_p * p
    theirs = _torch_zb_interleaved(tmp_path, p, m, chunks)
    ours = validate(build("zb-interleaved", num_ranks=p, num_microbatches=m, chunks=chunks))
    assert ours.placement == theirs.placement
    for costs in COSTS:
        a, b = simulate(theirs, costs, MEMORY), simulate(ours, costs, MEMORY)
        assert b.bubble_rate <= a.bubble_rate + TOL, (costs, b.bubble_rate, a.bubble_rate)
        assert b.cost <= a.cost * (1 + TOL)
        for r in range(p):
            assert b.peak_memory[r] <= a.peak_memory[r] + TOL, (costs, r, b.peak_memory, a.peak_memory)


def test_one_chunk_is_zb_h1():
    for p, m in [(2, 3), (4, 8), (5, 7)]:
        ours = build("zb-interleaved", num_ranks=p, num_microbatches=m, chunks=1)
        assert ours.orders == build("zb-h1", num_ranks=p, num_microbatches=m).orders


@pytest.mark.parametrize("p, m, chunks", [(2, 4, 2), (4, 8, 2), (4, 8, 3)])
def test_zbi_auto_at_torch_memory_is_at_or_under_its_bubble(tmp_path, p, m, chunks):
    """The automatic variant, given torch's peak as its limit, stays within it on every rank and is
    never slower; given more memory it removes the bubble that is left (unit costs)."""
    theirs = _torch_zb_interleaved(tmp_path, p, m, chunks)
    for costs in COSTS:
        a = simulate(theirs, costs, MEMORY)
        limit = max(a.peak_memory)
        ours = validate(build("zbi-auto", num_ranks=p, num_microbatches=m, chunks=chunks, costs=costs, memory=MEMORY,
                              memory_limit=limit))
        b = simulate(ours, costs, MEMORY)
        assert max(b.peak_memory) <= limit + TOL
        assert b.cost <= a.cost * (1 + TOL) and b.bubble_rate <= a.bubble_rate + TOL
    unit = COSTS[0]
    roomy = simulate(build("zbi-auto", num_ranks=p, num_microbatches=m, chunks=chunks, costs=unit, memory=MEMORY,
                           memory_limit=4 * limit), unit, MEMORY)
    assert roomy.bubble_rate < simulate(theirs, unit, MEMORY).bubble_rate
