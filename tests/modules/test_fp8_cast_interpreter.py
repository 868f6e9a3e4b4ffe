"""The plain FP8 cast kernel under Triton's interpreter (CPU) against the eager torch ops.

On a GPU the kernel's conversions are single PTX instructions (test_fp8_cast.py checks them there
against torch); under the interpreter (``TRITON_INTERPRET=1``, numpy on CPU tensors) they are the
kernel's bit-level software versions, and everything around them (tiles, masks, the transposed
store, the amax, the column sums, the last tile's update of the slot) is the code the GPU runs.
The reference is ``fp8.cast._cast_eager`` / ``fp8.quantize``; every comparison is exact except the
column sums (another summation order: within the float32 summation bound).
"""

from __future__ import annotations

import pytest
import torch

from tests.modules import fp8_bounds as fb
from tests.modules.fp8_compare import (
    E4M3,
    E5M2,
    assert_codes,
    assert_slot,
    quantize_ref,
    slot_args,
    slots,
)
from zbpp.modules.fp8 import cast as fp8cast

pytestmark = pytest.mark.interpreter


@pytest.mark.parametrize("f8", [E4M3, E5M2], ids=["e4m3", "e5m2"])
def test_cast_rounds_every_midpoint_like_torch(interpreted_kernels, f8):
    """Every FP8 value, every midpoint between neighbours (ties to even), the float32 values
    next to them, subnormals, signed zeros and NaN: the software conversion equals torch's."""
    values = torch.arange(256, dtype=torch.uint8).view(f8).float()
    values = values[torch.isfinite(values)].unique()
    mids = (values[:-1] + values[1:]) / 2
    special = torch.tensor([float("nan"), -0.0, 2.0**-130, -(2.0**-140), 3 * 2.0**-149, 1e30])
    x = torch.cat([mids, values, torch.nextafter(mids, values[1:]),
                   torch.nextafter(mids, values[:-1]), special]).reshape(1, -1)
    fmax = torch.finfo(f8).max
    for scale in (1.0, 0.37):
        s = torch.tensor(scale)
        want = fp8cast._cast_eager(x, s, fmax, f8, True)
        got = interpreted_kernels.cast.cast_transpose_amax(x, s, fmax, f8, True)
        assert_codes(got[0], want[0], exact=True, what="data")
        assert_codes(got[1], want[1], exact=True, what="data_t")
        assert torch.isnan(got[2]) and torch.isnan(want[2])  # the NaN reaches the amax


@pytest.mark.parametrize("shape", [(1, 1), (130, 70), (129, 257)], ids=lambda s: f"{s[0]}x{s[1]}")
def test_cast_update_and_column_sums_equal_eager(interpreted_kernels, shape):
    """The one-launch cast (the last tile updates the slot) of bfloat16 x with its column sums."""
    g = torch.Generator().manual_seed(shape[0])
    x = (torch.randn(shape, generator=g) * 40).bfloat16()
    fast, slow = slots(E5M2, 3.0)
    data, data_t, scale_inv, sums = interpreted_kernels.cast.cast_transpose_update(
        x, fast.scale, fast.amax_history, fast.fused_workspace(), fast.fp8_max, E5M2, True,
        column_sums=True, **slot_args(fast))
    q, total = quantize_ref(x, slow, transpose=True, column_sum=True)
    assert_codes(data, q.data, exact=True, what="data")
    assert_codes(data_t, q.data_t, exact=True, what="data_t")
    assert torch.equal(scale_inv, q.scale_inv)
    assert_slot(fast, slow, exact=True, what="slot")
    exact = x.double().sum(0)
    bound = fb.gamma(shape[0]) * x.double().abs().sum(0)  # any float32 order of the sums
    assert ((sums.sum(0).double() - exact).abs() <= bound).all()


