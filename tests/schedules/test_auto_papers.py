"""zb-auto and zbv-auto against the zero-bubble paper's published bubble rates and against the
paper authors' own heuristic, on the paper's profiles and on random ones.

References (all in data/authors_heuristic.json, whose "about" says how each number was obtained):

- `paper_bubble_rate`: the zero-bubble paper's (Qi et al., ICLR 2024) Table 4 ZB-1p / ZB-2p bubble
  rates for its Table 9 profiles (p = 8, 16, 32; m = 3p, 4p, 8p; 1x and 2x 1F1B's activation
  memory), and the ZB-V bubble rates of the arXiv version's profiles (p = 16, 24, 32) as the
  authors' paper script computes them;
- `authors`: the authors' published heuristics (their repository's round heuristic and V
  heuristic), run standalone on each row's costs and memory model and simulated with zbpp's
  simulator; besides the paper's profiles, the same profiles at p = 4 and 8 and 60 random
  profiles (fixed seed 2024).

Memory is the paper's model: F allocates M_B = 34h + 5as per stage and microbatch, B keeps
M_W = 32h until W. The bubble rate is DESIGN's (cost - busy) / cost, the paper's definition.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

import pytest

from zbpp.schedules import Costs, Memory, SimResult, build, simulate

ROWS = json.loads((Path(__file__).parent / "data" / "authors_heuristic.json").read_text())["rows"]
REL = 1e-9  # the same float operations in another order: rounding only
#: The paper prints four decimals (ZB-1p / ZB-2p): half a unit of the last one. The paper
#: script's ZB-V rates are kept to six.
PAPER_ROUNDING = {"zb-auto": 5e-5, "zbv-auto": 5e-7}


def _key(row: dict) -> str:
    limit = row["memory_limit"] / (row["activation"] * row["p"] * (2 if row["schedule"] == "zbv-auto" else 1))
    return f"{row['schedule']} {row['group']} p={row['p']} m={row['m']} mem={limit:g}x f={row['f']} w={row['w']}"


@functools.lru_cache(maxsize=None)
def _ours(index: int) -> SimResult:
    row = ROWS[index]
    costs = Costs(row["f"], row["b"], row["w"], row["comm"])
    memory = Memory(row["activation"], row["wgrad"])
    sched = build(row["schedule"], num_ranks=row["p"], num_microbatches=row["m"], costs=costs, memory=memory,
                  memory_limit=row["memory_limit"])
    res = simulate(sched, costs, memory)
    assert max(res.peak_memory) <= row["memory_limit"] * (1 + REL)  # the limit holds in simulation
    return res


PAPER = [i for i, r in enumerate(ROWS) if "paper_bubble_rate" in r]
ALL = list(range(len(ROWS)))


def test_the_table_covers_what_the_issue_asks() -> None:
    """p in {4, 8, 16, 32}, m in {3p, 4p, 8p}, both memory budgets for zb-auto; random profiles."""
    seen = {(r["schedule"], r["p"], r["m"] // r["p"]) for r in ROWS}
    for p in (4, 8, 16, 32):
        for k in (3, 4, 8):
            assert ("zb-auto", p, k) in seen and ("zbv-auto", p, k) in seen, (p, k)
    assert sum(r["group"] == "random" for r in ROWS) == 60
    assert len(PAPER) == 24 + 9


@pytest.mark.parametrize("index", PAPER, ids=[_key(ROWS[i]) for i in PAPER])
def test_at_or_under_the_papers_bubble_rate(index: int) -> None:
    row = ROWS[index]
    assert _ours(index).bubble_rate <= row["paper_bubble_rate"] + PAPER_ROUNDING[row["schedule"]]


@pytest.mark.parametrize("index", ALL, ids=[_key(ROWS[i]) for i in ALL])
def test_never_worse_than_the_authors_heuristic(index: int) -> None:
    theirs = ROWS[index]["authors"]
    assert _ours(index).cost <= theirs["cost"] * (1 + REL)


def test_better_than_the_authors_somewhere() -> None:
    """Not only a copy: on the V profiles and on random ones the search finds shorter schedules."""
    better = [i for i in ALL if _ours(i).cost < ROWS[i]["authors"]["cost"] * (1 - 1e-6)]
    assert len(better) >= 15
    assert any(ROWS[i]["schedule"] == "zbv-auto" and ROWS[i]["group"] == "paper" for i in better)
