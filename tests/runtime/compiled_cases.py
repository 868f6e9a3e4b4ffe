"""What every rank runs in the compiled-stage tests: stages under ``torch.compile`` in a `Pipeline`.

Every stage is ``h = tanh(a(x)); h = mid(h); return x + mlp(h)`` (hidden `H`), in two kinds built
from the same seeded values:

- ``torch``: torch.nn only (``a``, ``mid``: ``nn.Linear``; ``mlp``: LayerNorm, Linear, tanh-GELU,
  Linear);
- ``zbpp``: ``a`` a zbpp `Linear` and ``mlp`` a zbpp `LayerNormMLP`, both delayed; ``mid`` stays an
  ``nn.Linear`` inside the compiled code between them.

Each rank compiles its stages (``torch.compile(stage)`` or ``stage.compile()``), runs two steps
(the first compiles, the second must not) and compares the second step's loss and every
gradient with one process running the eager torch model on the whole batch.

Tolerance: float64, ``rtol=1e-9, atol=1e-12``. The pipeline sums per-microbatch gradients where
the reference does whole-batch GEMMs (and inductor may fuse in another order): they differ by
rounding (~1e-16 relative per add); a lost, doubled or misplaced gradient moves them by >= 1/m.

FLOPs (matmuls, ``FlopCounterMode`` around each B and W task of the second step), per microbatch of
``r`` rows, in units of ``r H^2`` (each GEMM's input or weight gradient costs 2 x its size):

============================ ====== ======
stage                          B      W
============================ ====== ======
torch, not first               24      0    (the compiled node computes every gradient in B)
zbpp, not first                14     10    (W: a's and mlp's weight gradients; mid's is in B)
first stage, either kind        0     22    (nothing needs an input gradient: all of it in W)
============================ ====== ======
"""

from __future__ import annotations

import contextlib
import traceback
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from zbpp import Pipeline
from zbpp.modules import LayerNormMLP, Linear as ZLinear
from zbpp.runtime import wgrad as _wgrad
from zbpp.schedules import build

from .split_cases import TaskFlops

H, ROWS, M = 8, 8, 4  # hidden size, batch rows (per replica), microbatches
TOL = {"rtol": 1e-9, "atol": 1e-12}
F64 = {"dtype": torch.float64}
# per microbatch, in r H^2: (B, W) of a stage that is not the first, and of the first
FLOPS = {"torch": (24, 0), "zbpp": (14, 10), "first": (0, 22)}


