"""FSDP2 (`fully_shard`) stages under zbpp pipelines: dp=2 x pp=2 on 4 gloo CPU ranks, float64.

Every case (`fsdp_cases.fsdp_case`) checks each parameter's gathered gradient and the parameters
after the optimizer steps against one process running the whole model on the whole batch, and
counts one reduce-scatter per stage per step. The 4 ranks are spawned once for the module.
"""

from __future__ import annotations

import pytest
import torch

from .fsdp_cases import (changed_after_build_case, clip_one_row_case, failure_case, fsdp_worker, fused_bf16_case,
                         mixed_precision_case, refusal_case, tie_drift_case, timing_case, unrecorded_tie_case,
                         unused_on_one_replica_case)

CASES = [f"{s}/{k}" for s in ("1f1b", "zb-h1", "zb-v", "dualpipe-v") for k in ("plain", "delayed")]
CASES += ["zb-h1/delayed/accumulate", "zb-v/plain/accumulate", "zb-v/delayed/clip", "zb-h1/delayed/inner", "zb-h1/fused", "zb-v/fused/accumulate"]
# frozen: a weight and a bias do not train (fused: no main_grad buffer, no zero gradient for AdamW to decay)
CASES += ["zb-h1/fused/frozen/accumulate", "zb-v/delayed/frozen/clip"]
# layers.0.weight tied: to layers.3 (1f1b, zb-h1: stages 0 and 1 on two ranks; zb-v, dualpipe-v: stages
# 0 and 3 on one rank, fully_shard splits the Parameter into one copy per stage) and to layers.2 too
# (a stage of the other rank as well); clip: the norm counts the tied weight once
# (the stages noted by note_parameters; unnoted: found by FSDP's own record, torch 2.13+; stale: named
# by the Parameter before fully_shard)
CASES += ["1f1b/plain/tied", "zb-h1/plain/tied", "zb-h1/delayed/tied/clip", "zb-h1/delayed/tied/accumulate",
          "zb-h1/fused/tied", "zb-h1/delayed/tied/stale", "zb-v/delayed/tied/stale", "zb-v/plain/tied/unnamed", "zb-v/plain/tied/unnamed/unnoted", "zb-v/delayed/tied/clip",
          "dualpipe-v/delayed/tied023"]
FSDP_RECORDS_ORIGINALS = tuple(int(v) for v in torch.__version__.split(".")[:2]) >= (2, 13)
RUN = [c for c in CASES if FSDP_RECORDS_ORIGINALS or "unnoted" not in c]


@pytest.fixture(scope="module")
def results(zbpp_workers) -> dict[str, list[str]]:
    per_rank = zbpp_workers(4, pg_timeout=60).run(fsdp_worker, RUN)
    return {c: [f"rank {r}: {f}" for r, res in enumerate(per_rank) for f in res[c]] for c in RUN}


@pytest.mark.timeout(600)
@pytest.mark.parametrize("case", CASES)
def test_fsdp_pipeline(results: dict[str, list[str]], case: str) -> None:
    if case not in results:
        pytest.skip(f"torch {torch.__version__}'s FSDP does not record the Parameter a shard came from")
    assert not results[case], "\n".join(results[case])


@pytest.mark.timeout(600)
@pytest.mark.parametrize("schedule, kind", [("zb-h1", "fused"), ("zb-v", "delayed")])
def test_mixed_precision(zbpp_workers, schedule: str, kind: str) -> None:
    """float32 compute of float64 shards, float64 reduce-scatters (`mixed_precision_case`)."""
    per_rank = zbpp_workers(4, pg_timeout=60).run(mixed_precision_case, schedule, kind)
    _assert_no_fails(per_rank)


@pytest.mark.timeout(600)
def test_fused_main_grad_reduced_unrounded(zbpp_workers) -> None:
    """bfloat16 compute, float32 reduce: a fused Linear's float32 main_grad joins FSDP's float32
    reduction unrounded (`fused_bf16_case`)."""
    per_rank = zbpp_workers(4, pg_timeout=60).run(fused_bf16_case, "zb-h1")
    _assert_no_fails(per_rank)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("schedule", ["zb-h1", "zb-v"])
