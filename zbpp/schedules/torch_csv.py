"""Interop with torch.distributed.pipelining's ``compute_only`` CSV schedules.

torch writes one CSV row per rank; each cell is one action ``{stage}{type}{microbatch}`` such as
``0F1``. Its types map onto zbpp's kinds as follows (torch calls the full backward ``B``):

==============  ==========================  =====
zbpp            meaning                     torch
==============  ==========================  =====
``F``           forward                     ``F``
``B``           input gradient (dgrad)      ``I``
``W``           weight gradient (wgrad)     ``W``
``BW``          full backward               ``B``
==============  ==========================  =====

A compound cell ``(0F3;7B1)OVERLAP_F_B`` is two tasks that a runtime may overlap (DualPipeV); it
becomes two adjacent tasks and one `Schedule.overlap_pairs` entry, and is written back the same
way. The files load with torch's ``_PipelineScheduleRuntime._load_csv`` and torchtitan's
``pipeline_parallel_schedule_csv``. Pure Python: this module never imports torch.

>>> import os, tempfile
>>> from zbpp.schedules import build, to_torch_csv, from_torch_csv
>>> path = os.path.join(tempfile.mkdtemp(), "zbh1.csv")
>>> to_torch_csv(build("zb-h1", num_ranks=2, num_microbatches=2), path)
>>> open(path).readline().strip()
'0F0,0F1,0I0,0W0,0I1,0W1'
>>> [str(a) for a in from_torch_csv(path).orders[0]]
['F0.0', 'F0.1', 'B0.0', 'W0.0', 'B0.1', 'W0.1']
"""

from __future__ import annotations

import csv
import os
import re
from typing import Sequence, Union

from .checks import as_int
from .ir import Action, Kind, Schedule, ScheduleError, loop_placement

__all__ = ["to_torch_csv", "from_torch_csv"]

_TO_TORCH = {Kind.F: "F", Kind.B: "I", Kind.W: "W", Kind.BW: "B"}
_FROM_TORCH = {v: k for k, v in _TO_TORCH.items()}
_COMPUTE_RE = re.compile(r"^(\d+)(F|I|W|B)(\d+)$")
# Actions torch's lowering passes add (FSDP, grad reduction, p2p). zbpp derives its own
# communication from the DAG, so a compute_comms file is read by dropping these.
_NON_COMPUTE_RE = re.compile(r"^(\d+)(UNSHARD|RESHARD|REDUCE_GRAD|SEND_F|RECV_F|SEND_B|RECV_B)(\d*)$")
_COMPOUND_RE = re.compile(r"^\((.*)\)(\w+)$")

Placement = Union[str, Sequence[int], None]


def _torch_str(action: Action) -> str:
    return f"{action.stage}{_TO_TORCH[action.kind]}{action.microbatch}"


def to_torch_csv(schedule: Schedule, path: str | os.PathLike[str], *, overlap: bool = True) -> None:
    """Write `schedule` as torch's ``compute_only`` CSV: one row per rank, in rank order.

    With `overlap`, each `overlap_pairs` entry whose two tasks are adjacent on their rank is
    written as one ``(a;b)OVERLAP_F_B`` cell, as torch's DualPipeV does; otherwise as two cells.
    torch names B ``I`` (the input gradient):

    >>> import os, tempfile
    >>> from zbpp.schedules import build
    >>> with tempfile.TemporaryDirectory() as d:
    ...     to_torch_csv(build("zb-h1", num_ranks=2, num_microbatches=2), os.path.join(d, "zbh1.csv"))
    ...     print(open(os.path.join(d, "zbh1.csv")).read(), end="")
    0F0,0F1,0I0,0W0,0I1,0W1
    1F0,1I0,1F1,1I1,1W0,1W1
    """
    pairs = {(a, b) for a, b in schedule.overlap_pairs} if overlap else set()
    with open(path, "w", newline="") as fh:
        writer = csv.writer(fh)
        for order in schedule.orders:
            cells: list[str] = []
            i = 0
            while i < len(order):
                if i + 1 < len(order) and (order[i], order[i + 1]) in pairs:
                    cells.append(f"({_torch_str(order[i])};{_torch_str(order[i + 1])})OVERLAP_F_B")
                    i += 2
                else:
                    cells.append(_torch_str(order[i]))
                    i += 1
            writer.writerow(cells)


def _parse_compute(text: str, where: str) -> Action:
    match = _COMPUTE_RE.match(text.strip())
    if match is None:
        raise ScheduleError(
            f"{where}: cannot read action {text!r}: expected torch's '{{stage}}{{F|I|W|B}}{{microbatch}}', e.g. '0F1'"
        )
    stage, kind, mb = match.groups()
    return Action(_FROM_TORCH[kind], int(stage), int(mb))


def _parse_cell(text: str, where: str) -> list[Action]:
    """The tasks of one CSV cell: none (empty / non-compute), one, or an overlapped group."""
    text = text.strip()
    if not text or _NON_COMPUTE_RE.match(text):
        return []
    compound = _COMPOUND_RE.match(text)
    if compound is not None:
        inner, ctype = compound.groups()
        if ctype != "OVERLAP_F_B":
            raise ScheduleError(f"{where}: unknown compound action type {ctype!r} in {text!r} (only OVERLAP_F_B)")
        return [_parse_compute(part, where) for part in inner.split(";") if part.strip()]
    return [_parse_compute(text, where)]


