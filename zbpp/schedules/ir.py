"""The schedule IR: tasks (`Action`) and per-rank task orders (`Schedule`).

Pure Python; never imports torch.

>>> from zbpp.schedules.ir import Action, Kind
>>> a = Action(Kind.B, stage=2, microbatch=5)
>>> str(a)
'B2.5'
>>> Action.parse("B2.5") == a
True
"""

from __future__ import annotations

import enum
import json
import re
from dataclasses import dataclass, field
from typing import Iterable, Iterator, Sequence

from .checks import as_int

__all__ = ["Kind", "Action", "Schedule", "ScheduleError"]


class ScheduleError(ValueError):
    """A schedule is malformed or deadlocks. The message names the offending tasks."""


class Kind(str, enum.Enum):
    """What a task computes for one (stage, microbatch)."""

    F = "F"  #: forward
    B = "B"  #: backward for the input only (dgrad)
    W = "W"  #: backward for the weights only (wgrad)
    BW = "BW"  #: full backward (B and W at once)

    def __str__(self) -> str:
        return self.value


_ACTION_RE = re.compile(r"^(BW|F|B|W)(\d+)\.(\d+)$")


@dataclass(frozen=True, order=True)
class Action:
    """One task: `kind` of `stage` for `microbatch`. Its string form is ``"{kind}{stage}.{mb}"``."""

    kind: Kind
    stage: int
    microbatch: int

    def __post_init__(self) -> None:
        if not isinstance(self.kind, Kind):
            try:
                object.__setattr__(self, "kind", Kind(self.kind))
            except ValueError:
                raise ValueError(f"Action.kind must be one of F, B, W, BW, got {self.kind!r}") from None
        # exact type test first: this runs once per task, and almost every task has Python ints
        if type(self.stage) is not int or type(self.microbatch) is not int:
            object.__setattr__(self, "stage", as_int(self.stage, "Action.stage", minimum=0))
            object.__setattr__(self, "microbatch", as_int(self.microbatch, "Action.microbatch", minimum=0))

    def __str__(self) -> str:
        return f"{self.kind.value}{self.stage}.{self.microbatch}"

    def __repr__(self) -> str:
        return f"Action({self})"

    @classmethod
    def parse(cls, text: str) -> "Action":
        """Inverse of `str(action)`, e.g. ``Action.parse("F0.3")``."""
        match = _ACTION_RE.match(text.strip())
        if match is None:
            raise ValueError(f"cannot parse action {text!r}: expected e.g. 'F0.3', 'B1.0', 'W2.7' or 'BW0.1'")
        kind, stage, mb = match.groups()
        return cls(Kind(kind), int(stage), int(mb))


