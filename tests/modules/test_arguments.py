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


def _type_error(name, **kwargs) -> str:
    """The message of the TypeError that building layer `name` with `kwargs` raises."""
    with pytest.raises(TypeError) as caught:
        LAYERS[name](**kwargs)
    return str(caught.value)


@pytest.mark.parametrize("dtype", ["bfloat16", "bf16", 16, torch.int32, torch.bool])
@pytest.mark.parametrize("name", list(LAYERS))
def test_params_dtype_of_the_wrong_type_is_a_type_error(name, dtype):
    message = _type_error(name, params_dtype=dtype)
    assert message.startswith(f"{name}: params_dtype={dtype!r}")
    assert "floating-point torch.dtype" in message and "None" in message


@pytest.mark.parametrize("name", list(LAYERS))
def test_good_params_dtypes_still_work(name):
    assert LAYERS[name](params_dtype=torch.bfloat16).get_parameter(
        "layer_norm_weight" if name != "Linear" else "weight").dtype == torch.bfloat16
    assert next(LAYERS[name](params_dtype=None).parameters()).dtype == torch.get_default_dtype()


# wgrad_cuda_graph: a removed option (Pipeline(cuda_graphs=True) replays whole tasks instead)
@pytest.mark.parametrize("keyword", ["delay_wgrad", "wgrad_cuda_graph"])
@pytest.mark.parametrize("name", list(LAYERS))
def test_an_unknown_keyword_is_named_with_the_accepted_ones(name, keyword):
    message = _type_error(name, delay_wgrad_compute=True, **{keyword: True})
    assert message.startswith(f"{name}: unknown keyword argument {keyword!r}")
    assert "delay_wgrad_compute" in message and "params_dtype" in message


@pytest.mark.parametrize("name", list(LAYERS))
def test_every_layer_takes_the_shared_keywords(name):
    """The keywords the base class owns reach every layer: the parameters' dtype and device,
    the init method of the GEMM weights, the delayed and fused-accumulation switches."""
    layer = LAYERS[name](delay_wgrad_compute=True, fuse_wgrad_accumulation=True,
                         params_dtype=torch.float64, device="cpu",
                         init_method=lambda w: torch.nn.init.constant_(w, 0.5))
    weights = [p for n, p in layer.named_parameters() if n.endswith("weight")
               and not n.startswith("layer_norm")]
    assert weights and all(bool((w == 0.5).all()) for w in weights)
    assert all(p.dtype == torch.float64 and p.device.type == "cpu" for p in layer.parameters())
    assert layer.delay_wgrad_compute and layer.fuse_wgrad_accumulation


@pytest.mark.parametrize("keyword", ["init_method", "output_layer_init_method"])
@pytest.mark.parametrize("name", list(LAYERS))
def test_an_init_method_that_returns_a_new_tensor_is_a_type_error(name, keyword):
    """An init method fills its argument in place (``torch.nn.init``'s convention, which the
    layers follow); one returning a new tensor left the weight as ``torch.empty`` made it:
    uninitialised memory (a std of 4e8 on a 64 x 64 Linear), silently. It is named instead;
    in-place ones, returning their argument, a view of it or nothing, still work."""
    if keyword == "output_layer_init_method" and name != "LayerNormMLP":
        pytest.skip("only LayerNormMLP has an output layer")
    message = _type_error(name, **{keyword: lambda w: torch.full_like(w, 0.5)})
    assert message.startswith(f"{name}.") and "weight" in message and "in place" in message
    for init in (lambda w: torch.nn.init.constant_(w, 0.5), lambda w: w.view(-1).fill_(0.5),
                 lambda w: None if w.fill_(0.5) is None else None):
        layer = LAYERS[name](**{keyword: init})
        weight = layer.fc2_weight if keyword == "output_layer_init_method" else next(
            p for n, p in layer.named_parameters() if n.endswith("weight") and not n.startswith("layer_norm"))
        assert bool((weight == 0.5).all())
