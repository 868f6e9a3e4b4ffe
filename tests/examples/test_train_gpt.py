"""examples/train_gpt.py on 2 gloo CPU ranks, a tiny GPT in float64, against one process.

The reference is one process running the whole model (built by the example's `build_stages` as a
single stage, the token embedding used for input and LM head alike) on the whole batch: its loss
on the first training batch and on the validation batches before training must be the pipeline's.
float64 makes the comparison tight: the pipeline and the reference differ only in summation order
(microbatches, stages), about 1e-16 relative per operation, so 1e-10 relative has four orders of
magnitude of room, while a lost microbatch, a wrong loss weight or an unsummed tied gradient moves
the loss or the gradients by 1e-3 or more. The tied embedding's copies must stay bit-identical:
they start equal, receive the same summed gradient and take the same AdamW step.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch

from .loader import load_example, train_example

ROOT = Path(__file__).resolve().parents[2]
RTOL = 1e-10  # float64, see the module docstring

TINY = ["--hidden", "16", "--heads", "2", "--layers", "4", "--seq-len", "16", "--rows-per-microbatch", "2",
        "--microbatches", "4", "--steps", "3", "--eval-every", "2", "--eval-batches", "2", "--warmup", "1",
        "--lr", "1e-2", "--data-bytes", "60000", "--dtype", "float64", "--backend", "gloo", "--timeout", "60",
        "--check"]


def _example() -> Any:
    return load_example("train_gpt")


def train_on_rank(argv: list[str]) -> dict[str, Any]:
    return train_example("train_gpt", argv)


def _reference() -> dict[str, Any]:
    """The whole model in one process: its loss on the first training batch and the validation
    loss before training, with the same data, seed and batch draws as the example."""
    ex = _example()
    args = ex.parse_args(TINY)
    data = ex.load_text(args.data_bytes)
    vocab = -(-len(data.vocab) // args.pad_vocab) * args.pad_vocab
    cfg = ex.GPTConfig(vocab=vocab, hidden=args.hidden, heads=args.heads, layers=args.layers, seq_len=args.seq_len)
    model = ex.build_stages([0], 1, cfg, dtype=torch.float64, delayed=False, seed=args.seed)[0]
    rows = args.rows_per_microbatch * args.microbatches
    x, y = data.batch("train", rows, args.seq_len, seed=ex._train_seed(args.seed, 0))
    loss = ex.lm_loss(model(x), y)
    loss.backward()
    norm = math.sqrt(sum(float(p.grad.square().sum()) for p in model.parameters()))  # the tied weight once
    with torch.no_grad():
        val = [float(ex.lm_loss(model(x), y)) for x, y in
               (data.batch("val", rows, args.seq_len, seed=ex._val_seed(args.seed, i)) for i in range(args.eval_batches))]
    return {"first_loss": float(loss.detach()), "grad_norm": norm, "val0": sum(val) / len(val), "wte0": model.wte.detach().clone()}


@pytest.fixture(scope="module")
def reference() -> dict[str, Any]:
    return _reference()


def _check_run(results: list[dict[str, Any]], reference: dict[str, Any], schedule: str) -> dict[str, Any]:
    last = next(r for r in results if r["history"])  # the rank holding the last stage reports
    assert [r["step"] for r in last["history"]] == [1, 2, 3]
    losses = [r["loss"] for r in last["history"]]
    assert all(math.isfinite(v) for v in losses), losses
    assert losses[0] == pytest.approx(reference["first_loss"], rel=RTOL, abs=0)
    # the norm that --clip clips by: the whole model's, the tied embedding's gradient counted once
    assert last["history"][0]["grad_norm"] == pytest.approx(reference["grad_norm"], rel=RTOL, abs=0)
    # the script's own --check: gradients of the first step, tied copies after the last
    assert last["check"]["ok"], last["check"]
    assert last["check"]["grad_rel"] <= 1e-9 and last["check"]["tied_spread"] == 0.0, last["check"]
    # validation loss from eval_step: before training it is the reference model's
    assert [s for s, _ in last["val"]] == [0, 2, 3]
    assert last["val"][0][1] == pytest.approx(reference["val0"], rel=RTOL, abs=0)
    text = last["stdout"]
    assert f"train_gpt: {schedule} on 2 ranks (gloo)" in text, text
    for step in (0, 2, 3):
        assert f"step {step:>5}/3 | val loss " in text, text
    assert "step     3/3 | loss " in text and "tok/s" in text and any(line.startswith("done: 3 steps") for line in text.splitlines()), text
    others = [r for r in results if r is not last]
    assert all(r["stdout"] == "" for r in others), [r["stdout"] for r in others]  # one rank reports
    return last


@pytest.mark.slow
def test_one_stage_per_rank_matches_one_process_and_keeps_tied_copies_equal(zbpp_workers, reference, tmp_path):
    log = tmp_path / "steps.json"
    results = zbpp_workers(2).run(train_on_rank, ["--schedule", "zb-h1", "--json", str(log), *TINY])
    last = _check_run(results, reference, "zb-h1")
    r0, r1 = results
    assert r0["stages"] == [0] and r1["stages"] == [1]
    # the embedding (rank 0) and the LM head (rank 1) are copies of one parameter: bit-identical
    # after three AdamW steps, and moved by them
    assert torch.equal(r0["wte"], r1["wte"])
    assert not torch.equal(r0["wte"], reference["wte0"])
    # --json keeps what the reporting rank printed; --replot draws the loss curve from it
    logged = json.loads(log.read_text())
    assert logged["steps"] == last["history"] and [tuple(v) for v in logged["val"]] == last["val"]
    assert logged["summary"]["steps"] == 3 and logged["summary"]["tokens_per_step"] == 8 * 16
    png = tmp_path / "loss.png"
    assert _example().main(["--replot", str(log), "--loss-curve", str(png)]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.slow
def test_v_schedule_shares_one_parameter_on_rank_zero(zbpp_workers, reference):
    results = zbpp_workers(2).run(train_on_rank, ["--schedule", "zb-v", *TINY])
    last = _check_run(results, reference, "zb-v")
    r0, r1 = results
    assert last is r0 and r0["stages"] == [0, 3] and r1["stages"] == [1, 2]
    assert r0["wte_shared"] and r1["wte"] is None  # one nn.Parameter in both stage modules of rank 0
    assert not torch.equal(r0["wte"], reference["wte0"])


def _poisoned_run(where: str, rank: int) -> Any:
    """The example's `Run` with a NaN put on `rank`: its step's loss ("loss"), its first parameter's
    gradient after the step ("grad"), or an element of its tied embedding copy before the copies
    are compared ("wte")."""
    ex = _example()

    class Poisoned(ex.Run):
        def __init__(self, args: Any) -> None:
            super().__init__(args)
            step = self.pipe.step

            def poisoned_step(*args: Any, **kwargs: Any) -> Any:
                loss = step(*args, **kwargs)
                if where == "grad":  # not the tied embedding's: the tied copies' check would see it
                    next(p for p in self.pipe.parameters() if p is not self.wte).grad.fill_(math.nan)
                return loss * math.nan if where == "loss" else loss

            if self.rank == rank:
                self.pipe.step = poisoned_step

        def check_tied_copies(self) -> None:
            if where == "wte" and self.rank == rank:
                with torch.no_grad():
                    self.wte[0, 0] = math.nan
            super().check_tied_copies()

    return Poisoned


# one step, one validation batch (argparse keeps an option's last value)
ONE_STEP = ["--schedule", "zb-h1", *TINY, "--steps", "1", "--eval-batches", "1"]


def _check_with_a_nan_on_rank(where: str, rank: int) -> dict[str, Any]:
    """This rank's ``check`` after one --check step with `_poisoned_run`'s NaN."""
    ex = _example()
    run, ex.Run = ex.Run, _poisoned_run(where, rank)
    try:
        return train_on_rank(ONE_STEP)["check"]
    finally:
        ex.Run = run


def _exit_code_with_a_nan_on_rank(where: str, rank: int) -> int:
    """The exit code of one step without --check, with `_poisoned_run`'s NaN."""
    ex = _example()
    run, ex.Run = ex.Run, _poisoned_run(where, rank)
    try:
        return ex.main([a for a in ONE_STEP if a != "--check"])
    finally:
        ex.Run = run


