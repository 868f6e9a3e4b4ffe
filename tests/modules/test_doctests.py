"""The runnable examples in zbpp.modules' docstrings run and print what they say."""

from __future__ import annotations

import doctest
import importlib

import pytest

MODULES = [
    "zbpp.modules",
    "zbpp.modules._activations",
    "zbpp.modules._fp8_weight_cache",
    "zbpp.modules._fused",
    "zbpp.modules._init",
    "zbpp.modules._norm",
    "zbpp.modules.base",
    "zbpp.modules.context",
    "zbpp.modules.fp8",
    "zbpp.modules.fp8.cast",
    "zbpp.modules.fp8.counts",
    "zbpp.modules.fp8.gemm",
    "zbpp.modules.fp8.recipe",
    "zbpp.modules.layernorm_linear",
    "zbpp.modules.layernorm_mlp",
    "zbpp.modules.linear",
    "zbpp.modules.swap",
    "zbpp.modules.wgrad_store",
]


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples(name):
    result = doctest.testmod(importlib.import_module(name), optionflags=doctest.ELLIPSIS)
    assert result.attempted > 0, f"{name} has no example"
    assert result.failed == 0
