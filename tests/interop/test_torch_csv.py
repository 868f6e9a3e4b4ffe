"""zbpp <-> torch.distributed.pipelining: compute_only CSV export and import.

The reference is torch itself: its CSV parser (`_Action.from_str`), its validator
(`_validate_schedule`), its lowering (`_add_send_recv`), its step simulator
(`_simulate_comms_compute`) and its runtime (`_PipelineScheduleRuntime` on gloo, checked against
one process running the whole model on the whole batch).
"""

from __future__ import annotations

import csv
import os
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
from torch.distributed.pipelining import schedules as S  # noqa: E402

from zbpp.schedules import (  # noqa: E402
    Costs,
    Memory,
    ScheduleError,
    available,
    build,
    from_torch_csv,
    simulate,
    to_torch_csv,
    validate,
)
from zbpp.schedules.ir import Action, Kind  # noqa: E402

from .torch_orders import compute_only, lower_and_simulate, torch_schedule  # noqa: E402

# Every schedule DESIGN.md names. Those not registered yet (issue 3 is written concurrently) skip.
NAMES = ["gpipe", "1f1b", "interleaved-1f1b", "zb-h1", "zb-h2", "zb-interleaved", "zb-v", "v-half", "v-min", "dualpipe-v", "zb-auto", "zbv-auto", "zbi-auto"]
SIZES = [(1, 1), (2, 1), (2, 3), (4, 4), (4, 9)]


def _build(name: str, p: int, m: int):
    if name not in available():
        pytest.skip(f"schedule {name!r} is not registered yet (available: {', '.join(available())})")
    return validate(build(name, num_ranks=p, num_microbatches=m))


def _read_torch(path: Path) -> dict[int, list]:
    """The CSV as torch's `_load_csv` reads it."""
    with open(path, newline="") as fh:
        return {r: [S._Action.from_str(c) for c in row] for r, row in enumerate(csv.reader(fh))}


def _leaf_actions(actions: list) -> list:
    out = []
    for a in actions:
        if a is None:
            continue
        out += list(a.sub_actions) if a.sub_actions is not None else [a]
    return out


def _zbpp_as_torch_strings(sched) -> list[set[str]]:
    letter = {Kind.F: "F", Kind.B: "I", Kind.W: "W", Kind.BW: "B"}
    return [{f"{a.stage}{letter[a.kind]}{a.microbatch}" for a in order} for order in sched.orders]


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("p,m", SIZES)
def test_export_passes_torch_validation_lowering_and_simulation(tmp_path, name, p, m):
    sched = _build(name, p, m)
    path = tmp_path / "s.csv"
    to_torch_csv(sched, path)
    actions = _read_torch(path)
    mapping = S._validate_schedule(actions, p, sched.num_stages, m)
    assert [mapping[s] for s in range(sched.num_stages)] == list(sched.placement)
    # B is torch's I and BW its B: the same tasks, per rank
    assert [{str(a) for a in _leaf_actions(actions[r])} for r in range(p)] == _zbpp_as_torch_strings(sched)
    to_rank = lambda s: mapping[s]  # noqa: E731
    lowered = S._add_send_recv({r: list(a) for r, a in actions.items()}, stage_to_rank=to_rank, num_stages=sched.num_stages)
    assert [{str(a) for a in _leaf_actions(lowered[r]) if a.is_compute_op} for r in range(p)] == _zbpp_as_torch_strings(sched)
    # torch's step simulator looks up the rank of an OVERLAP_F_B cell's own stage (-1) and fails on
    # torch's DualPipeV too, so it gets the same order written without compound cells
    flat = tmp_path / "flat.csv"
    to_torch_csv(sched, flat, overlap=False)
    simulated = lower_and_simulate(_read_torch(flat), to_rank, sched.num_stages)
    done = [{str(a) for a in _leaf_actions(simulated[r]) if a.is_compute_op} for r in range(p)]
    assert done == _zbpp_as_torch_strings(sched)  # every task ran: torch found no deadlock


