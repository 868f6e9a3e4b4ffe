"""SVG/PNG figures: one shape per task, bubbles drawn, title with bubble rate and peak memory.

References: hand-worked timelines (1F1B, p=2, m=2) and DESIGN.md's numbers (ZB-H1, p=4, m=8:
span 27 against 24 of work, so a bubble rate of 3/27 = 11.1%; peak memory [4, 10/3, 8/3, 2] at
p=4 with wgrad = 1/3).
"""

from __future__ import annotations

import sys
import xml.etree.ElementTree as ET
from collections import Counter

import pytest

pytest.importorskip("matplotlib", reason="figures need matplotlib (pip install zbpp[viz])")

from zbpp import viz  # noqa: E402
from zbpp.cli import main  # noqa: E402
from zbpp.schedules import Costs, Memory, available, build, simulate  # noqa: E402
from zbpp.viz.trace import write_trace  # noqa: E402

SVG = "{http://www.w3.org/2000/svg}"


def _groups(svg_path) -> dict[str, int]:
    """Shapes (path/use elements) in each group whose id marks tasks or idle time."""
    root = ET.parse(svg_path).getroot()  # also proves the SVG is well-formed XML
    out = {}
    for g in root.iter(f"{SVG}g"):
        gid = g.get("id", "")
        if gid.startswith("tasks-") or gid == "idle":
            out[gid] = sum(1 for e in g.iter() if e.tag in (f"{SVG}path", f"{SVG}use"))
    return out


def _texts(svg_path) -> list[str]:
    root = ET.parse(svg_path).getroot()
    return ["".join(t.itertext()) for t in root.iter(f"{SVG}text")]


def _labels(svg_path) -> dict[str, str]:
    """Task id -> the text drawn in its box."""
    root = ET.parse(svg_path).getroot()
    return {g.get("id")[len("label-"):]: "".join(g.itertext()).strip()
            for g in root.iter(f"{SVG}g") if g.get("id", "").startswith("label-")}


CASES = [("1f1b", {}), ("zb-h1", {}), ("interleaved-1f1b", {"chunks": 2}), ("zb-v", {}), ("dualpipe-v", {})]


@pytest.mark.parametrize("name,opts", CASES)
def test_svg_has_one_shape_per_task_in_its_kind_and_chunk_group(tmp_path, name, opts):
    if name not in available():
        pytest.skip(f"schedule {name!r} is not registered yet")
    sched = build(name, num_ranks=4, num_microbatches=8, **opts)
    path = tmp_path / "s.svg"
    viz.plot(sched, Costs(1, 1, 1), path)
    chunk = {s: i for r in range(4) for i, s in enumerate(sched.stages_on(r))}
    expected = Counter(f"tasks-{a.kind.value}-chunk{chunk[a.stage]}" for _, a in sched.actions())
    got = {k: v for k, v in _groups(path).items() if k.startswith("tasks-")}
    assert got == dict(expected)
    assert sum(got.values()) == sched.num_tasks


def test_hand_worked_1f1b_bubbles_and_labels(tmp_path):
    # 1F1B, p=2, m=2, unit costs:  rank 0: F0 F1 . . BW0 BW0 . BW1 BW1
    #                               rank 1: . F0 BW0 BW0 F1 BW1 BW1 . .
    # idle: rank 0 [2,4] and [6,7]; rank 1 [0,1] and [7,9]  -> 4 grey boxes
    path = tmp_path / "h.svg"
    viz.plot(build("1f1b", num_ranks=2, num_microbatches=2), Costs(1, 1, 1), path)  # BW = B + W = 2
    assert _groups(path)["idle"] == 4
    # every box is wide enough for its microbatch id
    assert _labels(path) == {f"{k}{s}.{j}": str(j) for k in ("F", "BW") for s in (0, 1) for j in (0, 1)}


