"""`TiedParameters.compare` on one rank: copies of one Parameter that ``fully_shard`` split between
two stages of a rank (no collective), compared bit for bit. The 2-rank comparison across holders,
through a real optimizer, is tests/models/test_hf_ties.py."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from zbpp.runtime.tied import LocalTies, TiedParameters, drifted_ties_error
from zbpp.runtime.topology import Topology


def _ties(a: nn.Parameter, b: nn.Parameter) -> TiedParameters:
    local = LocalTies({}, [((a, b), (0, 3))])  # one Parameter split into a copy per stage (stages 0 and 3)
    return TiedParameters(local, Topology.resolve(None, 1), (0, 0), None, torch.device("cpu"), None)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float64])
def test_split_copies_are_compared_exactly(dtype: torch.dtype) -> None:
    a = nn.Parameter(torch.tensor([1.0, 0.0, -2.0, 3.0], dtype=dtype))
    b = nn.Parameter(a.detach().clone())
    ties = _ties(a, b)
    name = "shared by stages [0, 3]"
    assert ties.compare(ties.snapshot()) == {name: 0.0}
    with torch.no_grad():
        b[1] = -0.0  # equal as numbers, not as bits: an optimizer touched one copy only
    assert ties.compare(ties.snapshot())[name] != ties.compare(ties.snapshot())[name]  # NaN: no difference > 0
    with torch.no_grad():
        b[2] = -2.5  # exact in every dtype here: the difference is 0.5
    found = ties.compare(ties.snapshot())
    assert found == {name: 0.5}
    error = drifted_ties_error([(0, found, ties.copy_names({0: nn.Module(), 3: nn.Module()}))])
    assert error is not None and str(error).startswith(f"tied parameter {name!r} differs between its copies by up to 0.5")
