"""Checkpoints of a tied-embedding GPT-2 resume across V <-> non-V placements, pipeline degrees
2 <-> 4 and FSDP shards <-> whole copies (4 gloo ranks, one worker pool): the loaded state is the saved one exactly, the resumed run
meets the one-process reference, and dropout draws resume bit for bit. Cases and tolerances:
`resume_cases`."""

from __future__ import annotations

import pytest

from .resume_cases import all_cases

pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory, zbpp_workers) -> list[dict[str, list[str]]]:
    root = tmp_path_factory.mktemp("resume")
    return zbpp_workers(4, pg_timeout=60).run(all_cases, str(root))


@pytest.mark.timeout(600)
@pytest.mark.parametrize("case", ["V->flat", "flat->V", "V-fsdp->flat", "flat->V-fsdp"])
def test_tied_embedding_resumes_across_layouts(results, case: str) -> None:
    fails = [f"rank {r}: {f}" for r, per in enumerate(results) for f in per[case]]
    assert not fails, "\n".join(fails)


@pytest.mark.parametrize("case", ["dropout", "dropout-rank-seeds", "dropout-V->looped"])
def test_dropout_stream_resumes_bit_for_bit(results, case: str) -> None:
    """"dropout-rank-seeds": the replicas' ranks seeded torch apart (seed=None): every replica
    resumes its own masks from the checkpoint's one seed. "dropout-V->looped": resumed under another
    schedule and placement of the same stages, the same masks (to summation order)."""
    fails = [f"rank {r}: {f}" for r, per in enumerate(results) for f in per[case]]
    assert not fails, "\n".join(fails)


def test_an_untied_checkpoint_into_tied_copies_is_refused(results) -> None:
    """`resume_cases.untied_case`: at the flat and V-fsdp layouts, every rank raises."""
    fails = [f"rank {r}: {f}" for r, per in enumerate(results) for f in per["untied"]]
    assert not fails, "\n".join(fails)