@dataclass(frozen=True)
class Schedule:
    """Which rank runs which task, in which order.

    Attributes:
        num_ranks: pipeline ranks.
        num_stages: model chunks; stage ``s`` lives on rank ``placement[s]``.
        num_microbatches: microbatches per step.
        placement: stage -> rank.
        orders: for each rank, the tasks it runs, in order.
        name: the generator that made it (informational; "" for none). The text form writes a name
            that would not read back as itself (``custom``, its word for none; one holding a line
            break or edge spaces) as a JSON string.
        overlap_pairs: pairs of tasks, adjacent on one rank, that a runtime may run concurrently
            (DualPipe's overlapped forward/backward). Running them one after the other is correct.

    >>> from zbpp.schedules import build
    >>> s = build("1f1b", num_ranks=2, num_microbatches=2)
    >>> [str(a) for a in s.orders[1]]
    ['F1.0', 'BW1.0', 'F1.1', 'BW1.1']
    """

    num_ranks: int
    num_stages: int
    num_microbatches: int
    placement: tuple[int, ...]
    orders: tuple[tuple[Action, ...], ...]
    name: str = ""
    overlap_pairs: tuple[tuple[Action, Action], ...] = field(default=())

    def __post_init__(self) -> None:
        for name in ("num_ranks", "num_stages", "num_microbatches"):
            object.__setattr__(self, name, as_int(getattr(self, name), f"Schedule.{name}"))
        object.__setattr__(self, "placement", tuple(
            as_int(r, f"Schedule.placement[{s}]", minimum=0) for s, r in enumerate(self.placement)))
        object.__setattr__(self, "orders", tuple(tuple(o) for o in self.orders))
        object.__setattr__(self, "overlap_pairs", tuple(tuple(p) for p in self.overlap_pairs))
        if not isinstance(self.name, str):  # the text form and every message print it
            raise ScheduleError(f"Schedule.name must be a string, got {type(self.name).__name__} {self.name!r}")
        if len(self.placement) != self.num_stages:
            raise ScheduleError(f"placement has {len(self.placement)} entries for {self.num_stages} stages")
        if len(self.orders) != self.num_ranks:
            raise ScheduleError(f"orders has {len(self.orders)} rank lists for {self.num_ranks} ranks")
        for s, r in enumerate(self.placement):
            if not 0 <= r < self.num_ranks:
                raise ScheduleError(f"stage {s} is placed on rank {r}, outside 0..{self.num_ranks - 1}")

    # -- queries ------------------------------------------------------------------------------
    def stages_on(self, rank: int) -> list[int]:
        """The stages `rank` holds, in ascending stage order."""
        if not 0 <= rank < self.num_ranks:
            raise ValueError(f"rank {rank} outside 0..{self.num_ranks - 1}")
        return [s for s, r in enumerate(self.placement) if r == rank]

    def rank_of(self, stage: int) -> int:
        return self.placement[stage]

    def actions(self) -> Iterator[tuple[int, Action]]:
        """Every (rank, action), rank by rank."""
        for rank, order in enumerate(self.orders):
            for action in order:
                yield rank, action

    @property
    def num_tasks(self) -> int:
        return sum(len(o) for o in self.orders)

    # -- text form ----------------------------------------------------------------------------
    def to_text(self) -> str:
        """A plain-text form, one line per rank, that `Schedule.from_text` reads back."""
        lines = [
            f"# zbpp schedule {_name_text(self.name)}",
            f"ranks={self.num_ranks} stages={self.num_stages} microbatches={self.num_microbatches}",
            "placement=" + ",".join(map(str, self.placement)),
        ]
        for rank, order in enumerate(self.orders):
            lines.append(f"rank{rank}: " + " ".join(map(str, order)))
        for a, b in self.overlap_pairs:
            lines.append(f"overlap: {a} {b}")
        return "\n".join(lines) + "\n"

    @classmethod
    def from_text(cls, text: str) -> "Schedule":
        """Read the form written by `to_text`."""
        name = ""
        header: dict[str, int] = {}
        placement: list[int] = []
        orders: dict[int, list[Action]] = {}
        overlaps: list[tuple[Action, Action]] = []
        placement_at = ""
        orders_at: dict[int, int] = {}  # rank -> the line of its order
        for lineno, raw in enumerate(text.splitlines(), 1):
            line = raw.strip()
            if not line:
                continue
            if line.startswith("# zbpp schedule"):
                try:
                    name = _name_from_text(line[len("# zbpp schedule"):].strip())
                except ValueError as exc:
                    raise ScheduleError(f"line {lineno}: {raw!r}: {exc}") from None
                continue
            if line.startswith("#"):
                continue
            try:
                # a line given twice would silently replace the first: refused, naming where that was
                if line.split("=", 1)[0] in _HEADER_KEYS:  # the header, in any order
                    if header:
                        raise ValueError(f"a second header line (the first: {header_at})")
                    header = _parse_header(line)
                    header_at = f"line {lineno}: {raw!r}"
                elif line.startswith("placement="):
                    if placement_at:
                        raise ValueError(f"a second placement line (the first: {placement_at})")
                    placement = [int(x) for x in line.split("=", 1)[1].split(",")]
                    placement_at = f"line {lineno}"
                elif line.startswith("overlap:"):
                    a, b = line.split(":", 1)[1].split()
                    overlaps.append((Action.parse(a), Action.parse(b)))
                elif line.startswith("rank"):
                    head, _, body = line.partition(":")
                    rank = int(head[4:])
                    if rank in orders:
                        raise ValueError(f"a second line for rank {rank} (the first: line {orders_at[rank]})")
                    orders[rank], orders_at[rank] = [Action.parse(t) for t in body.split()], lineno
                else:
                    raise ValueError("unknown line")
            except ValueError as exc:
                raise ScheduleError(f"line {lineno}: {raw!r}: {exc}") from None
        if not header:
            raise ScheduleError("missing 'ranks=... stages=... microbatches=...' line")
        # a header line without one of the three would otherwise end in a bare KeyError
        missing = [k for k in ("ranks", "stages", "microbatches") if k not in header]
        if missing:
            raise ScheduleError(f"{header_at}: lacks {', '.join(k + '=' for k in missing)}; the header line is "
                                "'ranks=P stages=S microbatches=M'")
        p = header["ranks"]
        beyond = sorted(r for r in orders if not 0 <= r < p)
        if beyond:  # its tasks would be dropped with it
            raise ScheduleError(f"line {orders_at[beyond[0]]}: rank{beyond[0]} is outside the header's ranks={p} "
                                f"(rank0..rank{p - 1})")
        return cls(
            num_ranks=p,
            num_stages=header["stages"],
            num_microbatches=header["microbatches"],
            placement=tuple(placement),
            orders=tuple(tuple(orders.get(r, [])) for r in range(p)),
            name=name,
            overlap_pairs=tuple(overlaps),
        )