class Stage(nn.Module):
    """One stage (see the module docstring); `tie` (tied runs): the first stage starts with
    ``x @ tie``, the last ends with ``h @ tie^T`` (the same logical parameter)."""

    def __init__(self, kind: str, tie: nn.Parameter | None = None, role: str = "") -> None:
        super().__init__()
        self.role = role
        if tie is not None:
            self.tie = tie
        if kind == "zbpp":
            self.a: nn.Module = ZLinear(H, H, delay_wgrad_compute=True, params_dtype=torch.float64)
            self.mid = nn.Linear(H, H, **F64)
            self.mlp: nn.Module = LayerNormMLP(H, 2 * H, delay_wgrad_compute=True, params_dtype=torch.float64)
        else:
            self.a = nn.Linear(H, H, **F64)
            self.mid = nn.Linear(H, H, **F64)
            self.mlp = nn.Sequential(nn.LayerNorm(H, **F64), nn.Linear(H, 2 * H, **F64), nn.GELU(approximate="tanh"),
                                     nn.Linear(2 * H, H, **F64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.role == "in":
            x = x @ self.tie
        h = self.mid(torch.tanh(self.a(x)))
        out = x + self.mlp(h)
        if self.role == "out":
            out = out @ self.tie.t()
        return out


def build_models(kind: str, num_stages: int, tied: bool) -> tuple[nn.Sequential, list[Stage]]:
    """The eager torch reference (one Parameter shared by its first and last stage when `tied`)
    and the pipeline's stages of `kind` holding the same values (each its own copy of the tie)."""
    torch.manual_seed(0)
    tie = nn.Parameter(torch.randn(H, H, **F64) / H ** 0.5) if tied else None
    roles = ["in" if tied and s == 0 else "out" if tied and s == num_stages - 1 else "" for s in range(num_stages)]
    ref = nn.Sequential(*[Stage("torch", tie if roles[s] else None, roles[s]) for s in range(num_stages)])
    stages = []
    for s in range(num_stages):
        st = Stage(kind, nn.Parameter(tie.detach().clone()) if roles[s] else None, roles[s])
        with torch.no_grad():
            for (name, mine), want in zip(st.named_parameters(), ref[s].parameters(), strict=True):
                assert mine.shape == want.shape, f"stage {s} {name}: {mine.shape} vs {want.shape}"
                mine.copy_(want)
        stages.append(st)
    return ref, stages


class _Watch(TaskFlops):
    """Test-only wrappers of the executor's B and W tasks and of each keyed W: FLOPs per (stage,
    task kind) (`split_cases.TaskFlops`), and per zbpp layer's W whether its job for that
    microbatch was pending (filed by B, not computed yet)."""

    def __init__(self) -> None:
        super().__init__()
        self.not_pending: list[str] = []
        self.keyed_computes = 0

    @contextlib.contextmanager
    def installed(self):
        keyed = _wgrad.KeyedWgrad
        orig_compute = keyed.compute

        def keyed_compute(adapter: Any, key: Any) -> None:
            self.keyed_computes += 1
            if key not in adapter.module.pending_wgrad_keys():
                self.not_pending.append(f"{type(adapter.module).__name__} key {key}")
            orig_compute(adapter, key)

        keyed.compute = keyed_compute
        try:
            with super().installed():
                yield self
        finally:
            keyed.compute = orig_compute


def compiled_case(case: str) -> list[str]:
    """One case ``"schedule/kind/how[/variant]"``; the failures seen on this rank (empty: passed).

    `how`: ``torch.compile`` (the stage wrapped) or ``module.compile`` (compiled in place), with the
    ``aot_eager`` backend, or ``inductor``. Variants: ``tied`` (a parameter tied between the first
    and the last stage), ``dp`` (two data-parallel replicas of a one-rank pipeline), ``nosplit``
    (``split_wgrad=False``).
    """
    try:
        return _case(*case.split("/"))
    except Exception:  # noqa: BLE001 - reported by the test with the rank's traceback
        return [traceback.format_exc()]


def _case(name: str, kind: str, how: str, variant: str = "") -> list[str]:
    import torch._dynamo

    from zbpp import ParallelGroups

    torch._dynamo.reset()  # each case compiles afresh
    counters = torch._dynamo.utils.counters
    counters.clear()
    dp = variant == "dp"
    groups = ParallelGroups(pp=1) if dp else None
    pp_rank, dp_rank = (groups.pp_rank, groups.dp_rank) if dp else (dist.get_rank(), 0)
    p = dist.get_world_size() // (2 if dp else 1)
    sched = build(name, num_ranks=p, num_microbatches=M)
    S = sched.num_stages
    ref, stages = build_models(kind, S, variant == "tied")
    backend = "inductor" if how == "inductor" else "aot_eager"
    mine: dict[int, nn.Module] = {}
    for s in sched.stages_on(pp_rank):
        if how == "module.compile":
            stages[s].compile(backend=backend)
            mine[s] = stages[s]
        else:
            mine[s] = torch.compile(stages[s], backend=backend)
    tied = {"tie": stages[s].tie for s in mine if stages[s].role} if variant == "tied" else {}
    pipe = Pipeline(mine, sched, F.mse_loss, groups=groups, tied_parameters=tied, split_wgrad=variant != "nosplit")
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(ROWS * (2 if dp else 1), H, generator=g, **F64), torch.randn(ROWS * (2 if dp else 1), H, generator=g, **F64)
    part = slice(dp_rank * ROWS, (dp_rank + 1) * ROWS)
    watch = _Watch()
    pipe.step(x[part], target=y[part])  # compiles
    compiled = counters["frames"]["ok"]
    for st in mine.values():
        st.zero_grad(set_to_none=True)
    with watch.installed():
        loss = pipe.step(x[part], target=y[part])
    fails: list[str] = []
    if not compiled:
        fails.append("nothing was compiled")
    if counters["frames"]["total"] != compiled:
        fails.append(f"the second step compiled again: {dict(counters['frames'])}")
    ref_loss = F.mse_loss(ref(x), y)
    ref_loss.backward()
    if loss is not None:  # each replica returns its own rows' loss
        with torch.no_grad():
            _compare("loss", loss, F.mse_loss(ref(x[part]), y[part]) if dp else ref_loss, fails)
    for s, st in mine.items():
        for (pn, a), b in zip(st.named_parameters(), ref[s].parameters(), strict=True):
            _compare(f"stage {s} grad {pn}", a.grad, b.grad, fails)
    if kind == "zbpp":
        fails += [f"W ran a job that B had not filed (computed in B?): {w}" for w in watch.not_pending]
        if not watch.keyed_computes:
            fails.append("no zbpp layer's W ran")
    if not variant:
        fails += _check_flops(kind, sched, watch)
    return fails


def _check_flops(kind: str, sched: Any, watch: _Watch) -> list[str]:
    fails = []
    unit = (ROWS // M) * H * H  # r H^2 (FlopCounterMode counts 2 per multiply-add, as the table)
    for (s, k), n in sorted(watch.count.items()):
        if k == "BW":
            fails.append(f"stage {s}: {n} BW tasks (this test expects B and W apart)")
            continue
        want_b, want_w = FLOPS["first" if s == 0 else kind]
        want = (want_b if k == "B" else want_w) * unit * n
        if watch.flops[(s, k)] != want:
            fails.append(f"stage {s} ({kind}): {n} {k} tasks did {watch.flops[(s, k)]} FLOPs, expected {want}")
    return fails


def _compare(what: str, got: torch.Tensor | None, want: torch.Tensor | None, fails: list[str]) -> None:
    if got is None or want is None:
        if (got is None) != (want is None):
            fails.append(f"{what}: {'no gradient' if got is None else 'a gradient'} where the reference has "
                         f"{'none' if want is None else 'one'}")
        return
    try:
        torch.testing.assert_close(got, want, **TOL)
    except AssertionError as exc:
        fails.append(f"{what}: {exc}")