@pytest.mark.parametrize("name", NAMES)
def test_round_trip_is_identity(tmp_path, name):
    sched = _build(name, 4, 9)
    path = tmp_path / "s.csv"
    to_torch_csv(sched, path)
    back = from_torch_csv(path, num_microbatches=9)
    assert back.orders == sched.orders
    assert back.placement == sched.placement
    assert set(back.overlap_pairs) == set(sched.overlap_pairs)


def test_export_writes_torch_letters_for_split_and_full_backward(tmp_path):
    sched = build("1f1b", num_ranks=2, num_microbatches=2)
    path = tmp_path / "a.csv"
    to_torch_csv(sched, path)
    assert path.read_text().splitlines() == ["0F0,0F1,0B0,0B1", "1F0,1B0,1F1,1B1"]


def _torch_csv(tmp_path: Path, name: str, p: int, m: int) -> Path:
    """torch writes its own order with its own writer (`_dump_csv`, compute_only)."""
    sched = torch_schedule(name, p, m)
    path = tmp_path / f"{name}-{p}-{m}.csv"
    if hasattr(sched, "_prepare_schedule_with_comms"):
        sched._dump_csv(str(path), format="compute_only")
    else:  # Schedule1F1B is single-stage: no _dump_csv format argument
        with open(path, "w", newline="") as fh:
            csv.writer(fh).writerows(compute_only(sched.pipeline_order)[r] for r in range(p))
    return path


@pytest.mark.parametrize("p,m", [(2, 4), (4, 8), (4, 12), (8, 24)])
def test_torch_zbv_imports_and_has_zero_bubble_and_2p_memory(tmp_path, p, m):
    """The ZB-V paper: with F = B = W and no comm, ZB-V has no bubble and peaks at 2p V-stage activations."""
    sched = validate(from_torch_csv(_torch_csv(tmp_path, "ZBVZeroBubble", p, m)))
    assert sched.num_stages == 2 * p and sched.stages_on(0) == [0, 2 * p - 1]
    res = simulate(sched, Costs(1, 1, 1), Memory(activation=1, wgrad=1))
    assert res.bubble_rate == 0.0
    assert res.peak_memory == [2 * p] * p


@pytest.mark.parametrize("p,m", [(2, 8), (4, 8), (4, 12), (8, 24)])
def test_torch_interleaved_zero_bubble_one_chunk_is_zb_h1(tmp_path, p, m):
    """torch's ZB1P with one stage per rank is the paper's ZB-H1: its bubble is (p-1)(F+B-W)."""
    sched = validate(from_torch_csv(_torch_csv(tmp_path, "InterleavedZeroBubble", p, m)))
    f, b, w = 1.0, 1.5, 0.7
    res = simulate(sched, Costs(f, b, w))
    # zero-bubble paper: ZB-H1's bubble is (p-1)(F+B-W), on top of m(F+B+W) of work
    assert res.cost == pytest.approx(m * (f + b + w) + (p - 1) * (f + b - w), rel=1e-12)


@pytest.mark.parametrize("p,m", [(2, 4), (4, 8)])
def test_torch_interleaved_zero_bubble_two_chunks_imports_and_simulates(tmp_path, p, m):
    sched = validate(from_torch_csv(_torch_csv(tmp_path, "InterleavedZeroBubble-2", p, m)))
    assert sched.placement == tuple(s % p for s in range(2 * p))
    res = simulate(sched, Costs(1, 1, 1))
    assert res.busy == pytest.approx(2 * m * 3)  # 2 stages x m microbatches x (F + B + W) per rank
    assert 0.0 <= res.bubble_rate < 0.5