def test_title_states_bubble_rate_and_peak_memory(tmp_path):
    path = tmp_path / "t.svg"
    viz.plot(build("zb-h1", num_ranks=4, num_microbatches=8), Costs(1, 1, 1), path, memory=Memory(1, 1 / 3))
    title = next(t for t in _texts(path) if "bubble rate" in t)
    assert "bubble rate 11.1%" in title  # (27 - 24) / 27
    assert "peak memory 4 (4, 3.33, 2.67, 2)" in title


def test_png_renders(tmp_path):
    import matplotlib.image as mpimg

    path = tmp_path / "z.png"
    viz.plot(simulate(build("zb-h2", num_ranks=4, num_microbatches=8)), path=path)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    img = mpimg.imread(path)
    assert img.shape[0] > 100 and img.shape[1] > 300
    assert img.std() > 0.05  # not a blank canvas


def test_plot_from_measured_records(tmp_path):
    records = [
        {"rank": 0, "action": "F0.0", "start": 0.000, "end": 0.010},
        {"rank": 1, "action": "F1.0", "start": 0.011, "end": 0.021},
        {"rank": 1, "action": "BW1.0", "start": 0.021, "end": 0.041},
        {"rank": 0, "action": "BW0.0", "start": 0.042, "end": 0.062},
    ]
    path = tmp_path / "m.svg"
    viz.plot(records, path=path)
    texts = _texts(path)
    assert any(t.startswith("measured") for t in texts)
    assert "time (ms)" in texts
    assert sum(v for k, v in _groups(path).items() if k.startswith("tasks-")) == 4


def test_plot_refuses_unknown_extension(tmp_path):
    with pytest.raises(ValueError, match=r"\.svg or \.png"):
        viz.plot(build("1f1b", num_ranks=2, num_microbatches=2), path=tmp_path / "x.jpg")


def test_missing_matplotlib_says_how_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(ImportError, match=r"pip install zbpp\[viz\]"):
        viz.plot(build("1f1b", num_ranks=2, num_microbatches=2))


def test_cli_plot_svg_and_png(tmp_path, capsys):
    for ext in ("svg", "png"):
        out = tmp_path / f"f.{ext}"
        assert main(["plot", "zb-h1", "-p", "4", "-m", "8", "-o", str(out)]) == 0
        assert out.stat().st_size > 1000
    assert "bubble rate 0.1111" in capsys.readouterr().out


def test_cli_plot_measured_trace(tmp_path, capsys):
    sched = build("zb-h1", num_ranks=2, num_microbatches=3)
    res = simulate(sched, Costs(0.01, 0.01, 0.005))  # seconds, as recorded task times are
    records = [{"rank": sched.rank_of(a.stage), "action": str(a), "start": res.start[a], "end": res.end[a]} for a in res.start]
    trace = tmp_path / "run.json"
    write_trace(trace, measured=records, schedule=sched)
    out = tmp_path / "m.png"
    assert main(["plot", "zb-h1", "-p", "2", "-m", "3", "--measured", str(trace), "-o", str(out)]) == 0
    assert out.read_bytes()[:4] == b"\x89PNG"
    assert f"bubble rate {res.bubble_rate:.4f}" in capsys.readouterr().out
    assert main(["plot", "zb-h1", "-p", "4", "-m", "3", "--measured", str(trace), "-o", str(out)]) == 2
    assert "-p 4" in capsys.readouterr().err


def _measured_trace(path, name: str, *, with_schedule: bool = True):
    """A trace of `name` (p=2, m=3) 'measured' in seconds; without the schedule, the trace holds only
    the records (the schedule is then read off them, unnamed)."""
    sched = build(name, num_ranks=2, num_microbatches=3)
    res = simulate(sched, Costs(0.01, 0.01, 0.005))
    records = [{"rank": sched.rank_of(a.stage), "action": str(a), "start": res.start[a], "end": res.end[a]}
               for a in res.start]
    write_trace(path, measured=records, schedule=sched if with_schedule else None)
    return path


