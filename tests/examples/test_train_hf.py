"""examples/train_hf.py on 2 gloo CPU ranks: a Llama and a GPT-2 from their configs train for a few
steps, the loss falls, one rank prints a progress line per step, and the first step's loss is HF's
own on the same batch with the same weights.

The reference builds the same weights in one process: `causal_lm_stages` on a one-stage schedule
with the same seed (a parameter's initial value depends only on the seed and its name, and a tied
weight takes its first module's, as the pipeline makes its copies), loaded into HF's model; its
``model(input_ids, attention_mask=..., labels=...).loss`` is computed in float32 by HF, so the
float64 pipeline's first loss agrees to rtol 1e-6 (a wrong init, mask or shift moves it by 1e-2+).
"""

from __future__ import annotations

import inspect
import math
import re
from pathlib import Path
from typing import Any

import pytest
import torch

from .loader import load_example, train_example

transformers = pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parents[2]
HF_LOSS_RTOL = 1e-6  # see the module docstring
# float64 replicas against one replica on the whole batch: the same gradients summed in another order,
# through 6 AdamW steps (measured: 2e-16 to 4e-16); a gradient not averaged, or a tie kept apart, moves them by 1e-3+
SAME_TRAINING_RTOL = 1e-9
TINY = ["--hidden", "32", "--heads", "4", "--layers", "4", "--seq-len", "16", "--rows-per-microbatch", "2",
        "--microbatches", "4", "--steps", "6", "--lr", "1e-2", "--warmup", "2",
        "--dtype", "float64", "--backend", "gloo", "--timeout", "60"]
TEXT = ["--data", "stdlib", "--data-bytes", "60000"]  # a little of the standard library's text (not with synthetic)


def _example() -> Any:
    return load_example("train_hf")


def train_on_rank(argv: list[str]) -> dict[str, Any]:
    return train_example("train_hf", argv)


def initial_model(argv: list[str]) -> Any:
    """HF's model with the weights the example's ranks start from (see the module docstring)."""
    from zbpp.models.hf import causal_lm_stages
    from zbpp.schedules import build

    ex = _example()
    args = ex.parse_args(argv)
    config = ex.make_config(args, ex.Batches(args).vocab)
    one = build("1f1b", num_ranks=1, num_microbatches=1)
    # the experts as a loop: HF's grouped matmul takes no float64 (any family takes the keyword)
    stages, _ = causal_lm_stages(config, one, 0, dtype=torch.float64, attn_implementation=args.attn, seed=args.seed,
                                 device="cpu", experts_implementation="eager")
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation=args.attn, dtype=torch.float64,
                                                          experts_implementation="eager")
    model.load_state_dict(stages[0].state_dict())
    return model


def first_loss_of_hf(argv: list[str]) -> float:
    ex = _example()
    model = initial_model(argv)
    ids, mask, labels = ex.Batches(ex.parse_args(argv))(0)
    with torch.no_grad():
        return float(model(input_ids=ids, attention_mask=mask, labels=labels).loss)


def _check(results: list[dict[str, Any]], argv: list[str], steps: int) -> dict[str, Any]:
    last = next(r for r in results if r["history"])
    losses = [h["loss"] for h in last["history"]]
    assert [h["step"] for h in last["history"]] == list(range(1, steps + 1))
    assert all(math.isfinite(v) for v in losses), losses
    # trains: ~4.9 -> ~4.0 in six steps on text, 4.18 -> 3.89 on GPT-2's synthetic tokens (the learning
    # rate at its 10% floor on the last step)
    assert losses[-1] < losses[0] - 0.2, losses
    text = last["stdout"]
    assert text.startswith("train_hf: ") and text.count("| loss ") == steps and "tok/s" in text, text
    assert any(line.startswith(f"done: {steps} steps") for line in text.splitlines()), text
    assert all(r["stdout"] == "" for r in results if r is not last)
    return last


@pytest.mark.slow
def test_llama_trains_from_config_and_starts_at_hf_loss(zbpp_workers):
    argv = ["--model", "llama", "--schedule", "zb-v", *TINY, *TEXT]
    results = zbpp_workers(2).run(train_on_rank, argv)
    last = _check(results, argv, 6)
    assert [r["stages"] for r in results] == [[0, 3], [1, 2]]
    assert last["history"][0]["loss"] == pytest.approx(first_loss_of_hf(argv), rel=HF_LOSS_RTOL, abs=0)