def test_branch_taken_by_one_replica_only(zbpp_workers, schedule: str) -> None:
    """Parameters with a gradient on one replica only (`unused_on_one_replica_case`)."""
    per_rank = zbpp_workers(4, pg_timeout=60).run(unused_on_one_replica_case, schedule)
    _assert_no_fails(per_rank)


@pytest.mark.timeout(600)
def test_clip_with_an_empty_shard(zbpp_workers) -> None:
    """A one-element Parameter sharded over 2 replicas (empty on replica 1): the inf-norm and the
    2-norm clip as torch in one process does (`clip_one_row_case`)."""
    per_rank = zbpp_workers(4, pg_timeout=60).run(clip_one_row_case)
    _assert_no_fails(per_rank)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("schedule", ["zb-h1", "zb-v"])
def test_reduce_scatter_after_last_w(zbpp_workers, schedule: str) -> None:
    """Each stage's reduce-scatter is launched after its last W and before the step returns."""
    per_rank = zbpp_workers(4, pg_timeout=60).run(timing_case, schedule)
    _assert_no_fails(per_rank)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("microbatch, no_sync, tie", [(0, False, ()), (2, False, ()), (2, True, ()), (2, False, (3,))])
def test_failed_step_leaves_fsdp_usable(zbpp_workers, microbatch: int, no_sync: bool, tie: tuple[int, ...]) -> None:
    """A step that fails on one replica (before any of its backward, or midway; inside no_sync or
    not; with a weight tied across the ranks) raises everywhere; the next steps match the reference
    as if the failed one never ran."""
    per_rank = zbpp_workers(4, pg_timeout=60).run(failure_case, "zb-h1", microbatch, no_sync, tie)
    _assert_no_fails(per_rank)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("what, words", [
    ("inner-only", "call fully_shard(stage_module"),
    ("one-call", "were sharded by one fully_shard call"),
    ("tied-half-sharded", "is sharded by fully_shard on global ranks [0, 2] but not on [1, 3]"),
    ("noted-partly", "were noted by note_parameters but stages"),
    ("noted-late", "is sharded already; call it before fully_shard"),
    ("graphs", "cannot capture fully_shard stages (FSDP all-gathers"),
    ("noted-then-untied", "the stages' Parameters changed between note_parameters and fully_shard"),
])
def test_refused_with_a_clear_error(zbpp_workers, what: str, words: str) -> None:
    if what == "noted-then-untied" and not FSDP_RECORDS_ORIGINALS:
        pytest.skip(f"torch {torch.__version__}'s FSDP does not record the Parameter a shard came from")
    messages = zbpp_workers(4, pg_timeout=60).run(refusal_case, what)
    assert all(words in msg for msg in messages), messages


@pytest.mark.timeout(600)
def test_unnoted_tie_is_found_or_warned_of(zbpp_workers) -> None:
    """A weight that two stages of a rank shared before fully_shard, neither noted nor named: torch
    2.13+ FSDP's record finds it (no warning, the copies stay equal after a step; the "unnoted" cases
    check the values); an older FSDP records nothing, and every rank warns, naming note_parameters,
    while each stage trains its own copy (as the module docstring of zbpp.runtime.fsdp says)."""
    per_rank = zbpp_workers(4, pg_timeout=60).run(unrecorded_tie_case)
    assert sum(equal is not None for _, equal in per_rank) == 2, per_rank  # pipeline rank 0's two replicas
    for rank, (said, equal) in enumerate(per_rank):
        if FSDP_RECORDS_ORIGINALS:
            assert not said and equal is not False, (rank, said, equal)
        else:  # the copies' gradients differ (layer 0's use and layer 3's), so do their updates
            assert len(said) == 1 and "note_parameters(stages)" in said[0] and equal is not True, (rank, said, equal)


def test_parameter_replaced_after_build_is_refused(zbpp_workers) -> None:
    """`changed_after_build_case`: FSDP's unsharded parameters, left in the modules by a forward
    outside the steps, train as the sharded ones; a Parameter replaced after the Pipeline was
    built (FSDP would neither shard nor reduce it) is refused on every rank, naming it."""
    per_rank = zbpp_workers(4, pg_timeout=60).run(changed_after_build_case)
    assert all(r[-1] and not r[:-1] for r in per_rank), per_rank
    assert all("stage 1: parameter 'layers.2.bias' is new since the Pipeline was built" in r[-1] for r in per_rank), per_rank