def test_cli_plot_measured_refuses_a_name_the_trace_contradicts(tmp_path, capsys):
    """The trace recorded 1f1b: NAME zb-h1 is refused, naming both; NAME 1f1b titles the figure 1f1b."""
    trace, out = _measured_trace(tmp_path / "run.json", "1f1b"), tmp_path / "m.svg"
    assert main(["plot", "zb-h1", "-p", "2", "-m", "3", "--measured", str(trace), "-o", str(out)]) == 2
    err = capsys.readouterr().err
    assert "zb-h1" in err and "'1f1b'" in err and "--measured" in err and len(err.strip().splitlines()) == 1, err
    assert not out.exists()
    assert main(["plot", "1f1b", "-p", "2", "-m", "3", "--measured", str(trace), "-o", str(out)]) == 0
    assert any(t.startswith("measured 1f1b: p=2, m=3") for t in _texts(out))


def test_cli_plot_measured_checks_name_against_an_unnamed_trace(tmp_path, capsys):
    """A trace of records only names no schedule: NAME is checked against the recorded task order
    (1f1b's and zb-h1's differ: zb-h1 has W tasks), and titles the figure when it matches."""
    trace, out = _measured_trace(tmp_path / "run.json", "1f1b", with_schedule=False), tmp_path / "m.svg"
    assert main(["plot", "zb-h1", "-p", "2", "-m", "3", "--measured", str(trace), "-o", str(out)]) == 2
    err = capsys.readouterr().err
    assert "zb-h1" in err and "--measured" in err and "task order" in err, err
    assert main(["plot", "1f1b", "-p", "2", "-m", "3", "--measured", str(trace), "-o", str(out)]) == 0
    assert any(t.startswith("measured 1f1b: p=2, m=3") for t in _texts(out))


def test_cli_plot_measured_refuses_an_unknown_name(tmp_path, capsys):
    trace = _measured_trace(tmp_path / "run.json", "1f1b")
    assert main(["plot", "nonsense", "-p", "2", "-m", "3", "--measured", str(trace), "-o", str(tmp_path / "m.svg")]) == 2
    err = capsys.readouterr().err
    assert "nonsense" in err and "1f1b" in err, err


@pytest.mark.parametrize("content, code", [
    (None, 1),  # no such file
    ("{", 2),  # not JSON
    ("3", 2),  # JSON, but no trace
    ('{"traceEvents": [{"ph": "X", "cat": "measured", "ts": 0}]}', 2),  # a measured event without its fields
    ('{"traceEvents": []}', 2),  # no measured task
])
def test_cli_plot_measured_bad_file_is_one_line_naming_it(tmp_path, capsys, content, code):
    trace = tmp_path / "run.json"
    if content is not None:
        trace.write_text(content)
    assert main(["plot", "1f1b", "-p", "2", "-m", "3", "--measured", str(trace), "-o", str(tmp_path / "m.svg")]) == code
    err = capsys.readouterr().err
    assert err.startswith("zbpp plot: error: --measured ") and str(trace) in err, err
    assert len(err.strip().splitlines()) == 1, err


def test_cli_plot_measured_accepts_the_unregistered_name_the_trace_recorded(tmp_path, capsys):
    """A run of a schedule read from torch's CSV records the name 'torch-csv', which no registered
    schedule has. NAME zb-h1 is refused with 'give NAME torch-csv'; that NAME must then be taken (it
    used to be refused as an unknown schedule: no NAME could plot the trace)."""
    from zbpp.schedules import from_torch_csv, to_torch_csv

    to_torch_csv(build("zb-h1", num_ranks=2, num_microbatches=3), tmp_path / "s.csv")
    sched = from_torch_csv(tmp_path / "s.csv")
    res = simulate(sched, Costs(0.01, 0.01, 0.005))
    records = [{"rank": sched.rank_of(a.stage), "action": str(a), "start": res.start[a], "end": res.end[a]}
               for a in res.start]
    trace, out = tmp_path / "run.json", tmp_path / "m.svg"
    write_trace(trace, measured=records, schedule=sched)
    assert main(["plot", "zb-h1", "-p", "2", "-m", "3", "--measured", str(trace), "-o", str(out)]) == 2
    assert "give NAME torch-csv" in capsys.readouterr().err
    assert main(["plot", "torch-csv", "-p", "2", "-m", "3", "--measured", str(trace), "-o", str(out)]) == 0
    assert any(t.startswith("measured torch-csv: p=2, m=3") for t in _texts(out))