@pytest.mark.parametrize("where, rank", [("", 1), ("loss", 1), ("grad", 0), ("wte", 1)])
def test_check_fails_on_every_rank_for_a_nan_on_any_rank(zbpp_workers, where: str, rank: int):
    """A NaN loss (rank 1 holds the last stage), gradient or tied copy made --check say OK: the
    gradient error was kept with Python's max (max(0.0, nan) is 0.0), and the ranks' figures were
    combined with gloo's MAX/MIN, which drop a NaN met as their second operand. Each must be a MISMATCH on
    both ranks; with no NaN (""), OK."""
    checks = zbpp_workers(2).run(_check_with_a_nan_on_rank, where, rank)
    assert [c["ok"] for c in checks] == [where == ""] * 2, checks


@pytest.mark.parametrize("where, status", [("", 0), ("loss", 1)])
def test_a_loss_that_is_not_finite_fails_the_run_on_every_rank(zbpp_workers, where: str, status: int):
    """Without --check, a NaN loss (on rank 1, the last stage's) printed "loss nan" and exited 0 on
    both ranks; train_hf.py exits 1 there. Now 1 on both ranks; 0 without the NaN."""
    assert zbpp_workers(2).run(_exit_code_with_a_nan_on_rank, where, 1) == [status, status]