def test_noted_stages_pickle_and_copy_with_their_shared_names() -> None:
    """`note_parameters` marks modules with weak references to their Parameters: a stage saved whole
    (``torch.save(module)``) or deep-copied keeps which names were one Parameter (one note object
    for both), without the link to the original."""
    import copy
    import io

    from torch import nn

    from zbpp.runtime.fsdp import note_parameters

    emb, head = nn.Embedding(4, 2), nn.Linear(2, 4, bias=False)
    head.weight = emb.weight
    note_parameters({0: emb, 3: head})
    assert emb._zbpp_original_parameters["weight"].ref() is emb.weight
    buf = io.BytesIO()
    torch.save({0: emb, 3: head}, buf)
    buf.seek(0)
    for got in (torch.load(buf, weights_only=False), copy.deepcopy({0: emb, 3: head})):
        a, b = got[0]._zbpp_original_parameters["weight"], got[3]._zbpp_original_parameters["weight"]
        assert a is b and a.ref() is None and a.name == "stage 0: weight"


@pytest.mark.timeout(600)
@pytest.mark.parametrize("schedule, holders", [
    ("zb-h1", "global rank 0 stage 0 ('layers.0.weight'), global rank 1 stage 1 ('layers.3.weight'), global rank 2 "
              "stage 0 ('layers.0.weight'), global rank 3 stage 1 ('layers.3.weight')"),
    ("zb-v", "global rank 0 stage 0 ('layers.0.weight'), global rank 0 stage 3 ('layers.3.weight'), global rank 2 "
             "stage 0 ('layers.0.weight'), global rank 2 stage 3 ('layers.3.weight')"),
])
def test_check_ties_compares_sharded_copies(zbpp_workers, schedule: str, holders: str) -> None:
    """`tie_drift_case`: equal shards pass; one element of one replica's shard of one copy moved by
    1e-3 (by hand, the largest difference) raises on all 4 ranks the same error, naming every
    holder: shards across ranks (zb-h1) and FSDP's per-stage copies on one rank (zb-v)."""
    per_rank = zbpp_workers(4, pg_timeout=60).run(tie_drift_case, schedule)
    assert all(r[0] == "ok" for r in per_rank), per_rank
    want = f"RuntimeError: tied parameter 'w' differs between its copies by up to 0.001: held by {holders}. "
    assert all(r[1].startswith(want) for r in per_rank), per_rank
    assert len({r[1] for r in per_rank}) == 1, per_rank  # the same error on every rank


def _assert_no_fails(per_rank: list[list[str]]) -> None:
    fails = [f"rank {r}: {f}" for r, fs in enumerate(per_rank) for f in fs]
    assert not fails, "\n".join(fails)


def test_a_pipeline_without_fsdp_leaves_fsdp_unimported() -> None:
    """Whether a stage is ``fully_shard``'ed is asked without importing FSDP2 (and DTensor with it,
    seconds of every rank's start-up) while nothing has: no module can be wrapped before."""
    import subprocess
    import sys
    from pathlib import Path

    code = (
        "import sys, torch\n"
        "from zbpp import Pipeline\nfrom zbpp.runtime.fsdp import holds_fsdp\nfrom zbpp.schedules import build\n"
        "stage = torch.nn.Linear(4, 4)\n"
        "pipe = Pipeline({0: stage}, build('1f1b', num_ranks=1, num_microbatches=2), "
        "loss_fn=lambda y, t: (y - t).pow(2).mean())\n"
        "pipe.step(torch.randn(4, 4), target=torch.randn(4, 4))\n"
        "print(holds_fsdp({0: stage}), 'torch.distributed.fsdp' in sys.modules)\n"
        "from torch.distributed.fsdp import fully_shard\n"  # imported: asked for real from then on
        "print(holds_fsdp({0: stage}))\n"
    )
    root = str(Path(__file__).resolve().parents[2])
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env={"PYTHONPATH": root, "PATH": "/usr/bin:/bin"})
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split() == ["False", "False", "False"], out.stdout