def test_cli_plot_without_matplotlib_is_one_line(tmp_path, capsys, monkeypatch):
    """Without matplotlib `zbpp plot` ends with one line saying how to install it and exit code 1,
    as the CLI's other errors (it used to end in an ImportError traceback)."""
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    out = tmp_path / "f.svg"
    assert main(["plot", "1f1b", "-p", "2", "-m", "2", "-o", str(out)]) == 1
    err = capsys.readouterr().err
    assert err.startswith("zbpp plot: error: ") and "pip install zbpp[viz]" in err, err
    assert len(err.strip().splitlines()) == 1, err
    assert not out.exists()


def _fills(svg_path) -> dict[str, str]:
    """Group id -> the fill colour of its first task shape (a path, or a use of one in <defs>)."""
    root = ET.parse(svg_path).getroot()
    out = {}
    for g in root.iter(f"{SVG}g"):
        gid = g.get("id", "")
        if gid.startswith("tasks-"):
            style = next(e.get("style", "") for e in g.iter()
                         if e.tag in (f"{SVG}path", f"{SVG}use") and "fill:" in e.get("style", ""))
            out[gid] = next(x.split(":")[1].strip() for x in style.split(";") if x.strip().startswith("fill:"))
    return out


def test_each_chunk_of_a_rank_has_its_own_shade(tmp_path):
    """zb-interleaved, one rank, 8 chunks: the F, B and W boxes of chunks 0..7 are drawn in 8
    distinct colours per kind (chunks 2 and 4, 4 and 6 had one lighter shade), each at least 8/255
    apart in some channel (two shades closer than that are hard to tell apart on a screen)."""
    path = tmp_path / "s.svg"
    viz.plot(build("zb-interleaved", num_ranks=1, num_microbatches=2, chunks=8), Costs(1, 1, 1), path)
    fills = _fills(path)
    for kind in "FBW":
        rgb = [tuple(int(fills[f"tasks-{kind}-chunk{c}"][i:i + 2], 16) for i in (1, 3, 5)) for c in range(8)]
        for i in range(8):
            for j in range(i):
                assert max(abs(x - y) for x, y in zip(rgb[i], rgb[j])) >= 8, (kind, j, i, rgb[j], rgb[i])


def test_many_chunks_draw(tmp_path):
    """16 chunks a rank: chunk 15's darker shade used to go below 0 (k = 0.62 - 0.1 * 7), which
    matplotlib refuses."""
    path = tmp_path / "s.svg"
    viz.plot(build("interleaved-1f1b", num_ranks=1, num_microbatches=1, chunks=16), Costs(1, 1, 1), path)
    assert len(set(_fills(path).values())) == 32  # F and BW of 16 chunks, each its own colour


