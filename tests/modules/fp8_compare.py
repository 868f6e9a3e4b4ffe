"""Comparisons of FP8 casts for the kernel tests: byte codes, slots, the eager reference."""

from __future__ import annotations

import torch

from zbpp.modules.fp8 import DelayedScaling, ScalingMeta, quantize, quantize_and_column_sum

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
RECIPE = DelayedScaling(amax_history_len=4, margin=1)


def slots(f8, scale):
    """Two fresh slots with the same scale and an older history entry (so the update matters)."""
    out = []
    for _ in range(2):
        meta = ScalingMeta(f8, history_len=4)
        meta.scale.fill_(scale)
        meta.amax_history[0] = 0.75
        out.append(meta)
    return out


def slot_args(meta):
    return meta.rule_args(RECIPE)


def codes(q: torch.Tensor) -> torch.Tensor:
    """FP8 bytes as integers in value order (sign-magnitude to two's complement, -0 == +0)."""
    b = q.view(torch.uint8).to(torch.int32)
    return torch.where(b >= 128, -(b - 128), b)


def assert_codes(got, want, *, exact, what):
    """FP8 tensors equal byte for byte (`exact`), or each within one code and few of them off
    (NaNs in the same places either way)."""
    got, want = got.cpu(), want.cpu()
    g, w = codes(got), codes(want)
    nan = torch.isnan(want.float())
    assert torch.equal(nan, torch.isnan(got.float())), f"{what}: NaNs in other places"
    diff = (g - w).abs()[~nan]
    if exact:
        assert torch.equal(got.view(torch.uint8)[~nan], want.view(torch.uint8)[~nan]), (
            f"{what}: {(diff > 0).sum().item()} bytes differ (max {diff.max().item()} codes)")
    else:
        assert diff.max().item() <= 1, f"{what}: {diff.max().item()} codes apart"
        assert (diff > 0).float().mean().item() < 0.02, f"{what}: too many values one code off"


def assert_slot(fast, slow, *, exact, what):
    """The slot a fused kernel updated equals the eager one (`exact`), or up to the bfloat16
    rounding of the amax; the kernel's workspace is zero again."""
    history, scale = fast.amax_history.cpu(), fast.scale.cpu()
    if exact:
        assert torch.equal(history, slow.amax_history), f"{what}: history differs"
        assert torch.equal(scale, slow.scale), f"{what}: scale differs"
    else:
        torch.testing.assert_close(history, slow.amax_history, rtol=2.0**-8, atol=0,
                                   msg=f"{what}: amax beyond one bfloat16 rounding")
        torch.testing.assert_close(scale, slow.scale, rtol=2.0**-7, atol=0,
                                   msg=f"{what}: scale beyond the amax's rounding")
    assert not fast._workspace.any(), f"{what}: workspace left non-zero"


def quantize_ref(x, meta, *, transpose, column_sum=False):
    """The eager reference cast (and column sums) of `x` into `meta`."""
    if column_sum:
        return quantize_and_column_sum(x, meta, RECIPE, transpose=transpose)
    return quantize(x, meta, RECIPE, transpose=transpose), None