@pytest.mark.slow
def test_gpt2_trains_with_the_tie_across_ranks_and_ragged_rows(zbpp_workers):
    argv = ["--model", "gpt2", "--schedule", "1f1b", "--data", "synthetic", *TINY]
    results = zbpp_workers(2).run(train_on_rank, argv)
    last = _check(results, argv, 6)
    assert [r["tied"] for r in results] == [["transformer.wte.weight"]] * 2  # found without being named
    assert last["history"][0]["loss"] == pytest.approx(first_loss_of_hf(argv), rel=HF_LOSS_RTOL, abs=0)
    # right-padded rows of random lengths, attention_mask and labels -100 on the padding
    argv = ["--model", "gpt2", "--schedule", "1f1b", "--ragged", "--data", "synthetic", *TINY]
    last = _check(zbpp_workers(2).run(train_on_rank, argv), argv, 6)
    from zbpp import Pipeline

    if "loss_weight" in inspect.signature(Pipeline).parameters:  # token-weighted microbatches: HF's mean
        assert last["history"][0]["loss"] == pytest.approx(first_loss_of_hf(argv), rel=HF_LOSS_RTOL, abs=0)


@pytest.mark.slow
@pytest.mark.parametrize("model, schedule, fsdp", [("llama", "zb-v", False), ("gpt2", "zb-v", True),
                                                   ("gpt2", "1f1b", True)])
def test_replicas_train_on_their_share_and_start_at_hf_loss(tmp_path: Path, zbpp_workers, model: str, schedule: str,
                                                            fsdp: bool):
    """--dp 2 on 4 ranks (2 replicas of a 2-rank pipeline), with --fsdp each stage sharded over them:
    the first step's loss, averaged over the replicas, is HF's on the whole batch (full rows: every
    replica's mean is over as many tokens), and every step's loss is that of one replica training on
    the whole batch (its microbatches twice the rows), to SAME_TRAINING_RTOL: the same gradients,
    summed in another order. GPT-2's tied embedding stays tied within rank 0 (zb-v) or across the
    ranks (1f1b) when fully_shard replaces it (`causal_lm_stages`' own tied_parameters as they are).
    Both runs write their trained model (--save-pretrained): HF loads the two as the same model, each
    tensor to SAME_TRAINING_RTOL of its largest value (measured: 3e-13 at most; a shard or a tied copy
    written from the wrong rank differs by far more)."""
    argv = ["--model", model, "--schedule", schedule, "--dp", "2", *(["--fsdp"] if fsdp else []), *TINY, *TEXT,
            "--save-pretrained", str(tmp_path / "replicas")]
    results = zbpp_workers(4).run(train_on_rank, argv)
    last = _check(results, argv, 6)
    assert last["stdout"].startswith(f"train_hf: {model} ") and f"2 ranks x 2 replicas{' (FSDP)' if fsdp else ''}" \
        in last["stdout"].splitlines()[0], last["stdout"]
    assert last["history"][0]["loss"] == pytest.approx(first_loss_of_hf(argv), rel=HF_LOSS_RTOL, abs=0)
    one = ["--model", model, "--schedule", schedule, *TINY, *TEXT, "--save-pretrained", str(tmp_path / "one")]
    one[one.index("--rows-per-microbatch") + 1] = "4"  # TINY's 2 rows per replica, twice
    whole = _check(zbpp_workers(2).run(train_on_rank, one), one, 6)
    assert [h["loss"] for h in last["history"]] == pytest.approx([h["loss"] for h in whole["history"]],
                                                                  rel=SAME_TRAINING_RTOL, abs=0)
    a, b = (transformers.AutoModelForCausalLM.from_pretrained(tmp_path / d, dtype=torch.float64).state_dict()
            for d in ("replicas", "one"))
    assert a.keys() == b.keys()
    for name, t in b.items():
        torch.testing.assert_close(a[name], t, rtol=0, atol=SAME_TRAINING_RTOL * float(t.abs().max()), msg=name)
    start = initial_model(argv).state_dict()  # the trained weights were written, not the initial ones
    assert all(not torch.allclose(t, start[n], rtol=1e-3, atol=0) for n, t in b.items() if t.dim() == 2), \
        [n for n, t in b.items() if torch.allclose(t, start[n], rtol=1e-3, atol=0)]


