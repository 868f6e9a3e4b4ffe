"""float16 training with ``torch.amp.GradScaler`` over a whole pipeline.

Each rank's optimizer holds only its own stages' parameters, so ``scaler.step(optimizer)`` finds
infs in this rank's gradients only: one rank would skip a step that another takes, and the stages
would no longer belong to one run. `unscale_` unscales this rank's gradients and takes the maximum
of the found-inf flags over every rank of the job (the pipeline's ranks and its data-parallel
replicas, whose ``fully_shard`` gradients are shards), so every rank skips, or takes, the step that
one process running the whole model would, and every scaler backs off or grows alike.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from .._compat import grad_scaler_found_inf
from .agreement import collective_call

__all__ = ["unscale_"]

#: what the ranks compare of their scalers (a `GradScaler.state_dict`'s numbers): unlike ones diverge
_ALIKE = ("scale", "_growth_tracker", "growth_factor", "backoff_factor", "growth_interval")


def unscale_(pipeline: Any, scaler: Any, optimizer: torch.optim.Optimizer) -> bool:
    """``scaler.unscale_(optimizer)`` for a pipeline: every rank of the job skips the same steps.

    Call it on every rank after `Pipeline.step`, with the loss scaled in `loss_fn` where a backward
    follows (``return scaler.scale(loss) if torch.is_grad_enabled() else loss``: `Pipeline.eval_step`
    runs without grad, so it returns the loss itself, not one scaled by whatever the scale is now;
    `Pipeline.step` returns the scaled loss), and before
    ``clip_grad_norm_`` and ``scaler.step(optimizer)``; then ``scaler.update()`` as usual. It
    unscales this rank's gradients (unless ``scaler.unscale_(optimizer)`` already did since the last
    ``update()``) and sets the optimizer's found-inf flags to their maximum over every rank of the
    `Pipeline`'s job (its pipeline ranks and data-parallel replicas): ``scaler.step`` then skips the
    step on every rank where any gradient anywhere is inf or NaN, as one process running the whole
    model would, and ``scaler.update()`` moves every rank's scale alike. A rank whose ``scaler.scale``
    never ran (no loss there) gets its scale from ``init_scale``; a rank without gradients gets a
    flag, so ``step`` and ``update`` run there too.

    The ranks all-reduce one small host tensor, which also tells whether a rank failed (a rank's error
    raises there, a `PipelineError` naming it on every other); scalers that differ (enabled on some
    ranks only, or another scale, growth tracker or factor: built or loaded unlike) raise a
    ValueError on every rank, naming what differs. Call it once per optimizer.

    Args:
        pipeline: this rank's `Pipeline`.
        scaler: a ``torch.amp.GradScaler``, built alike on every rank (disabled: nothing to do,
            but every rank still calls it).
        optimizer: an optimizer over this rank's stage parameters.

    Returns:
        Whether some rank found an inf or NaN: ``scaler.step(optimizer)`` skips this step.

    In one process (every rank of a job runs the same lines):

    >>> import torch
    >>> from zbpp import Pipeline
    >>> from zbpp.schedules import build
    >>> model = torch.nn.Linear(3, 1)
    >>> scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 8)
    >>> def loss_fn(out, y):  # scaled where a backward follows: in step, not in eval_step
    ...     loss = torch.nn.functional.mse_loss(out, y)
    ...     return scaler.scale(loss) if torch.is_grad_enabled() else loss
    >>> pipe = Pipeline({0: model}, build("zb-h1", num_ranks=1, num_microbatches=2), loss_fn=loss_fn)
    >>> opt = torch.optim.SGD(model.parameters(), lr=0.1)
    >>> x, y = torch.arange(12.0).reshape(4, 3) / 10, torch.zeros(4, 1)
    >>> scaled = pipe.step(x, target=y)  # the loss times the scale
    >>> unscale_(pipe, scaler, opt)  # no inf anywhere: the step is taken
    False
    >>> scaler.step(opt); scaler.update()

    `eval_step`'s loss is the loss itself, as one process running the model gives it (float32: the
    mean of two microbatch means against one mean, equal to rounding, well within allclose's 1e-5):

    >>> torch.allclose(pipe.eval_step(x, target=y), torch.nn.functional.mse_loss(model(x), y))
    True
    """
    unusable = getattr(pipeline, "_raise_if_unusable", None)
    if not callable(unusable):
        raise TypeError(f"unscale_ takes a zbpp Pipeline (its ranks agree on the flags), got {type(pipeline).__name__}")
    unusable()  # a Pipeline that found its job broken: the all-reduce would wait for a dead rank
    with collective_call():  # an interrupt while the ranks agree comes once the call is done
        return _unscale(pipeline, scaler, optimizer)


def _unscale(pipeline: Any, scaler: Any, optimizer: torch.optim.Optimizer) -> bool:
    """`unscale_`'s work, inside its `collective_call`."""
    flags: dict[torch.device, torch.Tensor] = {}
    mine = [0.0] * (2 + len(_ALIKE))  # enabled, found, then _ALIKE
    try:
        if scaler.is_enabled():
            _refuse_main_grads(pipeline, optimizer)
            flags = grad_scaler_found_inf(scaler, optimizer, pipeline.device)
            state = scaler.state_dict()
            mine = [1.0, float(sum(float(f.item()) for f in flags.values()) > 0)] + [float(state[k]) for k in _ALIKE]
        problem = None
    except (Exception, KeyboardInterrupt, SystemExit) as exc:  # noqa: BLE001 - raised on every rank by the agreement
        problem = exc
    # one all-reduce on the job's host group: whether some rank failed (its local part raised), then the
    # maximum and (negated) the minimum of each number; the errors' messages travel only when one did
    both = torch.tensor([float(problem is not None)] + mine + [-v for v in mine], dtype=torch.float64)
    group = pipeline._agreement.group
    held = None
    if group is not None:  # None: a one-process Pipeline
        work = dist.all_reduce(both, op=dist.ReduceOp.MAX, group=group, async_op=True)
        held = pipeline._wait_collective(work, torch.device("cpu"), "all-reduce of unscale_")
    if both[0] > 0:
        try:
            pipeline._agree_before_collectives(problem, "unscale_", some_failed=True)
        except BaseException as exc:  # a Ctrl-C held in the all-reduce: raised from the failure, as collective_call does
            if held is None or isinstance(held, Exception):
                raise
            raise held from exc
    high, low = both[1: 1 + len(mine)].tolist(), [-v for v in both[1 + len(mine):].tolist()]
    if high[0] != low[0]:
        raise ValueError("unscale_: the GradScaler is enabled on some ranks of the pipeline and disabled on others: "
                         "those would step where the others skip; build it alike on every rank")
    for name, hi, lo in zip(_ALIKE, high[2:], low[2:]):
        if hi != lo:
            raise ValueError(f"unscale_: the ranks' GradScalers differ in {name!r} (from {lo!r} to {hi!r}): their "
                             "scales would not move alike; build them alike, and load each with grad_scaler= from "
                             "one checkpoint")
    found = high[1] > 0
    if high[0]:
        for flag in flags.values():
            flag.fill_(float(found))
        if not flags:  # no gradient here: step and update assert that some flag was recorded
            flags[pipeline.device] = torch.full((), float(found), dtype=torch.float32, device=pipeline.device)
    if held is not None:  # a Ctrl-C in the all-reduce: the peers completed it, every flag is set
        raise held
    return found


def _refuse_main_grads(pipeline: Any, optimizer: torch.optim.Optimizer) -> None:
    """Raise, naming one, where a parameter of `optimizer` keeps its gradient in ``main_grad``:
    GradScaler unscales and checks ``.grad`` only, so that gradient would reach the step scaled and
    unchecked."""
    held = {id(p) for group in optimizer.param_groups for p in group["params"]
            if getattr(p, "main_grad", None) is not None}
    if not held:
        return
    names = [f"stage {s} {n}" for s, m in pipeline.stage_modules.items() for n, p in m.named_parameters()
             if id(p) in held] or ["a parameter outside the stages"]
    raise ValueError(f"unscale_: {names[0]}{f' (and {len(held) - 1} more)' if len(held) > 1 else ''} keeps its "
                     "gradient in main_grad, which torch.amp.GradScaler neither unscales nor checks for infs "
                     "(it reads .grad only): train those layers without main_grad (fuse_wgrad_accumulation off) "
                     "or in bfloat16, which needs no loss scaling")
