"""Bad constructor and autocast arguments raise a TypeError that names the argument and says
what it accepts (the house rule), instead of failing later somewhere inside."""

from __future__ import annotations

import pytest
import torch

from zbpp.modules import (
    DelayedScaling,
    Format,
    LayerNormLinear,
    LayerNormMLP,
    Linear,
    fp8_autocast,
)

LAYERS = {
    "Linear": lambda **kw: Linear(4, 4, **kw),
    "LayerNormLinear": lambda **kw: LayerNormLinear(4, 4, **kw),
    "LayerNormMLP": lambda **kw: LayerNormMLP(4, 8, **kw),
}


@pytest.mark.parametrize("recipe", ["hybrid", Format.HYBRID, {"margin": 0}, 1])
def test_fp8_recipe_of_the_wrong_type_is_a_type_error(recipe):
    with pytest.raises(TypeError) as caught:
        with fp8_autocast(fp8_recipe=recipe):
            pass
    message = str(caught.value)
    assert f"fp8_recipe={recipe!r}" in message
    assert "DelayedScaling" in message and "None" in message  # what it accepts


def test_enabled_of_the_wrong_type_is_a_type_error():
    with pytest.raises(TypeError, match=r"fp8_autocast: enabled='yes' .*True or False"):
        with fp8_autocast(enabled="yes"):
            pass


def test_good_recipes_still_work():
    with fp8_autocast(fp8_recipe=None) as recipe:
        assert recipe == DelayedScaling()
    with fp8_autocast(fp8_recipe=DelayedScaling(amax_history_len=3)) as recipe:
        assert recipe.amax_history_len == 3


@pytest.mark.parametrize("dtype", ["bfloat16", "bf16", 16, torch.int32, torch.bool])
@pytest.mark.parametrize("name", list(LAYERS))
def test_params_dtype_of_the_wrong_type_is_a_type_error(name, dtype):
    with pytest.raises(TypeError) as caught:
        LAYERS[name](params_dtype=dtype)
    message = str(caught.value)
    assert message.startswith(f"{name}: params_dtype={dtype!r}")
    assert "floating-point torch.dtype" in message and "None" in message


@pytest.mark.parametrize("name", list(LAYERS))
def test_good_params_dtypes_still_work(name):
    assert LAYERS[name](params_dtype=torch.bfloat16).get_parameter(
        "layer_norm_weight" if name != "Linear" else "weight").dtype == torch.bfloat16
    assert next(LAYERS[name](params_dtype=None).parameters()).dtype == torch.get_default_dtype()