@pytest.mark.slow
def test_replicas_with_ragged_rows_log_the_token_mean_of_the_whole_batch(zbpp_workers):
    """--dp 2 --ragged: the replicas' rows hold different numbers of tokens, so the step's loss (the
    one its gradient is of: tokens weighed over every replica) is not the mean of the replicas'
    means. The first logged loss is HF's on the whole batch (to HF_LOSS_RTOL, see the module
    docstring) and every step's is that of one replica training on the whole batch (to
    SAME_TRAINING_RTOL); the replicas' mean of means is off by 4e-5 here (measured)."""
    argv = ["--model", "llama", "--schedule", "1f1b", "--dp", "2", "--ragged", "--data", "synthetic", *TINY]
    last = _check(zbpp_workers(4).run(train_on_rank, argv), argv, 6)
    assert last["history"][0]["loss"] == pytest.approx(first_loss_of_hf(argv), rel=HF_LOSS_RTOL, abs=0)
    one = ["--model", "llama", "--schedule", "1f1b", "--ragged", "--data", "synthetic", *TINY]
    one[one.index("--rows-per-microbatch") + 1] = "4"  # TINY's 2 rows per replica, twice: the same batch
    whole = _check(zbpp_workers(2).run(train_on_rank, one), one, 6)
    assert [h["loss"] for h in last["history"]] == pytest.approx([h["loss"] for h in whole["history"]],
                                                                  rel=SAME_TRAINING_RTOL, abs=0)


@pytest.mark.parametrize("argv, words", [(["--fsdp"], "--fsdp shards each stage over the data-parallel replicas"),
                                         (["--dp", "0"], "--dp must be >= 1"),
                                         # else clipping is quietly off (0 is the documented "off")
                                         (["--clip", "-1"], "--clip must be >= 0"),
                                         (["--clip", "nan"], "--clip must be >= 0"),
                                         # else the rendezvous fails at once with a C++ trace on every rank
                                         (["--timeout", "0"], "--timeout must be a finite number of seconds > 0"),
                                         # else AdamW refuses it only after every rank built its stages
                                         (["--lr", "nan"], "--lr must be a finite number >= 0, got nan"),
                                         # else the cosine decay starts part-way (lr_at)
                                         (["--warmup", "-5"], "--warmup must be >= 0"),
                                         # synthetic rows read no text: the bound would be silently ignored
                                         (["--data", "synthetic", "--data-bytes", "1000"],
                                          "--data-bytes bounds the text of --data stdlib; --data synthetic reads none"),
                                         # else load_text's buf[:-5] quietly drops the text's last 5 bytes
                                         (["--data-bytes", "-5"], "--data-bytes must be >= 1, got -5"),
                                         # else the first step fails inside HF's grouped matmul
                                         (["--experts", "grouped_mm", "--dtype", "float64"],
                                          "--experts grouped_mm takes 16- and 32-bit floats, not --dtype float64")])
def test_dp_and_fsdp_arguments_are_checked(capsys, argv: list[str], words: str):
    with pytest.raises(SystemExit):
        _example().parse_args(argv)
    assert words in capsys.readouterr().err


@pytest.mark.parametrize("steps, step, want", [
    (40, 0, 6e-4),     # the defaults (--lr 3e-3, --warmup 5): the first warm-up step is 1/5 of the peak
    (40, 4, 3e-3),     # the warm-up's last step is at the peak
    (40, 39, 3e-4),    # the last step is at the floor, 10% of the peak (it stopped at 3.05e-4)
    (41, 22, 1.65e-3),  # halfway from the peak (step 4) to the last step (40): 0.1 + 0.9 / 2 of the peak
])
def test_learning_rate_runs_from_the_peak_to_its_floor_on_the_last_step(steps: int, step: int, want: float):
    """The help's schedule, hand-worked: linear warm-up to --lr, then cosine decay to 10% of it by
    the last step (step --steps - 1: the decay used to aim at step --steps, which never runs)."""
    args = _example().parse_args(["--steps", str(steps), "--data", "synthetic"])
    assert _example().lr_at(step, args) == pytest.approx(want, rel=1e-12)  # float rounding only