def test_plot_refuses_costs_and_memory_it_would_ignore(tmp_path):
    """A SimResult is drawn as it is, so costs= and memory= given with it changed nothing drawn (the
    title's peak memory stayed the result's); records are drawn at their measured times, so costs=
    changed nothing. Each is now an error naming what was given; memory= with records still applies."""
    sched = build("1f1b", num_ranks=2, num_microbatches=2)
    res = simulate(sched)
    path = tmp_path / "s.svg"
    for kw, words in (({"costs": Costs(2, 2, 2)}, "costs given"), ({"memory": Memory(activation=3)}, "memory given"),
                      ({"costs": Costs(2, 2, 2), "memory": Memory(activation=3)}, "costs and memory given")):
        with pytest.raises(ValueError, match=f"plot: {words} with a SimResult"):
            viz.plot(res, path=path, **kw)
    recs = [{"rank": r, "action": str(a), "start": res.start[a], "end": res.end[a]} for r, a in sched.actions()]
    with pytest.raises(ValueError, match="plot: costs given with measured records"):
        viz.plot(recs, Costs(2, 2, 2), path)
    # memory applies to records: 1F1B on 2 ranks keeps at most 2 microbatches' activations on rank 0
    viz.plot(recs, path=path, memory=Memory(activation=3))
    assert any("peak memory 6 " in t for t in _texts(path))


@pytest.mark.parametrize("flags, named", [
    (["--f", "2"], ["--f"]),
    (["--comm", "1", "--message-overhead", "0.5"], ["--comm", "--message-overhead"]),
    (["--b", "1", "--w", "1"], ["--b", "--w"]),  # the defaults, typed: still nothing to set
    (["--memory-limit", "4"], ["--memory-limit"]),
    (["--message", "0.5"], ["--message-overhead"]),  # an abbreviation is named in full
])
def test_cli_plot_measured_refuses_costs_a_named_trace_ignores(tmp_path, capsys, flags, named):
    """The trace records 1f1b and its times: cost flags (and --memory-limit) had nothing to set and
    were silently ignored; the error names each flag given."""
    trace, out = _measured_trace(tmp_path / "run.json", "1f1b"), tmp_path / "m.svg"
    assert main(["plot", "1f1b", "-p", "2", "-m", "3", "--measured", str(trace), "-o", str(out), *flags]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"zbpp plot: error: {', '.join(named)}: --measured ") and "drop them" in err, err
    assert not out.exists()


def test_cli_plot_measured_checks_chunks_against_a_named_trace(tmp_path, capsys):
    trace, out = _measured_trace(tmp_path / "run.json", "1f1b"), tmp_path / "m.svg"
    args = ["plot", "1f1b", "-p", "2", "-m", "3", "--measured", str(trace), "-o", str(out)]
    assert main(args + ["--chunks", "2"]) == 2
    assert "--chunks 2 contradicts --measured" in capsys.readouterr().err
    assert main(args + ["--chunks", "1"]) == 0  # 2 stages on 2 ranks: what the trace holds