def test_fp8_is_refused_on_cpu_ranks(capsys):
    with pytest.raises(SystemExit) as exc:
        _example().parse_args(["--fp8", "--backend", "gloo"])
    assert exc.value.code == 2
    assert "--fp8 needs CUDA GPUs" in capsys.readouterr().err


@pytest.mark.parametrize("argv, words", [
    (["--warmup", "-5"], "--warmup must be >= 0"),  # else lr_at starts the cosine decay part-way
    (["--min-lr-ratio", "-0.5"], "--min-lr-ratio must be in [0, 1]"),  # else the last steps' lr is negative
    (["--min-lr-ratio", "2"], "--min-lr-ratio must be in [0, 1]"),  # else the decay climbs above --lr
])
def test_learning_rate_flags_are_checked(capsys, argv, words):
    with pytest.raises(SystemExit):
        _example().parse_args([*argv, "--backend", "gloo"])
    assert words in capsys.readouterr().err


@pytest.mark.parametrize("argv, want", [
    (["--warmup", "0", "--min-lr-ratio", "0"], [1e-2, 5e-3, 0.0]),  # cos 0, cos pi/2, cos pi: 0 on the last step
    (["--warmup", "2", "--min-lr-ratio", "0.2"], [5e-3, 1e-2, 2e-3]),  # half, the peak, then the floor at once
])
def test_learning_rate_reaches_its_floor_on_the_last_step(argv: list[str], want: list[float]):
    """Three steps at --lr 1e-2, hand-worked: the decay used to aim at step --steps, which never
    runs, so the last step's rate was 2.5e-3 (cos 2pi/3), not the --min-lr-ratio floor."""
    ex = _example()
    args = ex.parse_args([*argv, "--steps", "3", "--lr", "1e-2", "--backend", "gloo"])
    got = [ex.lr_at(step, args) for step in range(3)]
    assert got == pytest.approx(want, rel=1e-12, abs=1e-18)  # float rounding only (0 is cos pi's 1e-16 off)


@pytest.mark.parametrize("extra, named", [
    (["--json", "out.json"], "--json"),
    (["--check", "--steps", "300"], "--steps, --check"),  # --steps typed at its default: still given
    (["--trace", "t.json", "--schedule", "zb-v"], "--schedule, --trace"),
])
def test_replot_refuses_training_flags(tmp_path, capsys, extra, named):
    """--replot draws the loss curve of an earlier run and trains nothing: training flags given with
    it were silently ignored (no JSON written, nothing checked); now an error naming them."""
    with pytest.raises(SystemExit) as exc:
        _example().parse_args(["--replot", "steps.json", "--loss-curve", str(tmp_path / "l.png"), *extra])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert f"{named} apply to training" in err, err
    (tmp_path / "steps.json").write_text("{}")
    args = _example().parse_args(["--replot", str(tmp_path / "steps.json"), "--loss-curve", str(tmp_path / "l.png")])
    assert args.replot == str(tmp_path / "steps.json")  # alone, as before


@pytest.mark.parametrize("argv, words", [
    (["--json", "missing/steps.json"], "--json missing/steps.json: the folder {tmp}/missing does not exist"),
    (["--trace", "."], "--trace .: that is a folder; give a file name"),
    (["--loss-curve", "missing/l.png"], "--loss-curve missing/l.png: the folder {tmp}/missing does not exist"),
    (["--replot", "steps.json", "--loss-curve", "l.png"], "--replot steps.json: no such file"),
])
def test_an_output_that_cannot_be_written_is_refused_before_training(argv, words, tmp_path, monkeypatch, capsys):
    """--json, --trace and --loss-curve are written after the last step: a folder that does not exist
    failed the run with a traceback once every step had run (on the reporting rank, or on rank 0 for
    --trace); --replot of a file that does not exist ended in a FileNotFoundError traceback."""
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as exc:
        _example().parse_args([*argv, "--backend", "gloo"] if "--replot" not in argv else argv)
    assert exc.value.code == 2
    assert words.format(tmp=tmp_path) in capsys.readouterr().err