@pytest.mark.parametrize("p,m", [(2, 4), (4, 8), (4, 9), (8, 16)])
def test_torch_dualpipev_imports_with_overlapped_pairs(tmp_path, p, m):
    path = _torch_csv(tmp_path, "DualPipeV", p, m)
    sched = validate(from_torch_csv(path))
    assert sched.num_stages == 2 * p and sched.placement[:p] == tuple(range(p))
    cells = [c for row in csv.reader(open(path, newline="")) for c in row]
    assert len(sched.overlap_pairs) == sum(c.endswith("OVERLAP_F_B") for c in cells) > 0
    for a, b in sched.overlap_pairs:  # adjacent on their rank, F first then a full backward
        order = sched.orders[sched.rank_of(a.stage)]
        i = order.index(a)
        assert order[i + 1] == b and a.kind is Kind.F and b.kind is Kind.BW
    res = simulate(sched, Costs(1, 1, 1), Memory(activation=1, wgrad=1))
    assert res.busy == pytest.approx(2 * m * 3)
    # written back, torch reads the same compound cells
    again = tmp_path / "again.csv"
    to_torch_csv(sched, again)
    assert [[str(a) for a in r] for r in _read_torch(again).values()] == [
        [str(a) for a in r if a is not None] for r in _read_torch(path).values()
    ]


def test_import_drops_idle_cells_and_lowering_actions(tmp_path):
    path = tmp_path / "c.csv"
    path.write_text("0F0,,0SEND_F0,0I0,0W0,0REDUCE_GRAD\n,1RECV_F0,1F0,1B0,1SEND_B0\n")
    sched = validate(from_torch_csv(path))
    assert [[str(a) for a in o] for o in sched.orders] == [["F0.0", "B0.0", "W0.0"], ["F1.0", "BW1.0"]]


def test_import_errors_name_the_cell(tmp_path):
    bad = tmp_path / "bad.csv"
    bad.write_text("0F0,0X0\n")
    with pytest.raises(ScheduleError, match=r"line 1 \(rank 0\), column 1.*'0X0'"):
        from_torch_csv(bad)
    split = tmp_path / "split.csv"
    split.write_text("0F0,0B0\n0F1,0B1\n")
    with pytest.raises(ScheduleError, match="stage 0 is on rank 1 but also on rank 0"):
        from_torch_csv(split)
    with pytest.raises(ValueError, match="placement must be"):
        from_torch_csv(split, placement="zigzag")


def test_import_with_explicit_placement_reports_misplaced_task(tmp_path):
    path = tmp_path / "p.csv"
    path.write_text("0F0,0B0,1F0,1B0\n\n")
    sched = from_torch_csv(path, placement="loop")
    with pytest.raises(ScheduleError, match="task F1.0 is on rank 0 but stage 1 is placed on rank 1"):
        validate(sched)


def _single_process_reference():
    from .torch_runtime_worker import loss_fn, make_batch, make_model

    stages = make_model(2)
    x, y = make_batch()
    h = x
    for st in stages:
        h = st(h)
    loss = loss_fn(h, y)  # equal-size microbatches: batch mean = mean of microbatch means
    loss.backward()
    return [{n: p.grad.clone() for n, p in st.named_parameters()} for st in stages], loss.detach()


@pytest.mark.timeout(180)
def test_zbpp_csv_trains_under_torch_runtime_on_gloo(tmp_path):
    """Two gloo ranks run zbpp's zb-h1 (B as torch's I, W as W) and 1f1b (BW as torch's B) with
    torch's `_PipelineScheduleRuntime`; the gradients match one process running the whole model on
    the whole batch (fp32; rtol 1e-5 covers the different summation order of per-microbatch
    gradients)."""
    m, names = 4, ["zb-h1", "1f1b"]
    csvs = []
    for name in names:
        csv_path = tmp_path / f"{name}.csv"
        to_torch_csv(validate(build(name, num_ranks=2, num_microbatches=m)), csv_path)
        csvs.append(str(csv_path))
    worker = Path(__file__).with_name("torch_runtime_worker.py")
    env = dict(os.environ, OMP_NUM_THREADS="1")
    # output to files, not pipes: a rank blocked on a full, unread pipe would stall its peer too
    log_paths = [tmp_path / f"rank{r}.log" for r in range(2)]
    procs = []
    for r in range(2):
        with open(log_paths[r], "w") as log:
            procs.append(subprocess.Popen(
                [sys.executable, str(worker), str(r), "2", str(tmp_path / "store"), str(tmp_path), str(m), *csvs],
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
                text=True,
            ))
    try:
        for p in procs:
            p.wait(timeout=170)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    logs = [path.read_text() for path in log_paths]
    for r, (p, log) in enumerate(zip(procs, logs)):
        assert p.returncode == 0, f"rank {r} failed:\n{log}"
    ref_grads, ref_loss = _single_process_reference()
    for k, name in enumerate(names):
        for r in range(2):
            got = torch.load(tmp_path / f"rank{r}-{k}.pt")
            for n, g in ref_grads[r].items():
                torch.testing.assert_close(got["grads"][n], g, rtol=1e-5, atol=1e-6, msg=f"{name}: rank {r} {n}")
        losses = torch.load(tmp_path / f"rank1-{k}.pt")["losses"]
        assert len(losses) == m
        torch.testing.assert_close(torch.stack(losses).mean(), ref_loss, rtol=1e-5, atol=1e-6)