def test_cli_plot_measured_costs_build_an_automatic_name_for_an_unnamed_trace(tmp_path, capsys):
    """A trace of records only: NAME is built to check it is what ran. zb-auto's order depends on the
    costs, so --comm applies there (without it, the order differs and NAME is refused); 1f1b's does
    not, so --comm with it is refused as having nothing to set."""
    costs, memory = Costs(1, 1, 1, comm=2), Memory(activation=1, wgrad=1 / 3)  # the CLI's default wgrad
    sched = build("zb-auto", num_ranks=2, num_microbatches=3, costs=costs, memory=memory)
    assert sched.orders != build("zb-auto", num_ranks=2, num_microbatches=3, memory=memory).orders
    res = simulate(sched, costs, memory)
    trace, out = tmp_path / "run.json", tmp_path / "m.svg"
    write_trace(trace, measured=[{"rank": r, "action": str(a), "start": res.start[a], "end": res.end[a]}
                                 for r, a in sched.actions()])
    args = ["plot", "zb-auto", "-p", "2", "-m", "3", "--measured", str(trace), "-o", str(out)]
    assert main(args) == 2
    assert "task order differs" in capsys.readouterr().err
    assert main(args + ["--comm", "2"]) == 0
    one = _measured_trace(tmp_path / "one.json", "1f1b", with_schedule=False)
    assert main(["plot", "1f1b", "-p", "2", "-m", "3", "--measured", str(one), "-o", str(out), "--comm", "2"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("zbpp plot: error: --comm: the times drawn are those of --measured") and "1f1b" in err, err


def test_cli_plot_measured_unnamed_trace_whose_tasks_tie_is_its_schedule(tmp_path, capsys):
    """Records cannot order tasks of one instant. ZB-V with W's of no time (p=2, m=3) ends W1.1, W2.2
    and W1.2 at t = 13 on rank 1 (zb-v's order); read off the records, W2.2 sorts first. NAME zb-v
    was refused as not the schedule of its own run. And a NAME refused was shown by its first 6
    tasks, which for dualpipe-v here (rank 0's first 7 agree) were the same on both sides."""
    sched = build("zb-v", num_ranks=2, num_microbatches=3)
    res = simulate(sched, Costs(1, 1, 0))
    assert [res.end[a] - res.start[a] for a in sched.orders[1][-3:]] == [0.0] * 3  # three W's of no time
    assert len({res.start[a] for a in sched.orders[1][-3:]}) == 1  # at one instant
    trace, out = tmp_path / "run.json", tmp_path / "m.svg"
    write_trace(trace, measured=[{"rank": r, "action": str(a), "start": res.start[a] / 1e3, "end": res.end[a] / 1e3}
                                 for r, a in sched.actions()])
    assert main(["plot", "zb-v", "-p", "2", "-m", "3", "--measured", str(trace), "-o", str(out)]) == 0
    assert any(t.startswith("measured zb-v: p=2, m=3") for t in _texts(out))
    capsys.readouterr()
    assert main(["plot", "dualpipe-v", "-p", "2", "-m", "3", "--measured", str(trace), "-o", str(out)]) == 2
    zbv, dpv = sched.orders[0], build("dualpipe-v", num_ranks=2, num_microbatches=3).orders[0]
    assert zbv[:7] == dpv[:7] and zbv[7] != dpv[7]
    shown = (f"rank 0 ran from its task 7 on {' '.join(map(str, zbv[7:13]))} ... where dualpipe-v runs "
             f"{' '.join(map(str, dpv[7:13]))} ...")
    assert shown in capsys.readouterr().err


def test_tasks_of_no_time_are_drawn_in_their_colour(tmp_path):
    """Costs(w=0): ZB-H1's W's take no time. Their boxes had no width, so the figure showed no W at
    all (the legend listed one). Each W must now cover at least 2.5 points around its instant (the
    simulated start, the reference), in the W group; F and B keep their exact extents. With every
    task of no time the axis had no width and matplotlib warned; it must draw without a warning."""
    import warnings

    sched = build("zb-h1", num_ranks=3, num_microbatches=4)
    res = simulate(sched, Costs(1, 1, 0))
    fig = viz.plot(res, path=tmp_path / "w0.svg")
    ax = fig.axes[0]
    lo, hi = ax.get_xlim()
    pt_per_unit = ax.get_window_extent().width * 72 / fig.dpi / (hi - lo)
    boxes = {c.get_gid(): [p.vertices for p in c.get_paths()] for c in ax.collections}
    w_tasks = sorted(res.start[a] for _, a in sched.actions() if a.kind.value == "W")
    w_boxes = sorted((v[:, 0].min(), v[:, 0].max()) for v in boxes["tasks-W-chunk0"])
    assert len(w_boxes) == len(w_tasks) == 12
    for t, (x0, x1) in zip(w_tasks, w_boxes):
        assert x0 < t < x1 and (x1 - x0) * pt_per_unit >= 2.5, (t, x0, x1)
    f_widths = {round(v[:, 0].max() - v[:, 0].min(), 9) for v in boxes["tasks-F-chunk0"]}
    assert f_widths == {1.0}  # F takes 1: drawn exactly
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        viz.plot(sched, Costs(0, 0, 0), tmp_path / "zero.svg")