_HEADER_KEYS = ("ranks", "stages", "microbatches")
_NO_NAME = "custom"  # the text form's word for a schedule without a name


def _name_text(name: str) -> str:
    """`name` as the text form's first line writes it: as it is where it reads back as itself (the
    rest of that line, stripped); else (``custom``, a line break, edge spaces, a leading quote) as
    a JSON string, which holds no line break."""
    if not name:
        return _NO_NAME
    plain = name != _NO_NAME and name == name.strip() and not name.startswith('"') and name.splitlines() == [name]
    return name if plain else json.dumps(name)


def _name_from_text(text: str) -> str:
    """Inverse of `_name_text`."""
    if text == _NO_NAME:
        return ""
    if text.startswith('"'):
        try:
            name = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"the schedule name starts with a quote but is no JSON string ({exc})") from None
        if not isinstance(name, str):
            raise ValueError("the schedule name starts with a quote but is no JSON string")
        return name
    return text


def _parse_header(line: str) -> dict[str, int]:
    """``ranks=P stages=S microbatches=M`` as a dict. A key outside those three (a typo such as
    ``microbatchs=8``) or one given twice is refused: either would be silently ignored."""
    header: dict[str, int] = {}
    for item in line.split():
        key, sep, value = item.partition("=")
        if not sep or key not in _HEADER_KEYS:
            raise ValueError(f"unknown header key {key!r}; the header line is 'ranks=P stages=S microbatches=M'")
        if key in header:
            raise ValueError(f"header key {key!r} given twice")
        header[key] = int(value)
    return header


def loop_placement(num_ranks: int, chunks: int = 1) -> tuple[int, ...]:
    """Stage s on rank s % num_ranks (1F1B for chunks=1, interleaved otherwise)."""
    return tuple(s % num_ranks for s in range(num_ranks * chunks))


def v_placement(num_ranks: int) -> tuple[int, ...]:
    """V shape: rank r holds stages r and 2p-1-r."""
    p = num_ranks
    return tuple(list(range(p)) + list(reversed(range(p))))


def from_orders(
    name: str,
    placement: Sequence[int],
    num_microbatches: int,
    orders: Iterable[Iterable[Action]],
    overlap_pairs: Iterable[tuple[Action, Action]] = (),
) -> Schedule:
    """Convenience constructor used by the generators."""
    orders = tuple(tuple(o) for o in orders)
    return Schedule(
        num_ranks=len(orders),
        num_stages=len(placement),
        num_microbatches=num_microbatches,
        placement=tuple(placement),
        orders=orders,
        name=name,
        overlap_pairs=tuple(overlap_pairs),
    )
