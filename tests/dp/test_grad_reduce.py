"""GradReducer and clip_grad_norm_ on one process: the bookkeeping, the errors, main_grad.

Without data parallelism nothing is communicated, but readiness, exactly-once counting, buckets and
main_grad folding run the same code as with it. References are plain autograd on nn.Linear (float64,
compared with rtol=1e-12: only the order of accumulation over microbatches differs).
"""

from __future__ import annotations

import doctest
import math

import pytest
import torch
from torch import nn

import zbpp.runtime.clip as clip_mod
import zbpp.runtime.grad_reduce as gr_mod
from zbpp.modules import Linear, microbatch
from zbpp.runtime.clip import clip_grad_norm_
from zbpp.runtime.grad_reduce import GradReducer

from .doubles import KeyedLinear, TELikeLinear

RTOL = 1e-12


@pytest.mark.parametrize("module", [gr_mod, clip_mod])
def test_docstring_examples(module) -> None:
    assert doctest.testmod(module).failed == 0


def _pair(kind: type, **kw) -> tuple[nn.Module, nn.Linear]:
    torch.manual_seed(0)
    plain = nn.Linear(4, 3).double()
    layer = kind(4, 3, **kw).double()
    layer.load_state_dict(plain.state_dict())
    return layer, plain


def _microbatches(n: int = 3) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return [torch.randn(2, 4, generator=g, dtype=torch.float64) for _ in range(n)]


def _reference(plain: nn.Linear, xs: list[torch.Tensor]) -> None:
    for x in xs:
        plain(x).pow(2).sum().backward()


def _grad(p: torch.Tensor) -> torch.Tensor:
    main = getattr(p, "main_grad", None)
    return main if main is not None else p.grad


def _steps(reducer: GradReducer, layer: nn.Module, xs: list[torch.Tensor]) -> None:
    """All B's of one stage, then all W's (ZB order), with the notifications."""
    reducer.start_step()
    for j, x in enumerate(xs):
        with microbatch(j):
            layer(x).pow(2).sum().backward()
    reducer.stage_backward_done(0)
    for j in range(len(xs)):
        layer.backward_dw() if isinstance(layer, TELikeLinear) else layer.backward_dw(j)
    reducer.stage_wgrad_done(0)
    reducer.finish()


@pytest.mark.parametrize(
    "kind,kw",
    [
        (KeyedLinear, {}),
        (KeyedLinear, {"fuse_wgrad_accumulation": True}),
        (KeyedLinear, {"fp8": True, "fuse_wgrad_accumulation": True}),
        (TELikeLinear, {}),
    ],
    ids=["keyed", "keyed-fused", "fp8-consumed-bias", "te-overwrites"],
)
def test_delayed_module_grads_match_autograd_and_count_once(kind, kw) -> None:
    layer, plain = _pair(kind, **kw)
    reducer = GradReducer({0: layer}, None)
    xs = _microbatches()
    for step in range(2):  # the second step proves start_step zeroes main_grad
        layer.zero_grad(set_to_none=True)
        _steps(reducer, layer, xs)
    _reference(plain, xs)
    for name, p in layer.named_parameters():
        torch.testing.assert_close(_grad(p), dict(plain.named_parameters())[name].grad, rtol=RTOL, atol=0)
    assert set(reducer.reduce_counts().values()) == {1}
    if kw.get("fp8"):
        # the eager bias grad was moved into main_grad during B, and W did not bring it back
        assert layer.bias.grad is None


def test_te_like_module_gets_main_grad_and_the_hook_accumulates_its_overwrites() -> None:
    layer, _ = _pair(TELikeLinear)
    GradReducer({0: layer}, None)
    assert layer.weight.main_grad.dtype == torch.float64  # fp32 at least, fp64 for fp64 parameters
    assert layer.weight.main_grad.data_ptr() != layer.weight.data_ptr()


def test_main_grad_rules() -> None:
    fused, _ = _pair(KeyedLinear, fuse_wgrad_accumulation=True)
    plain = nn.Linear(2, 2).to(torch.bfloat16)
    GradReducer({0: nn.Sequential(fused, plain)}, None)
    assert hasattr(fused.weight, "main_grad") and not hasattr(plain.weight, "main_grad")
    GradReducer({0: plain}, None, main_grad=True)
    assert plain.weight.main_grad.dtype == torch.float32  # bf16 params accumulate in fp32