def _exit_code_with_a_nan_loss_on_rank_one(nan: bool) -> int:
    """`main` for one step of TINY under zb-h1, the loss of rank 1 (the last stage's) NaN if `nan`."""
    from zbpp import Pipeline

    class NaNLoss(Pipeline):
        def step(self, *args: Any, **kwargs: Any) -> Any:
            loss = super().step(*args, **kwargs)
            return loss * math.nan if nan and loss is not None else loss

    ex = _example()
    ex.Pipeline = NaNLoss
    try:
        return ex.main([*TINY, "--data", "synthetic", "--steps", "1"])  # argparse keeps the last --steps
    finally:
        ex.Pipeline = Pipeline


@pytest.mark.parametrize("nan, status", [(False, 0), (True, 1)])
def test_a_loss_that_is_not_finite_fails_the_run_on_every_rank(zbpp_workers, nan: bool, status: int) -> None:
    """A NaN loss exited 1 on the rank that prints the losses only, 0 on the others."""
    assert zbpp_workers(2).run(_exit_code_with_a_nan_loss_on_rank_one, nan) == [status, status]


def _newest_checkpoint_seen(root: str) -> str:
    """`agreed_checkpoint` on a rank whose view of --checkpoint-dir holds step-(rank + 1) (as on
    node-local disks): what it raised."""
    import torch.distributed as dist

    directory = Path(root) / "same-name"
    ex = _example()
    latest = ex.latest_checkpoint
    ex.latest_checkpoint = lambda d: latest(Path(root) / f"rank{dist.get_rank()}")  # this rank's own view
    (Path(root) / f"rank{dist.get_rank()}" / f"step-{dist.get_rank() + 1}").mkdir(parents=True)
    try:
        ex.agreed_checkpoint(str(directory), torch.device("cpu"))
    except SystemExit as exc:
        return str(exc)
    finally:
        ex.latest_checkpoint = latest
    return "resumed"


def test_ranks_that_see_different_checkpoints_refuse_to_resume(tmp_path: Path, zbpp_workers) -> None:
    """A --checkpoint-dir that is not shared: each rank found its own newest checkpoint and loaded
    it, a mix of steps; now every rank stops, naming both steps."""
    said = zbpp_workers(2).run(_newest_checkpoint_seen, str(tmp_path))
    assert all("the ranks see different newest checkpoints (from step 1 to step 2" in s for s in said), said


def test_a_checkpoint_past_steps_is_refused(tmp_path: Path, capsys) -> None:
    """--checkpoint-dir holding step-5 with --steps 3: resuming would train nothing and exit 0
    (and --save-pretrained write the 5-step model); step-3 itself resumes as the finished run."""
    (tmp_path / "step-5").mkdir()
    with pytest.raises(SystemExit):
        _example().parse_args(["--checkpoint-dir", str(tmp_path), "--steps", "3"])
    assert f"--checkpoint-dir {tmp_path} holds step-5, past --steps 3" in capsys.readouterr().err
    assert _example().parse_args(["--checkpoint-dir", str(tmp_path), "--steps", "5"]).steps == 5


@pytest.mark.parametrize("argv, words", [
    (["--from", "some/dir", "--layers", "8", "--hidden", "64"],
     "--from some/dir takes the model from its config.json: drop --hidden --layers"),
    (["--model", "gpt2", "--kv-heads", "2"], "--kv-heads: gpt2 has no grouped-query attention"),
    (["--hidden", "30"], "--hidden 30 must be a multiple of --heads 4"),
])
def test_model_flags_are_checked(capsys, argv: list[str], words: str):
    """A model-shape flag is refused where it would be ignored: with --from (the directory's config
    decides) or --kv-heads for a family without grouped-query attention."""
    with pytest.raises(SystemExit):
        _example().parse_args(argv)
    assert words in capsys.readouterr().err