def test_import_of_a_file_that_is_not_utf8_text_names_it(tmp_path):
    """A spreadsheet's 'Unicode text' export is UTF-16 (starting with the bytes FF FE): reading it
    used to end in a bare UnicodeDecodeError that named neither the file nor what to do."""
    path = tmp_path / "utf16.csv"
    path.write_bytes("0F0,0B0\n".encode("utf-16"))
    with pytest.raises(ScheduleError, match=rf"{path}: not UTF-8 text .*save it as UTF-8 CSV"):
        from_torch_csv(path)


def test_import_errors_name_the_line_of_the_file(tmp_path):
    """A cell's error names its line in the file, not only its row as a rank: with a quoted cell
    spanning two lines (csv allows it), rank 1 is on line 3, not 2."""
    path = tmp_path / "bad.csv"
    path.write_text('0F0,"0B0\n"\n1F0,1X0\n')
    with pytest.raises(ScheduleError, match=r"bad.csv: line 3 \(rank 1\), column 1: cannot read action '1X0'"):
        from_torch_csv(path)


def test_a_stray_newline_at_the_end_adds_no_rank(tmp_path):
    """zb-h1 on 2 ranks written out, then one more newline: torch's reader (csv.reader, as
    `_load_csv`) sees a third, empty row, which torch's own validator refuses for a 2-rank group;
    zbpp made it a third rank holding nothing (p=3, validating). It now reads back the 2 ranks."""
    sched = _build("zb-h1", 2, 2)
    path = tmp_path / "s.csv"
    to_torch_csv(sched, path)
    with open(path, "a", newline="") as fh:
        fh.write("\r\n")
    rows = _read_torch(path)
    assert len(rows) == 3 and rows[2] == []
    with pytest.raises(AssertionError, match="expected 2, actual 3"):
        S._validate_schedule(rows, 2, 2, 2)
    again = validate(from_torch_csv(path))
    assert again.num_ranks == 2 and again.orders == sched.orders and again.placement == sched.placement
    # an explicit placement that puts a stage on the blank row keeps it as that stage's (empty) rank,
    # as torch's reading does: validate then names the stage's missing tasks
    one = tmp_path / "one.csv"
    one.write_text("0F0,0B0,1F0,1B0\n\n")
    assert from_torch_csv(one).num_ranks == 1
    assert from_torch_csv(one, placement=[0, 1]).num_ranks == 2


def test_a_blank_row_written_by_torch_is_an_empty_rank(tmp_path):
    """torch's writer (`_dump_csv`: csv.writer, one writerow per rank) writes a rank with no actions as
    a blank row; read back, it is that rank, empty, wherever a stage is placed on it: in the middle
    of the file always, at its end with placement "loop" (test above) or a list."""
    path = tmp_path / "t.csv"
    with open(path, "w", newline="") as fh:  # what _dump_csv writes for {0: [...], 1: [], 2: [...]}
        writer = csv.writer(fh)
        for row in (["0F0", "0B0"], [], ["2F0", "2B0"]):
            writer.writerow(row)
    assert list(_read_torch(path)) == [0, 1, 2]
    sched = from_torch_csv(path, placement="loop")
    assert sched.num_ranks == 3 and sched.orders[1] == ()
    with pytest.raises(ScheduleError, match=r"task F1.0 is missing \(rank 1\)"):
        validate(sched)