def test_buckets_follow_the_size_cap() -> None:
    # float32 params of 100, 100, 100 and 300 elements; cap 1000 bytes = 250 elements
    mod = nn.Module()
    for i, n in enumerate([100, 100, 100, 300]):
        mod.register_parameter(f"p{i}", nn.Parameter(torch.zeros(n)))
    r = GradReducer({0: mod}, None, bucket_size_mb=1000 / 2**20)
    # reverse registration order: [p3] alone (too big), then [p2, p1], then [p0]
    assert [[e.param.numel() for e in b.entries] for b in r._buckets] == [[300], [100, 100], [100]]


def _reducer_after_one_b() -> tuple[KeyedLinear, GradReducer]:
    """A delayed layer under a reducer whose step has run one microbatch's B (its W pending)."""
    layer, _ = _pair(KeyedLinear)
    r = GradReducer({0: layer}, None)
    r.start_step()
    with microbatch(0):
        layer(_microbatches(1)[0]).sum().backward()
    return layer, r


def test_missing_wgrad_notification_is_reported_with_the_parameter() -> None:
    layer, r = _reducer_after_one_b()
    r.stage_backward_done(0)
    layer.backward_dw(0)
    with pytest.raises(RuntimeError, match=r"stage_wgrad_done\(0\) was not called.*'weight' was reduced 0 times"):
        r.finish()


def test_protocol_misuse_raises() -> None:
    layer = nn.Linear(2, 2)
    r = GradReducer({5: layer}, None)
    with pytest.raises(RuntimeError, match="start_step"):
        r.stage_backward_done(5)
    r.start_step()
    with pytest.raises(ValueError, match=r"stage 4 is not on this rank; it holds \[5\]"):
        r.stage_backward_done(4)
    r.stage_backward_done(5)
    with pytest.raises(RuntimeError, match="called twice"):
        r.stage_backward_done(5)


def test_gradient_after_the_parameter_was_final_raises() -> None:
    layer = nn.Linear(2, 2)
    r = GradReducer({0: layer}, None)
    r.start_step()
    r.stage_backward_done(0)  # too early: a backward still comes
    with pytest.raises(RuntimeError, match="after the parameter was declared final"):
        layer(torch.ones(1, 2)).sum().backward()


def test_w_after_stage_wgrad_done_raises() -> None:
    layer, r = _reducer_after_one_b()
    r.stage_backward_done(0)
    r.stage_wgrad_done(0)  # too early: the W below still runs
    with pytest.raises(RuntimeError, match="backward_dw\\(\\) ran after"):
        layer.backward_dw(0)


def test_parameter_tied_across_two_local_stages_waits_for_both() -> None:
    # V placement: stages 0 and 3 on one rank share a weight (tied embedding / head)
    first, last = nn.Linear(2, 2), nn.Linear(2, 2)
    last.weight = first.weight
    r = GradReducer({0: first, 3: last}, None)
    r.start_step()
    r.stage_backward_done(3)
    r.stage_wgrad_done(3)
    assert r.reduce_counts()["stage 0 'weight'"] == 0  # stage 0 has not finished yet
    r.stage_backward_done(0)
    r.stage_wgrad_done(0)
    r.finish()
    assert r.reduce_counts()["stage 0 'weight'"] == 1


def test_get_backward_dw_params_must_return_parameters() -> None:
    layer, _ = _pair(KeyedLinear)
    layer.get_backward_dw_params = lambda: [layer.weight.detach()]
    with pytest.raises(ValueError, match="not a trainable parameter"):
        GradReducer({0: layer}, None)