@pytest.mark.parametrize("where", ["my_model", "path/to/hf_dir", "empty"])
def test_from_a_path_that_is_no_model_directory_is_refused_at_once(where: str, tmp_path: Path, capsys,
                                                                    monkeypatch) -> None:
    """--from DIR names a local directory: one that does not exist (a typo) or lacks config.json went
    to transformers' AutoConfig.from_pretrained, which took it for a Hub repo id: without a network
    every rank retried for about 25 s and ended in a traceback about connecting to huggingface.co
    (or about the repo id's form). It is refused while parsing, naming the path."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "empty").mkdir()
    with pytest.raises(SystemExit) as exc:
        _example().parse_args(["--from", where])
    assert exc.value.code == 2
    assert f"--from {where}: not a local Hugging Face model directory (it has no config.json)" in capsys.readouterr().err


@pytest.mark.parametrize("flag", ["--save-pretrained", "--checkpoint-dir"])
def test_an_output_folder_that_is_a_file_is_refused_before_training(flag: str, tmp_path: Path, capsys) -> None:
    """--save-pretrained and --checkpoint-dir name folders: an existing file there was found only when
    the first checkpoint, or the model after the last step, was written. Refused while parsing."""
    (tmp_path / "out").write_text("a file")
    with pytest.raises(SystemExit) as exc:
        _example().parse_args([flag, str(tmp_path / "out")])
    assert exc.value.code == 2
    assert f"{flag} {tmp_path / 'out'}: that is a file; give a folder" in capsys.readouterr().err


def test_a_sequence_longer_than_the_pretrained_model_s_positions_is_refused(tmp_path: Path) -> None:
    """--from a GPT-2 of 16 learned positions with --seq-len 32: every rank built its stages and the
    first forward failed on rank 0 with "IndexError: index out of range in self" (every other rank a
    PipelineError quoting it), which does not say what was out of range. Refused before the model is
    built, naming both lengths."""
    config = transformers.GPT2Config(vocab_size=64, n_embd=16, n_layer=2, n_head=2, n_positions=16)
    config.save_pretrained(tmp_path)
    ex = _example()
    with pytest.raises(SystemExit, match=f"--seq-len 32 is longer than the 16 positions of --from {tmp_path}"):
        ex.model_source(ex.parse_args(["--from", str(tmp_path), "--seq-len", "32"]), 64)
    assert ex.model_source(ex.parse_args(["--from", str(tmp_path), "--seq-len", "16"]), 64)[0] == str(tmp_path)


def test_from_a_multimodal_directory_reads_its_text_config(tmp_path: Path) -> None:
    """--from a Qwen3.5 or Llama 4 directory as HF saves the whole multimodal model: its config.json
    keeps the vocabulary, positions and layers in text_config, and the run failed before building
    anything with "AttributeError: 'Qwen3_5Config' object has no attribute 'vocab_size'" (causal_lm_stages
    builds the causal LM from such a directory). Its text config's sizes are now checked and used."""
    from zbpp.models.hf import small_config

    small_config("llama4", vocab_size=64, hidden_size=32, num_layers=3, max_positions=16).save_pretrained(tmp_path)
    ex = _example()
    with pytest.raises(SystemExit, match=f"--seq-len 32 is longer than the 16 positions of --from {tmp_path}"):
        ex.model_source(ex.parse_args(["--from", str(tmp_path), "--seq-len", "32"]), 64)
    with pytest.raises(SystemExit, match=r"its vocabulary \(64\) is smaller than the data's \(128\)"):
        ex.model_source(ex.parse_args(["--from", str(tmp_path), "--seq-len", "16"]), 128)
    source, config = ex.model_source(ex.parse_args(["--from", str(tmp_path), "--seq-len", "16"]), 64)
    assert (source, config.num_hidden_layers, config.hidden_size) == (str(tmp_path), 3, 32)


@pytest.mark.slow
def test_from_pretrained_directory_starts_at_its_loss(tmp_path: Path, zbpp_workers) -> None:
    """--from DIR: the stages start from the directory's weights (read per rank). The first step's
    loss is HF's own loss of the saved model on the same batch, to HF_LOSS_RTOL (random weights
    instead of the saved ones move it by 1e-2 or more)."""
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                                      num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)
    torch.manual_seed(21)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float64, attn_implementation="sdpa")
    model.save_pretrained(tmp_path / "hf", max_shard_size="30KB")
    argv = ["--from", str(tmp_path / "hf"), "--schedule", "zb-v", "--seq-len", "16", "--rows-per-microbatch", "2",
            "--microbatches", "4", "--steps", "1", "--data", "synthetic", "--dtype", "float64", "--backend", "gloo",
            "--timeout", "60"]
    results = zbpp_workers(2).run(train_on_rank, argv)  # the pool the other cases use
    first = next(r for r in results if r["history"])["history"][0]["loss"]

    ex = _example()
    args = ex.parse_args(argv)
    ids, mask, labels = ex.Batches(args)(0)
    with torch.no_grad():
        want = float(model(input_ids=ids, attention_mask=mask, labels=labels).loss)
    assert first == pytest.approx(want, rel=HF_LOSS_RTOL, abs=0)


