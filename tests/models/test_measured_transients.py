"""B's transient as `measure_activation_policies` and `measure_profile` measure it: the most bytes
B holds at once above what F kept, against hand counts (float64, CPU)."""

from __future__ import annotations

import torch
import torch.nn.functional as Fn
from torch import nn

from zbpp.models import measure_profile
from zbpp.models.recompute import measure_activation_policies

F64 = 8  # bytes of a float64


class _Scratch(torch.autograd.Function):
    """Saves its input; its backward makes a scratch buffer of N floats and the input's gradient."""

    N = 1000

    @staticmethod
    def forward(ctx, x):  # type: ignore[override]
        ctx.save_for_backward(x)
        return x * 2

    @staticmethod
    def backward(ctx, g):  # type: ignore[override]
        (x,) = ctx.saved_tensors
        scratch = torch.ones(_Scratch.N, dtype=torch.float64)
        return g * scratch[0]  # scratch[0]: a view, no new storage


class _ScratchLayer(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _Scratch.apply(x)


def test_b_transient_of_a_hand_written_backward() -> None:
    # F keeps the input (4 x 8 floats); B makes the scratch (1000 floats) and, while it is alive,
    # the input's gradient (4 x 8): both above what F kept
    x = torch.randn(4, 8, dtype=torch.float64)
    got = measure_activation_policies(_ScratchLayer(), x, policies=("none",))["none"]
    assert got.kept_f_to_b == 4 * 8 * F64
    assert got.b_transient == (_Scratch.N + 4 * 8) * F64


def test_full_recompute_holds_what_it_re_creates_on_top_of_bs_own() -> None:
    # Linear, GELU, Linear: "full" keeps the input and re-creates the rest of none's saved tensors
    # when B begins, then runs the same backward as none: its transient is none's plus those bytes
    torch.manual_seed(0)
    mlp = nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 64)).double()
    got = measure_activation_policies(mlp, torch.randn(32, 64, dtype=torch.float64), policies=("none", "full"))
    none, full = got["none"], got["full"]
    assert none.b_transient > 0  # B's own gradients of the hidden activations
    assert full.b_transient == none.b_transient + (none.kept_f_to_b - full.kept_f_to_b)


def test_measure_profile_counts_the_losss_gradients_in_the_heads_transient() -> None:
    # a head of V outputs with a cross-entropy loss: B holds the logits' gradient (R x V floats) and,
    # at once, the log-softmax's (another R x V): one to two logit-sized tensors above what F kept
    R, C, V = 4, 8, 500
    prof = measure_profile(layers=[("pre", nn.Linear(C, C).double()), ("head", nn.Linear(C, V).double())],
                           example_input=torch.randn(R, C, dtype=torch.float64), loss_fn=Fn.cross_entropy,
                           target=torch.randint(0, V, (R,)), steps=1, warmup=0)
    head = prof.layers[1]
    assert R * V * F64 <= head.transient <= 2 * R * V * F64
    assert prof.stage_costs([range(0, 2)])[1].transient_b[0] >= head.transient  # the head's B runs first


def test_measure_profile_moves_the_layers_transient_by_each_policys() -> None:
    # the MLP after a first layer (R rows of width W): full re-creates the 6 R W floats it does not
    # keep; offload (on a CPU its copy back is the host copy itself) brings back its 7 R W copied
    R, W = 4, 8
    torch.manual_seed(0)
    mlp = nn.Sequential(nn.Linear(W, 3 * W), nn.GELU(), nn.Linear(3 * W, W)).double()
    prof = measure_profile(layers=[("pre", nn.Linear(W, W).double()), ("mlp", mlp)],
                           example_input=torch.randn(R, W, dtype=torch.float64), steps=1, warmup=0,
                           policies=["full", "offload"], host_bytes_per_s=1e9)
    layer = prof.layers[1]
    assert layer.transient > 0
    assert layer.cost("full").transient == layer.transient + 6 * R * W * F64
    assert layer.cost("offload").transient == layer.transient + 7 * R * W * F64