def test_clip_uses_main_grad_and_the_inf_norm() -> None:
    a, b = nn.Parameter(torch.zeros(2)), nn.Parameter(torch.zeros(2))
    a.grad = torch.tensor([3.0, -12.0])
    b.main_grad = torch.tensor([4.0, 0.0])
    b.grad = torch.tensor([100.0, 100.0])  # Megatron's placeholder of a fused layer: main_grad is the gradient
    b.grad_added_to_main_grad = True
    assert float(clip_grad_norm_([a, b], 1e9)) == pytest.approx(13.0)
    assert float(clip_grad_norm_([a, b], 6.0, norm_type=math.inf)) == pytest.approx(12.0)
    assert a.grad.tolist() == pytest.approx([1.5, -6.0], rel=1e-6)
    a.grad[0] = float("nan")
    with pytest.raises(RuntimeError, match="nan"):
        clip_grad_norm_([a], 1.0, error_if_nonfinite=True)


def test_clip_refuses_a_main_grad_beside_the_steps_grad() -> None:
    """dp=1, a main_grad attached (Megatron's fp32 accumulation) to a plain Linear's weight: the step
    leaves its gradient in .grad and main_grad zeros. clip_grad_norm_ took the zero main_grad for the
    gradient: the norm missed the weight's (torch's clip_grad_norm_ of the same .grad differs) and
    that .grad went unclipped. Now it names the parameter instead."""
    from zbpp import Pipeline
    from zbpp.schedules import build

    torch.manual_seed(0)
    lin = nn.Linear(3, 2)
    lin.weight.main_grad = torch.zeros_like(lin.weight, dtype=torch.float32)
    pipe = Pipeline({0: lin}, build("1f1b", num_ranks=1, num_microbatches=2), loss_fn=nn.functional.mse_loss)
    pipe.step(torch.randn(4, 3), target=torch.randn(4, 2))
    assert lin.weight.grad is not None and not lin.weight.main_grad.any()  # the setup the test is about
    want = float(torch.nn.utils.clip_grad_norm_([lin.weight, lin.bias], 1e9))  # .grad's norm; scales by 1
    assert want > 0 and float(lin.bias.grad.norm()) < want  # the weight's share is missing from a main_grad norm
    with pytest.raises(ValueError, match=r"parameter weight of stage 0 has both a main_grad and a \.grad"):
        clip_grad_norm_(pipe, 1.0)


def test_clip_sums_norms_past_float32s_range() -> None:
    """Two float32 gradients of norm 1e20 each: their squares (1e40) overflow float32, so the total
    came out inf and the clip coefficient 0 zeroed every gradient, silently. The total is
    sqrt(2) * 1e20 by hand (relative 1e-6: the float32 per-tensor norms), and the gradients are
    scaled to it (max_norm 1: 1e20 / (sqrt(2) * 1e20) = 0.7071 each)."""
    a, b = (nn.Parameter(torch.zeros(1)) for _ in range(2))
    a.grad, b.grad = torch.full((1,), 1e20), torch.full((1,), -1e20)
    total = clip_grad_norm_([a, b], 1.0)
    assert float(total) == pytest.approx(math.sqrt(2) * 1e20, rel=1e-6)
    assert a.grad.item() == pytest.approx(1 / math.sqrt(2), rel=1e-6)
    assert b.grad.item() == pytest.approx(-1 / math.sqrt(2), rel=1e-6)


def test_switching_delay_between_steps_is_followed() -> None:
    # built while not delaying; then the module defers its weight gradient to W
    torch.manual_seed(0)
    plain = nn.Linear(4, 3).double()
    layer = Linear(4, 3, params_dtype=torch.float64)
    layer.load_state_dict(plain.state_dict())
    r = GradReducer({0: layer}, None)
    xs = _microbatches()
    for delay in (False, True):
        layer.delay_wgrad_compute = delay
        layer.zero_grad(set_to_none=True)
        r.start_step()
        for j, x in enumerate(xs):
            with microbatch(j):
                layer(x).pow(2).sum().backward()
        r.stage_backward_done(0)
        # final after B without delay; owed by W with it
        assert r.reduce_counts()["stage 0 'weight'"] == (0 if delay else 1)
        for j in range(len(xs)):
            layer.backward_dw(j)  # a no-op without delay
        r.stage_wgrad_done(0)
        r.finish()
        assert set(r.reduce_counts().values()) == {1}
    _reference(plain, xs)
    for name, p in layer.named_parameters():
        torch.testing.assert_close(p.grad, dict(plain.named_parameters())[name].grad, rtol=RTOL, atol=0)
