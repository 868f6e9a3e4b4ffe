"""The IR's string forms round-trip, and placement is as DESIGN.md says."""

from __future__ import annotations

import pytest

from zbpp.schedules import Action, Kind, Schedule, ScheduleError, available, build
from zbpp.schedules.ir import v_placement


@pytest.mark.parametrize("kind", list(Kind))
def test_action_string_round_trips(kind: Kind) -> None:
    for stage, mb in [(0, 0), (3, 17), (63, 255)]:
        a = Action(kind, stage, mb)
        assert Action.parse(str(a)) == a
    assert str(Action(Kind.BW, 2, 5)) == "BW2.5"


@pytest.mark.parametrize("bad", ["", "X0.1", "F0", "F-1.2", "F1.2.3", "f0.1"])
def test_action_parse_rejects_garbage(bad: str) -> None:
    with pytest.raises(ValueError, match="cannot parse action"):
        Action.parse(bad)


@pytest.mark.parametrize("name", available())
def test_schedule_text_round_trips(name: str) -> None:
    sched = build(name, num_ranks=3, num_microbatches=5)
    again = Schedule.from_text(sched.to_text())
    assert again == sched


def test_from_text_names_the_bad_line() -> None:
    text = "ranks=1 stages=1 microbatches=1\nplacement=0\nrank0: F0.0 Q0.0\n"
    with pytest.raises(ScheduleError, match=r"line 3: .*cannot parse action 'Q0.0'"):
        Schedule.from_text(text)


@pytest.mark.parametrize("drop", ["ranks=1", "stages=1", "microbatches=1"])
def test_from_text_names_what_the_header_lacks(drop: str) -> None:
    header = " ".join(x for x in ("ranks=1", "stages=1", "microbatches=1") if x != drop)
    text = f"# zbpp schedule custom\n{header}\nplacement=0\nrank0: F0.0 BW0.0\n"
    with pytest.raises(ScheduleError, match=rf"line 2: '{header}': lacks {drop[:-1]}; the header line is 'ranks=P"):
        Schedule.from_text(text)


@pytest.mark.parametrize("header, words", [
    # a typo'd key was dropped: the file's microbatches=4 stood, the intended 8 was never read
    ("ranks=1 stages=1 microbatches=4 microbatchs=8", "unknown header key 'microbatchs'"),
    ("ranks=1 stage=2 stages=1 microbatches=4", "unknown header key 'stage'"),
    # the second value silently won
    ("ranks=1 stages=1 microbatches=4 ranks=2", "header key 'ranks' given twice"),
])
def test_from_text_refuses_unknown_or_repeated_header_keys(header: str, words: str) -> None:
    text = f"{header}\nplacement=0\nrank0: F0.0 BW0.0 F0.1 BW0.1 F0.2 BW0.2 F0.3 BW0.3\n"
    with pytest.raises(ScheduleError, match=rf"line 1: .*{words}"):
        Schedule.from_text(text)


ONE = "ranks=1 stages=1 microbatches=2\nplacement=0\nrank0: F0.0 BW0.0 F0.1 BW0.1\n"


@pytest.mark.parametrize("extra, words", [
    # each second line replaced the first: the schedule was the last line's, the first one's lost
    ("ranks=1 stages=1 microbatches=4", r"line 4: .*a second header line \(the first: line 1"),
    ("placement=0", r"line 4: .*a second placement line \(the first: line 2\)"),
    ("rank0: F0.0 B0.0 W0.0 F0.1 B0.1 W0.1", r"line 4: .*a second line for rank 0 \(the first: line 3\)"),
    # a rank the header does not have: its line was dropped
    ("rank1: F0.0 BW0.0", r"line 4: rank1 is outside the header's ranks=1 \(rank0..rank0\)"),
])
def test_from_text_refuses_a_line_given_twice_or_a_rank_beyond_the_header(extra: str, words: str) -> None:
    Schedule.from_text(ONE)  # the file alone reads
    with pytest.raises(ScheduleError, match=words):
        Schedule.from_text(ONE + extra + "\n")


def test_placements() -> None:
    assert build("1f1b", num_ranks=4, num_microbatches=4).stages_on(2) == [2]
    inter = build("interleaved-1f1b", num_ranks=4, num_microbatches=4, chunks=3)
    assert inter.stages_on(1) == [1, 5, 9]
    assert v_placement(4) == (0, 1, 2, 3, 3, 2, 1, 0)


@pytest.mark.parametrize("name", ["my schedule", "zb-h1 (p=4, tuned)"])
def test_schedule_text_keeps_a_name_with_spaces(name: str) -> None:
    """A schedule named by its user (from_orders, from_torch_csv(name=...)) keeps its whole name
    through the text form (and so through a trace's stored schedule), not its last word."""
    sched = build("1f1b", num_ranks=2, num_microbatches=2)
    named = Schedule(sched.num_ranks, sched.num_stages, sched.num_microbatches, sched.placement, sched.orders, name=name)
    assert Schedule.from_text(named.to_text()) == named


@pytest.mark.parametrize("name", ["custom", "", "two\nlines", "cr\rname", " edges ", '"quoted"', "para\u2029sep",
                                  "plain name", "measured"])
def test_schedule_name_round_trips_through_the_text_form(name: str) -> None:
    """The name comes back as it was: "custom" (the text form's word for no name) used to come back
    as "", and a name with a line break split the first line, its tail read as an unknown line."""
    sched = Schedule(1, 1, 2, (0,), ((Action(Kind.F, 0, 0), Action(Kind.BW, 0, 0),
                                      Action(Kind.F, 0, 1), Action(Kind.BW, 0, 1)),), name=name)
    text = sched.to_text()
    assert Schedule.from_text(text) == sched
    assert Schedule.from_text(text).name == name


def test_text_form_still_reads_custom_as_no_name() -> None:
    """Files written before names were quoted say "custom" for a schedule without a name."""
    assert Schedule.from_text("# zbpp schedule custom\n" + ONE).name == ""
    assert Schedule.from_text("# zbpp schedule zb-h1\n" + ONE).name == "zb-h1"


def test_a_schedule_name_must_be_a_string() -> None:
    with pytest.raises(ScheduleError, match="Schedule.name must be a string, got int 3"):
        Schedule(1, 1, 1, (0,), ((Action(Kind.F, 0, 0), Action(Kind.BW, 0, 0)),), name=3)
