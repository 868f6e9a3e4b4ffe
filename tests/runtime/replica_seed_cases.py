"""What every rank runs in the test of dropout across data-parallel replicas.

Each data-parallel replica draws its own dropout masks: stage s of microbatch j on replica d runs
under ``microbatch_seed(base, step, s, j, d)`` (`zbpp.runtime.rng`, the documented derivation). The
reference is one process that runs every replica's microbatches in turn, seeding torch with that
seed before each stage (``torch.manual_seed``, as the rng module's docstring says to reproduce a
step), and weights each microbatch's loss by its rows over the rows of every replica (the default
``loss_weight`` with replicas: the gradient is the mean over all replicas' rows).

The model is `inputs_cases.Stage` (a tiny float64 LM, dropout 0.3 in every stage). Every replica
gets the same batch, so their losses differ only through their masks.

Tolerance: float64 ``rtol=1e-10, atol=1e-12`` (`inputs_cases.TOL`): the replicas' gradients are
summed by an all-reduce in another order than the reference's accumulation (~1e-15 relative);
one wrong mask moves a loss or a gradient by percents.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from zbpp import ParallelGroups, Pipeline
from zbpp.runtime import microbatch_seed

from .cases import make_schedule
from .inputs_cases import TOL, V, Stage, check_grads, loss_fn, padded_batch, unwrap

BASE_SEED = 4321
PDROP = 0.3


def documented_draws(stages: list[Stage], inputs: dict[str, Any], y: torch.Tensor, m: int, *, step: int,
                     replica: int, all_rows: int) -> torch.Tensor:
    """One process: replica `replica`'s microbatches, stage s of microbatch j after
    ``torch.manual_seed(microbatch_seed(BASE_SEED, step, s, j, replica))``; backward of each
    microbatch's loss times its rows over `all_rows`; returns the replica's own row-weighted loss."""
    rows = y.shape[0]
    own = torch.zeros((), dtype=torch.float64)
    for j, (h, t) in enumerate(zip(torch.tensor_split(inputs["h"], m), torch.tensor_split(y, m))):
        out: Any = unwrap(dict(inputs, h=h))
        for s, st in enumerate(stages):
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(microbatch_seed(BASE_SEED, step, s, j, replica))
                out = st(**out) if s == 0 else st(*out)
        loss = loss_fn(out, t)
        (loss * (t.shape[0] / all_rows)).backward()
        own = own + loss.detach() * (t.shape[0] / rows)
    return own


def check_dropout_across_replicas(name: str, pp: int, seed: int | None = BASE_SEED) -> float:
    """`dp` replicas of a `pp`-rank pipeline, one training step on the same batch: gradients equal
    the reference over every replica's draws; each replica's loss equals the reference's loss for
    that replica. Returns this rank's loss (NaN off the last stage) for the test to compare.
    `seed` None: every rank seeds torch itself, global rank 0 with `BASE_SEED` (the job's base)."""
    groups = ParallelGroups(pp=pp)
    dp = dist.get_world_size() // pp
    sched = make_schedule(name, pp, 2 * pp)
    m = sched.num_microbatches
    mine = {s: Stage(s, sched.num_stages, pdrop=PDROP) for s in sched.stages_on(groups.pp_rank)}
    if seed is None:  # as torch.manual_seed(global_rank): the replicas must still draw from one base
        torch.manual_seed(BASE_SEED + 1000 * dist.get_rank())
    pipe = Pipeline(mine, sched, loss_fn, seed=seed, groups=groups)
    inputs, y = padded_batch(3 * m + 1, seed=6)
    y = torch.randint(0, V, y.shape, generator=torch.Generator().manual_seed(7))
    loss = pipe.step(inputs, target=y)
    ref = [Stage(s, sched.num_stages, pdrop=PDROP) for s in range(sched.num_stages)]
    per_replica = [documented_draws(ref, inputs, y, m, step=0, replica=d, all_rows=dp * y.shape[0])
                   for d in range(dp)]
    check_grads(mine, ref, TOL, f"{name} pp={pp} dp={dp} dropout")
    if loss is None:
        return float("nan")
    torch.testing.assert_close(loss, per_replica[groups.dp_rank], msg=lambda s: f"replica {groups.dp_rank} loss: {s}",
                               **TOL)
    return loss.item()