def _resolve_placement(placement: Placement, inferred: dict[int, int], num_ranks: int, num_stages: int) -> tuple[int, ...]:
    if placement is None:
        missing = [s for s in range(num_stages) if s not in inferred]
        if missing:
            raise ScheduleError(
                f"stage(s) {missing} have no task in the CSV, so their rank is unknown; pass placement='loop', 'v' or a list"
            )
        return tuple(inferred[s] for s in range(num_stages))
    if placement == "loop":
        if num_stages % num_ranks:
            raise ValueError(f"placement='loop' needs stages ({num_stages}) to be a multiple of ranks ({num_ranks})")
        return loop_placement(num_ranks, num_stages // num_ranks)
    if placement == "v":
        # torch's "v" style: down the ranks, back up, down again ... (two stages per rank is ZB-V's)
        if num_stages % num_ranks:
            raise ValueError(f"placement='v' needs stages ({num_stages}) to be a multiple of ranks ({num_ranks})")
        out = []
        for s in range(num_stages):
            lap, i = divmod(s, num_ranks)
            out.append(i if lap % 2 == 0 else num_ranks - 1 - i)
        return tuple(out)
    if isinstance(placement, str):
        raise ValueError(f"placement must be 'loop', 'v', a list of ranks (one per stage) or None, got {placement!r}")
    # as_int, not int(): int() truncated 0.9 to rank 0 and read "1" or True as rank 1, unsaid
    placed = tuple(as_int(r, f"from_torch_csv: placement[{s}]", minimum=0) for s, r in enumerate(placement))
    if len(placed) != num_stages:
        raise ValueError(f"placement has {len(placed)} entries but the CSV has {num_stages} stages")
    return placed


def from_torch_csv(
    path: str | os.PathLike[str],
    *,
    num_microbatches: int | None = None,
    placement: Placement = None,
    name: str = "torch-csv",
) -> Schedule:
    """Read a torch ``compute_only`` CSV (row r = rank r) into a `Schedule`.

    Empty cells (torch's idle steps) and lowering actions (SEND/RECV, UNSHARD/RESHARD,
    REDUCE_GRAD) are dropped; ``(a;b)OVERLAP_F_B`` cells become two adjacent tasks and an
    `overlap_pairs` entry. A blank row is a rank without tasks, as torch writes and reads one;
    blank rows at the end count only up to the last rank holding a stage, unless `placement` is
    ``"loop"`` or ``"v"`` (which take the rank count from the rows). `num_microbatches` defaults
    to the largest microbatch index + 1; `placement` (stage -> rank) defaults to where each
    stage's tasks are, or is ``"loop"``, ``"v"`` or an explicit list. Call `validate` on the
    result to check it is complete and deadlock-free.

    >>> import os, tempfile
    >>> from zbpp.schedules import build, validate
    >>> zbv = build("zb-v", num_ranks=2, num_microbatches=4)
    >>> with tempfile.TemporaryDirectory() as d:
    ...     to_torch_csv(zbv, os.path.join(d, "zbv.csv"))
    ...     back = from_torch_csv(os.path.join(d, "zbv.csv"), placement="v")
    >>> validate(back).placement, back.orders == zbv.orders  # validate returns the schedule
    ((0, 1, 1, 0), True)
    """
    try:
        with open(path, newline="", encoding="utf-8") as fh:
            reader = csv.reader(fh)
            rows = [(row, reader.line_num) for row in reader]  # the line a row ends on, for errors
    except UnicodeDecodeError as exc:  # e.g. a spreadsheet's UTF-16 "Unicode text": say which file
        raise ScheduleError(f"{os.fspath(path)}: not UTF-8 text ({exc}); save it as UTF-8 CSV") from None
    orders: list[list[Action]] = []
    overlaps: list[tuple[Action, Action]] = []
    inferred: dict[int, int] = {}
    for rank, (row, line) in enumerate(rows):
        order: list[Action] = []
        for col, cell in enumerate(row):
            where = f"{os.fspath(path)}: line {line} (rank {rank}), column {col}"
            tasks = _parse_cell(cell, where)
            for a in tasks:
                seen = inferred.setdefault(a.stage, rank)
                if seen != rank and placement is None:
                    raise ScheduleError(f"{where}: task {a} of stage {a.stage} is on rank {rank} but also on rank {seen}")
            if len(tasks) == 2:
                overlaps.append((tasks[0], tasks[1]))
            elif len(tasks) > 2:
                raise ScheduleError(f"{where}: an OVERLAP_F_B cell holds {len(tasks)} tasks; zbpp pairs two")
            order += tasks
        orders.append(order)
    if not orders or not any(orders):
        raise ScheduleError(f"{os.fspath(path)}: no compute actions found")
    num_stages = 1 + max(a.stage for o in orders for a in o)
    m = 1 + max(a.microbatch for o in orders for a in o)
    if num_microbatches is not None:
        num_microbatches = as_int(num_microbatches, "from_torch_csv: num_microbatches")
        if num_microbatches < m:
            raise ScheduleError(f"{os.fspath(path)}: has microbatch {m - 1} but num_microbatches={num_microbatches}")
        m = num_microbatches
    placed = _resolve_placement(placement, inferred, len(orders), num_stages)
    if not isinstance(placement, str):
        # torch writes a rank without actions as a blank row and reads each blank row as a rank; a
        # blank last row is also what a stray newline looks like. Without a placement that needs
        # the row count ("loop", "v"), trailing blank rows count only up to the last rank holding
        # a stage: a stray newline adds no rank that holds nothing.
        last = max([r for r, o in enumerate(orders) if o] + list(placed))
        if last < len(orders):  # (a rank placed beyond the rows is refused by Schedule, naming it)
            orders = orders[:last + 1]
    return Schedule(
        num_ranks=len(orders),
        num_stages=num_stages,
        num_microbatches=m,
        placement=placed,
        orders=tuple(tuple(o) for o in orders),
        name=name,
        overlap_pairs=tuple(overlaps),
    )