@pytest.mark.parametrize("model", ["llama", "gpt2", "from"])
def test_experts_for_a_model_without_experts_is_refused(model: str, tmp_path: Path) -> None:
    """--experts picks the expert layers of a mixture of experts; for a model without any (a Llama,
    a GPT-2, a --from directory of a dense model) HF ignored it and the run trained as if it were
    not given. Refused before the model is built, naming the flag; a Mixtral takes it."""
    ex = _example()
    if model == "from":
        transformers.LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                                 num_attention_heads=2, max_position_embeddings=64).save_pretrained(tmp_path)
        argv, what = ["--from", str(tmp_path)], f"--from {tmp_path} (LlamaForCausalLM)"
    else:
        argv, what = ["--model", model], f"--model {model}"
    with pytest.raises(SystemExit, match=r"--experts eager: " + re.escape(what) + ".* no mixture-of-experts layers"):
        ex.model_source(ex.parse_args([*argv, "--experts", "eager", "--data", "synthetic"]), 64)
    config = ex.model_source(ex.parse_args(["--model", "mixtral", "--experts", "eager", "--data", "synthetic"]), 64)[1]
    assert config.model_type == "mixtral"


def _saved_llama(where: Path, dtype: torch.dtype) -> Any:
    """A tiny Llama saved to `where` in `dtype` (config.json then names it); the model, in float64."""
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                                      num_attention_heads=2, max_position_embeddings=64)
    torch.manual_seed(3)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float64, attn_implementation="sdpa")
    model.to(dtype).save_pretrained(where)
    return model.double()


@pytest.mark.parametrize("saved", [torch.float64, torch.bfloat16])
def test_from_trains_in_the_checkpoint_dtype_unless_dtype_is_given(saved: torch.dtype, tmp_path: Path) -> None:
    """--from DIR without --dtype fine-tuned in float32 on CPUs (bfloat16 on GPUs) whatever the
    checkpoint's dtype, where causal_lm_stages(DIR) and from_pretrained(dtype="auto") take the
    weights' own. Now the weights' dtype (config.json's, else the safetensors'), --dtype if given."""
    ex = _example()
    _saved_llama(tmp_path, saved)
    cpu, gpu = torch.device("cpu"), torch.device("cuda", 0)  # only compared, nothing allocated on it
    assert ex.train_dtype(ex.parse_args(["--from", str(tmp_path)]), cpu) == saved
    assert ex.train_dtype(ex.parse_args(["--from", str(tmp_path)]), gpu) == saved
    assert ex.train_dtype(ex.parse_args(["--from", str(tmp_path), "--dtype", "float32"]), cpu) == torch.float32
    (tmp_path / "config.json").write_text(re.sub(r'"dtype": "\w+",?', "", (tmp_path / "config.json").read_text()))
    assert transformers.AutoConfig.from_pretrained(tmp_path).dtype is None  # the safetensors' dtype decides
    assert ex.train_dtype(ex.parse_args(["--from", str(tmp_path)]), cpu) == saved
    assert ex.train_dtype(ex.parse_args(["--model", "llama"]), cpu) == torch.float32  # no --from: as before
    assert ex.train_dtype(ex.parse_args(["--model", "llama"]), gpu) == torch.bfloat16


def test_from_a_float64_checkpoint_without_dtype_starts_at_its_float64_loss(tmp_path: Path, zbpp_workers) -> None:
    """The run itself (2 gloo ranks, 1f1b, one step): --from a float64 checkpoint without --dtype. Its
    first loss is the saved model's token-mean loss in float64 to 1e-12 (the same operations in float64,
    summed per microbatch); trained in float32, as before, it was off by ~1e-8 of it."""
    from ..models.cases import token_mean_loss

    model = _saved_llama(tmp_path / "hf", torch.float64)
    argv = ["--from", str(tmp_path / "hf"), "--schedule", "1f1b", "--seq-len", "16", "--rows-per-microbatch", "2",
            "--microbatches", "2", "--steps", "1", "--data", "synthetic", "--backend", "gloo", "--timeout", "60"]
    results = zbpp_workers(2).run(train_on_rank, argv)
    first = next(r for r in results if r["history"])["history"][0]["loss"]
    ex = _example()
    ids, mask, labels = ex.Batches(ex.parse_args(argv))(0)
    with torch.no_grad():
        want = float(token_mean_loss(model(input_ids=ids, attention_mask=mask).logits, labels))
    assert first == pytest.approx(want, rel=1e-12, abs=0)
