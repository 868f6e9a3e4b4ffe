"""Gradients and optimizer inputs of multi-rank runs against one process running the whole model on
the whole batch per replica (grads_cases.py; tolerance there), on 4 gloo ranks (dp=2 x pp=2):

- a parameter frozen when the Pipeline is built and unfrozen later is averaged over the replicas.
"""

from __future__ import annotations

import pytest

from .grads_cases import check_unfrozen_later


@pytest.mark.parametrize("kind", ["plain", "zbpp"])
@pytest.mark.parametrize("name", ["1f1b", "zb-v"])
def test_parameter_unfrozen_after_build_is_averaged(zbpp_workers, name, kind):
    zbpp_workers(4).run(check_unfrozen_later, name, 2, kind)
