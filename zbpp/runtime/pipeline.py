"""`Pipeline`: run any zbpp `Schedule` over the ranks of a pipeline, one step at a time.

Every rank runs the same script (torchrun) and builds a `Pipeline` with the stage modules it
holds. ``step(inputs, target)`` splits the batch into the schedule's microbatches, runs this rank's
tasks in the schedule's order (one interpreter for every schedule: `zbpp.runtime.executor`) and
leaves in ``.grad`` (or ``main_grad``) the gradient of the batch-mean loss, as one process running
the whole model on the whole batch would. See docs/DESIGN.md.

`Pipeline.step` is the story of a step: agree on the input (`zbpp.runtime.agreement`), begin the
reductions (`zbpp.runtime.reductions`: gradients of earlier steps set aside, data-parallel and tied
reductions), run this rank's tasks (`zbpp.runtime.executor`), finish the reductions, agree on the
outcome, then commit the gradients or roll them back. What a failure does is told where it
happens: draining in `zbpp.runtime.executor`, the agreements and a dead rank in
`zbpp.runtime.agreement`, the gradients in `Reductions.rollback`.
"""

from __future__ import annotations

import contextlib
import gc
import itertools
import weakref
from collections import OrderedDict
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Callable, Iterator, Mapping

import torch
from torch import nn

from .._compat import module_buffers
from ..schedules.ir import Kind, Schedule
from ..schedules.program import Program, make_program
from ..schedules.simulate import Costs
from .arguments import check_arguments, check_stage_modules
from .agreement import (Agreement, BrokenJob, StartReport, agree_nothing_failed, agree_on_problems, agree_to_build,
                        collective_call, decide_end, decide_start)
from .channels import Channels, agreement_group, default_timeout
from .comm_queue import CommQueue
from .executor import PipelineError, StepExecutor, StepInputs, StepResults
from .errors import describe_error
from .failure import StepFailure
from .loss_weights import row_factors, weight_factors
from .task_times import TaskRecorder, gather_records
from .reductions import Reductions, default_reducer, fsdp_reducer, presence_group
from .replica_buffers import ReplicaBuffers
from .rng import microbatch_seed, seeded
from .task_graphs import EAGER, AutoGraphs, GraphCache, TaskGraphs, TaskRunner, graph_cache
from .tied import TiedParameters, check_reducer_leaves_ties, drifted_ties_error, local_ties
from .topology import Topology
from .step_input import (BuiltParameters, LocalBatch, Walks, autocast_state, local_batch, merge, module_state, release_step_caches,
                         stable_hash, stage_walks, unique_parameters)
from .wgrad import StageWgrad, check_fifo_wgrad, has_own_wgrad

__all__ = ["Pipeline"]

_LIVE: "weakref.WeakSet[Pipeline]" = weakref.WeakSet()  # every Pipeline built here, while referenced
_BUILT = itertools.count()
_MAX_SIGNATURES = 16  # cached input signatures (each holds one Spec per cross-rank activation)


@dataclass
class _Step:
    """One step of this rank, as the start agreement set it up; `_run_tasks` fills the rest."""

    forward_only: bool
    signature: tuple
    new_signature: bool
    data: StepInputs
    executor: StepExecutor
    comm: CommQueue
    failure: StepFailure
    walks: Walks  #: this rank's stages' modules and parameters, as the step found them
    params: list[nn.Parameter]  #: this rank's parameters, each once (training steps; [] for forward-only)
    rng_step: int  #: the step's index in the derivation of its seeds (`Pipeline.rng_step` before it)
    rows: int  #: the batch's rows (the start agreement's)
    #: the fixed ``.grad`` buffers of `params` that the step attaches after its first F tasks (task
    #: graphs after ``zero_grad()``: `GradBuffers.cleared`), or None: attached before any task
    cleared: list[torch.Tensor] | None = None
    runner: TaskRunner = EAGER
    results: StepResults = field(default_factory=StepResults)
    #: what interrupted this rank while it waited for the end agreement of a step that succeeded
    #: everywhere (`Agreement.take_held`: raised once the step is committed), or while it rolled a
    #: failed step back (`Pipeline._roll_back`: raised in place of the step's error)
    after: BaseException | None = None


def _live_pipelines(collect: bool = False) -> list["Pipeline"]:
    """The Pipelines of this process that are still referenced, oldest first; `collect`: after a
    garbage collection (a dropped Pipeline in a reference cycle lingers until one)."""
    if collect:
        gc.collect()
    return sorted(_LIVE, key=lambda p: p._built_order)


class Pipeline:
    """Run `schedule` over this rank's `stage_modules`.

    Args:
        stage_modules: ``{stage: module}`` for exactly the stages `schedule` places on this rank
            (``schedule.stages_on(pp_rank)``). They must already be on `device`.
        schedule: a `zbpp.schedules.Schedule` (validated here; an invalid one raises `ScheduleError`).
        loss_fn: ``loss_fn(output, target) -> scalar tensor``, the mean over one microbatch. Used on
            the rank holding the last stage.
        groups: None (the default process group is the pipeline), a `ParallelGroups`, or a
            ``DeviceMesh`` with a ``"pp"`` dimension (and optionally ``"dp"``); with data
            parallelism gradients are averaged over the replicas (`zbpp.runtime.topology`) and,
            after every step, persistent module buffers (BatchNorm's running statistics) are
            broadcast from replica 0 (`zbpp.runtime.replica_buffers`).
        device: where activations live; default: the current CUDA device under NCCL, else the
            device of the stage modules' first parameter, else the CPU.
        record_task_times: record each task's start and end (see `task_times`).
        free_sent_activations: release a sent activation's memory as soon as it is handed to its
            send (B still works: only the autograd node is kept). Turn off only if your code holds
            on to stage outputs.
        reducer: the data-parallel reducer to drive (a `zbpp.runtime.reductions.GradientReducer`);
            default: a `zbpp.runtime.grad_reduce.GradReducer` when there are data-parallel
            replicas, a `zbpp.runtime.fsdp.FsdpReducer` when the stages are ``fully_shard`` modules
            (then no other reducer may be given), else none. It must leave `tied_parameters` out
            (``GradReducer(..., exclude=...)``): the pipeline reduces those itself. That is checked
            only for a reducer that lists its parameters with ``params()`` (as `GradReducer`
            does); any other is trusted to: a tie it reduces too gets a wrong gradient, no error.
        keep_grads_on_failure: gradients accumulated by earlier steps survive a failed step (only
            its own contribution goes; what it costs: `zbpp.runtime.grad_aside`). False: a failed
            step sets ``.grad`` to None and zeroes ``main_grad``.
        costs: the task and link times that place sends and receives
            (`zbpp.schedules.program.make_program`); default unit costs and a fast link. Pass measured
            costs (`Costs.from_task_times`, with ``comm``) on slow links.
        timeout: seconds a peer may take before the pipeline's own groups fail; default: the
            default process group's timeout.
        tied_parameters: ``{name: parameter}``: this rank's copies of parameters that several
            ranks hold (GPT's embedding and LM head); every holder passes its copy under the same
            name; after each step every copy holds the sum of all uses' gradients, averaged over
            the replicas (`zbpp.runtime.tied`). Every rank builds its `Pipeline` with or without.
        loss_weight: ``loss_weight(target_j) -> w_j`` (a number or a one-element tensor), the weight
            of microbatch j's loss: the step's loss and gradients are those of ``sum_j w_j * loss_j
            / sum_j w_j``; for a token-mean loss, its token count, e.g. ``lambda y: (y != -100).sum()``.
            Default (None): the rows of microbatch j. Weight 0, data parallelism, and what it
            costs: `zbpp.runtime.loss_weights`. Every rank builds its `Pipeline` with the same one.
        seed: the random draws of each F task (dropout...) use generators seeded from
            ``microbatch_seed(seed, step, stage, microbatch, dp_rank)`` (`zbpp.runtime.rng`): a
            step's result does not depend on the schedule. None (the default) or True: global
            rank 0's ``torch.initial_seed()``; an int: that seed (global rank 0's, where ranks pass
            different ones); False: the global generators as they run (each rank's own, drawn in its
            task order, which no checkpoint holds: a resumed run's dropout then continues the
            uninterrupted one in distribution, not bit for bit). One base seed for the whole
            job: replicas differ only through ``dp_rank``. ``rng_step`` counts the steps (training
            and evaluation) in the derivation; a step that raised `PipelineError` does not count
            (every rank alike): retrying its batch draws what the uninterrupted run's step drew.
        split_wgrad: under schedules with W tasks, B computes only the gradient the previous stage
            needs and W every weight gradient, for any module (how, what W keeps, compiled regions:
            `zbpp.runtime._autograd_split`). False: plain modules get their weight gradients in B.
        cuda_graphs: True: from each input signature's second training step on, replay every task
            of this rank from a CUDA graph captured in the schedule's order (bit-identical to eager
            steps; sends, receives, reductions outside). ``"auto"``: time both forms, keep the faster
            (``fully_shard`` stages, which graphs cannot capture: eager steps, as with False).
            CUDA only; rules: `zbpp.runtime.task_graphs` (CPU tests pass its `StandInGraphs`).
            Clear gradients between steps with ``zero_grad()`` (``set_to_none=True``): gradients
            zeroed in place count as earlier ones, which every replayed step adds back.

    Microbatches: every tensor of ``inputs`` (and of ``target``) is split along dim 0 with
    ``torch.tensor_split`` into ``schedule.num_microbatches`` parts (sizes may differ by one), except
    shared values (one row, or wrapped in `Replicated`: `zbpp.runtime.tree`); a target whose rows
    differ from the input's raises on every rank. A stage is called as ``module(*x)`` for a
    tuple/list, ``module(**x)`` for a dict (or other mapping: a tokenizer's ``BatchEncoding``), else
    ``module(x)``; its outputs may be tensors, tuples, lists or dicts of them, with non-tensor values
    passed along.

    A step that raised `PipelineError` is rolled back on every rank alike: its gradients
    (``keep_grads_on_failure``) and its index in the random stream (``rng_step``), so that retrying
    its batch repeats the uninterrupted run's step. What its tasks changed in the modules is not
    undone (copying it aside would cost every step): buffers such as BatchNorm's running statistics
    keep the updates of the forwards it ran (with replicas: replica 0's, as after any step), and
    the FP8 delayed-scaling state of zbpp layers (amax histories, scales) the amaxes of its casts. Where those must be exact, resume from a checkpoint
    (`zbpp.runtime.checkpoint` restores both) or save and restore the buffers around the step.

    Example (one process; with torchrun every rank does the same with its own stages)::

        >>> import torch
        >>> from zbpp.schedules import build
        >>> torch.manual_seed(0) and None
        >>> sched = build("zb-h1", num_ranks=1, num_microbatches=4)
        >>> model = torch.nn.Linear(3, 1)
        >>> pipe = Pipeline({0: model}, sched, loss_fn=torch.nn.functional.mse_loss)
        >>> loss = pipe.step(torch.ones(8, 3), target=torch.zeros(8, 1))
        >>> ref = torch.nn.functional.mse_loss(model(torch.ones(8, 3)), torch.zeros(8, 1))
        >>> bool(torch.allclose(loss, ref))
        True
    """

    @collective_call()  # an interrupt while this rank agreed comes once every rank built its part
    def __init__(
        self,
        stage_modules: Mapping[int, nn.Module],
        schedule: Schedule,
        loss_fn: Callable[[Any, Any], torch.Tensor],
        *,
        groups: Any = None,
        device: torch.device | str | None = None,
        record_task_times: bool = False,
        free_sent_activations: bool = True,
        reducer: Any = None,
        keep_grads_on_failure: bool = True,
        costs: Costs | None = None,
        timeout: float | None = None,
        tied_parameters: Mapping[str, nn.Parameter] | None = None,
        loss_weight: Callable[[Any], Any] | None = None,
        seed: int | bool | None = None,
        split_wgrad: bool = True,
        cuda_graphs: bool | str | type[TaskGraphs] | AutoGraphs = False,
    ) -> None:
        check_arguments(schedule, loss_fn, stage_modules, costs, timeout, loss_weight, seed)
        self.loss_weight = loss_weight
        #: the F tasks run under seeded generators (`zbpp.runtime.rng`); False: the global ones as they run
        self.seeded = seed is not False
        seed_here = (torch.initial_seed() if seed is None or seed is True else int(seed)) & ((1 << 63) - 1)
        #: the index of the next step (training or evaluation) in the derivation of its seeds (a failed
        #: step gives its index back); save it with a checkpoint and set it back to resume the same streams
        self.rng_step = 0
        self.schedule = schedule
        self.loss_fn = loss_fn
        self.topology = Topology.resolve(groups, schedule.num_ranks)
        self.pp_rank: int = self.topology.pp_rank
        span = timedelta(seconds=timeout) if timeout is not None else (default_timeout() if self.topology.distributed else timedelta(minutes=10))
        self._agreement = Agreement(agreement_group(self.topology, span))
        problem: Exception | None = None
        plan: tuple[int, str] | None = None
        try:  # this rank's checks: a rank that fails them tells the others before any of them waits for it
            check_stage_modules(stage_modules, schedule, self.pp_rank)
            self.stage_modules: dict[int, nn.Module] = dict(sorted(stage_modules.items()))
            self._program: Program = make_program(schedule, costs=costs)
            self._costs = costs
            self._eval_program: Program | None = None
            self._wgrad = {s: StageWgrad(m) for s, m in self.stage_modules.items()}
            self._built_params = BuiltParameters(stage_walks(self.stage_modules))
            check_fifo_wgrad(self._wgrad, schedule)
            plan = _schedule_key(schedule)  # every rank's must be the same: agreed below
            self.split_wgrad = bool(split_wgrad)
            tasks = self._program.ranks[self.pp_rank].tasks
            has_b = {t.stage for t in tasks if t.kind is Kind.B}
            self._split_stages = {s for s in self.stage_modules
                                  if s in has_b and has_own_wgrad(self.stage_modules[s], self._wgrad[s])} if self.split_wgrad else set()
            self.device = torch.device(device) if device is not None else self.topology.default_device(self.stage_modules)
            self.record_task_times = bool(record_task_times)
            self.free_sent_activations = bool(free_sent_activations)
            self.keep_grads_on_failure = bool(keep_grads_on_failure)
            self._recorder = TaskRecorder(self.pp_rank, self.device) if self.record_task_times else None
            self._specs: OrderedDict[tuple[Any, ...], dict[tuple[int, int], Any]] = OrderedDict()
            self._in_flight: list[tuple[list[Any], list[torch.Tensor]]] = []
            self._broken: str | None = None
            self._graph_cache: GraphCache | None = None
            first_forward = list(dict.fromkeys(a.stage for a in tasks if a.kind is Kind.F))
            fsdp = fsdp_reducer(self.stage_modules, self.topology, first_forward, reducer)
            ties = local_ties(tied_parameters or {}, self.stage_modules, fsdp.split_copies() if fsdp is not None else ())
            check_reducer_leaves_ties(reducer, ties)
        except (Exception, KeyboardInterrupt, SystemExit) as exc:  # noqa: BLE001 - raised below, on every rank
            problem = exc
        # one base seed for the whole job (global rank 0's): a checkpoint's single copy resumes every replica
        self._base_seed = agree_to_build(self._agreement, problem, self.topology.world, seed_here, plan)
        self._channels = Channels(self.topology, self._program.channels, self.device, span) if self.topology.pp_size > 1 else None
        self._tied = TiedParameters(ties, self.topology, schedule.placement, self._agreement, self.device, span)
        self._replica_buffers = ReplicaBuffers.of(self.stage_modules, self.topology, span)  # a collective: before the try
        problem = None
        try:  # this rank's own parts: an error (a stage's get_backward_dw_params, a module CUDA graphs cannot capture)
            # is told here as the checks above are, not found by the peers waiting in the first step until the timeout
            self._set_up_reductions(reducer, fsdp, cuda_graphs, span)  # its one collective comes first
        except (Exception, KeyboardInterrupt, SystemExit) as exc:  # noqa: BLE001 - raised below, on every rank
            problem = exc
        agree_on_problems(self._agreement, problem, self.topology.world, "Pipeline could not be built on every rank")
        self._sync_gradients = True  # False inside no_sync()
        self._built_order = next(_BUILT)
        _LIVE.add(self)  # `clip_grad_norm_` finds the pipeline of parameters given alone

    # -- public -------------------------------------------------------------------------------
    @property
    def num_microbatches(self) -> int:
        return self.schedule.num_microbatches

    @property
    def holds_first_stage(self) -> bool:
        return 0 in self.stage_modules

    @property
    def holds_last_stage(self) -> bool:
        return self.schedule.num_stages - 1 in self.stage_modules

    @property
    def program(self) -> Program:
        """The program its training steps execute (`zbpp.schedules.program.make_program` of the
        schedule, with ``costs``); `zbpp.schedules.program.program_makespan` predicts its step."""
        return self._program

    @property
    def reducer(self) -> Any:
        """The data-parallel `GradReducer` (`FsdpReducer` for ``fully_shard`` stages), or None
        without data parallelism."""
        return self._reductions.reducer

    @property
    def graph_forms(self) -> list[str]:
        """How the training steps of each input signature it remembers run (least recently used
        first): ``"graphs"`` (task graphs), ``"eager"`` (``cuda_graphs="auto"`` measured it faster)
        or ``"trial"`` (still timing both); [] without task graphs."""
        return self._graph_cache.forms() if self._graph_cache is not None else []

    def parameters(self) -> Iterator[nn.Parameter]:
        """This rank's parameters (of all its stages), each once."""
        yield from unique_parameters(stage_walks(self.stage_modules))

    def step(self, inputs: Any = None, target: Any = None, *, losses: list | None = None) -> torch.Tensor | None:
        """Run one training step's forward and backward.

        Every rank may pass `inputs` and `target`; only the rank holding stage 0 uses `inputs`
        and only the one holding the last stage uses `target`. Returns the batch's loss (the mean
        over rows, or weighted by ``loss_weight``; a detached scalar tensor, never synchronised with
        the device) on the rank holding the last stage, None elsewhere. Gradients are accumulated
        into ``.grad`` (zero them between steps as usual) or ``main_grad``. With `losses` (a list), the rank holding the last stage appends
        each microbatch's loss, in microbatch order, as `loss_fn` returned it (unweighted, detached; NaN for a microbatch
        that ``loss_weight`` gives 0 if `loss_fn` averages over nothing).

        Raises `PipelineError` on every rank when any rank fails (see the module docstring).
        """
        # told in the start agreement, not raised here: often only the last rank passes `losses`,
        # and its peers would wait for it there (or pair with its next step)
        bad = (TypeError(f"losses must be a list to append the microbatch losses to, got {type(losses).__name__}")
               if losses is not None and not isinstance(losses, list) else None)
        step = self._agree_start(inputs, target, forward_only=False, problem=bad)  # agree on the input

        def set_aside() -> None:
            if self._graph_cache is not None:  # after zero_grad(): .grad attached after the first F tasks
                step.cleared = self._graph_cache.grad_buffers.cleared(step.params)
            self._reductions.set_aside(step.params, reducing=self._sync_gradients, later=step.cleared is not None)

        early = _first_error(set_aside)
        with self._compute_stream(step):
            # a failure before the first task drains this rank like a task's would: raising here
            # would leave its peers waiting for its messages until the group's timeout
            for exc in (early, _first_error(lambda: self._reductions.begin(lambda: step.failure.draining))):
                if exc is not None:
                    step.failure.fail(exc, None)
            problem = _first_error(lambda: self._run_tasks(step),  # with the program's communication
                                   lambda: step.failure.draining or self._reductions.finish())
        self._sync_buffers(step)  # before the end agreement, which then tells every rank how it went
        failure = self._agree_end(step, problem)  # agree on the outcome
        release_step_caches(step.walks)  # replays never read them; the next step casts afresh
        if failure is not None:
            raise failure  # the step was rolled back (its task records too: `task_times` keeps the last good step's)
        if self._recorder is not None:
            self._recorder.commit()
        if self._graph_cache is not None:
            self._graph_cache.captured(step.runner)
        # a half-committed step would lose earlier gradients: an interrupt comes once it is done
        held = _to_the_end(self._reductions.commit)
        step.after = step.after or held
        if losses is not None and self.holds_last_stage:
            losses.extend(step.results.microbatch_losses())
        if step.after is not None:
            raise step.after
        return step.results.loss()

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Steps inside accumulate gradients without the data-parallel reduction (DDP's ``no_sync``)
        nor the tied parameters' one: each copy keeps its own. The next step outside reduces
        everything accumulated, once. Gradients that earlier steps left count once: a tied copy
        other than its lowest stage's holds only the window's own gradient until then.

        >>> import torch
        >>> from zbpp.schedules import build
        >>> pipe = Pipeline({0: torch.nn.Linear(2, 1)}, build("1f1b", num_ranks=1, num_microbatches=2),
        ...                 loss_fn=lambda out, y: out.square().mean())
        >>> with pipe.no_sync():
        ...     _ = pipe.step(torch.ones(4, 2))
        >>> _ = pipe.step(torch.ones(4, 2))  # reduces what both steps accumulated
        """
        before = self._sync_gradients
        self._sync_gradients = False
        try:
            yield
        finally:
            self._sync_gradients = before

    def eval_step(self, inputs: Any = None, target: Any = None) -> Any:
        """Run the forward pass only (F tasks in the schedule's order, under ``torch.no_grad``).

        On the rank holding the last stage returns, without `target`, the last stage's outputs of
        all microbatches merged along dim 0 (the batch's output, tensors concatenated; a 0-dim
        tensor, which has no rows, stacked into one value per microbatch; a shared one-row tensor,
        as ``step`` shares an input's, once; other values from the first microbatch:
        `zbpp.runtime.step_input.merge`); with `target`, the batch's loss (weighted as in `step`; as
        `loss_fn` gives it under ``torch.no_grad``: a float16 run's scales it only where grad is on,
        `zbpp.runtime.unscale_`).
        None elsewhere. No gradient is touched; activations are freed as they go. Modules keep their
        train/eval mode: call ``module.eval()`` yourself for dropout or batch norm.

        >>> import torch
        >>> from zbpp.schedules import build
        >>> pipe = Pipeline({0: torch.nn.Linear(3, 2)}, build("1f1b", num_ranks=1, num_microbatches=2),
        ...                 loss_fn=torch.nn.functional.mse_loss)
        >>> tuple(pipe.eval_step(torch.ones(4, 3)).shape)
        (4, 2)
        """
        step = self._agree_start(inputs, target, forward_only=True)
        with torch.no_grad():
            began = _first_error(self._reductions.begin_eval)  # drains this rank, as in `step`
            if began is not None:
                step.failure.fail(began, None)
            problem = _first_error(lambda: self._run_tasks(step), self._reductions.finish_eval)
        self._sync_buffers(step)  # a BatchNorm in training mode moved its running statistics
        failure = self._agree_end(step, problem)
        release_step_caches(step.walks)
        if failure is not None:
            raise failure
        if step.after is not None:
            raise step.after
        if not self.holds_last_stage:
            return None
        if target is not None:
            return step.results.loss()
        return merge([step.results.outputs[j] for j in range(self.num_microbatches)], step.rows)

    def task_times(self) -> list[dict[str, Any]] | None:
        """The task records of every rank of the last training step that succeeded (a step that
        raised `PipelineError` records nothing; [] before any), on pipeline rank 0 (None on the others):
        ``{"rank", "action", "start", "end"}``: seconds from the step's start, one instant for every
        rank (the end of the start agreement), so that the ranks' records share one timeline.
        Collective over the pipeline group: every rank of it must call it. Needs ``record_task_times=True``."""
        self._raise_if_unusable()
        if self._recorder is None:
            raise RuntimeError("task_times() needs Pipeline(..., record_task_times=True)")
        return gather_records(self._recorder, self.topology)

    @collective_call()  # an interrupt while this rank agreed comes once every rank compared
    def check_ties(self) -> None:
        """Raise, on every rank alike, if the copies of some tied parameter differ (collective over every
        rank of the job, between steps).

        Each copy gets the same summed gradient, so the copies stay equal only while every copy's
        optimizer treats it alike. Parameter groups chosen by name break that silently: a weight decay
        that excludes names containing "embed" decays the LM head's copy and not the embedding's, so
        the copies drift apart while each rank's model looks fine. Call it after the first optimizer
        step when grouping parameters by name; `save_checkpoint` and `zbpp.models.hf.save_pretrained`
        call it before writing anything, `load_checkpoint` after loading. The comparison is exact
        (bit patterns; a ``RuntimeError`` names the tie, the ranks and stages holding its copies and
        the largest difference) and costs two all-reduces of each copy over the ranks holding it; a
        V placement's Parameter that one rank's two stages share has nothing to compare,
        ``fully_shard`` copies are compared shard by shard.

        >>> import torch
        >>> from zbpp.schedules import build
        >>> pipe = Pipeline({0: torch.nn.Linear(2, 1)}, build("1f1b", num_ranks=1, num_microbatches=1),
        ...                 loss_fn=torch.nn.functional.mse_loss)
        >>> pipe.check_ties()  # no tie here: nothing to compare
        """
        self._check_ties()

    def _check_ties(self, loaded_from: str | None = None) -> None:
        """`check_ties`; `loaded_from`: the checkpoint that `load_checkpoint` just loaded (its error
        then says that the checkpoint's values differ)."""
        self._raise_if_unusable()
        try:
            self._compare_ties(loaded_from)
        except BrokenJob as exc:  # a rank died since the last step: unusable, as a step would find it
            raise self._broken_error(exc, "agreement of check_ties") from exc

    def _compare_ties(self, loaded_from: str | None = None) -> None:
        try:
            snapshot, problem = self._tied.snapshot(), None
        except (Exception, KeyboardInterrupt, SystemExit) as exc:  # noqa: BLE001 - raised on every rank by the agreement
            snapshot, problem = [], exc
        # every rank has its copies ready before any of them enters a tie's collective
        agree_on_problems(self._agreement, problem, self.topology.world, "check_ties could not run on every rank")
        try:
            mine, problem = (self.topology.global_rank, self._tied.compare(snapshot),
                             self._tied.copy_names(self.stage_modules)), None
        except BrokenJob:  # a rank is gone (marked in the store): no agreement could complete
            raise
        except (Exception, KeyboardInterrupt, SystemExit) as exc:  # noqa: BLE001 - raised on every rank by the agreement
            mine, problem = None, exc
        reports = agree_on_problems(self._agreement, problem, self.topology.world,
                                    "check_ties could not compare on every rank", payload=mine)
        error = drifted_ties_error(reports, loaded_from)
        if error is not None:
            raise error

    # -- a step -------------------------------------------------------------------------------
    def _agree_start(self, inputs: Any, target: Any, *, forward_only: bool,
                     problem: BaseException | None = None) -> _Step:
        """Check the input everywhere (the start agreement) and set the step up; `problem`: this
        rank's arguments are wrong (it raises it, every other rank an error naming it)."""
        self._raise_if_unusable()
        m = self.schedule.num_microbatches
        walks = stage_walks(self.stage_modules)  # read once per step
        try:
            if problem is not None:
                raise problem
            if not forward_only:  # a delayed module the step's W, or a parameter the reductions, would not know of
                for s, w in self._wgrad.items():
                    w.check_delayed(s, self.stage_modules[s], walks[s][0])
                self._built_params.check(self.stage_modules, walks)
            batch, problem = local_batch(inputs, target, microbatches=m, device=self.device, first=self.holds_first_stage,
                                         last=self.holds_last_stage, loss_weight=self.loss_weight,
                                         forward_only=forward_only, rank=self.pp_rank), None
        except (Exception, KeyboardInterrupt, SystemExit) as exc:  # noqa: BLE001
            # reported to every rank by the agreement; an interrupt too (in loss_weight, say): the peers wait in it
            batch, problem = None, exc
        b = batch if batch is not None else LocalBatch()  # nothing of the input on this rank
        trial = self._graph_cache.trial_report() if self._graph_cache is not None else (False, 0, 0, 0)
        state = (module_state(walks), autocast_state(self.device), forward_only)
        reduces = self._reductions.reducer is not None or bool(self._tied.names)
        trains, frozen = self._tied.training_flags() if not forward_only else (0, 0)
        ties = {"ties_training": trains, "ties_frozen": frozen}
        mine = StartReport(problem is not None, stable_hash(state),
                           b.input_hash, b.input_rows, b.target_rows, *trial, target_hash=b.target_hash,
                           reducing=0 if forward_only or not reduces else 1 if self._sync_gradients else 2,
                           evaluating=forward_only, **ties,
                           delaying_hash=0 if forward_only else stable_hash(self._delaying()))
        try:
            agreed = decide_start(self._agreement, mine, problem, self.topology, self.schedule, forward_only,
                                  self._tied.all_names, self._not_delaying)
        except BaseException as exc:  # every rank raises: nothing is computed
            held = self._agreement.take_held()
            error = self._broken_error(exc, "start-of-step agreement") if isinstance(exc, BrokenJob) else exc
            if held is not None and not isinstance(held, Exception):
                raise held from error  # this rank's interrupt goes on
            raise error
        # an interrupt while this rank agreed: its peers go into the step, so it drains it (and
        # raises the interrupt after the end agreement, as for one in a task)
        held = self._agreement.take_held()
        if self._recorder is not None and not forward_only:
            # the agreement is a collective that every rank leaves at (nearly) one instant: the
            # step's time 0 on every rank, whatever each does before its first task
            self._recorder.begin_step()
        if self._graph_cache is not None:
            self._graph_cache.settle(agreed.graphs)  # the same decision on every rank
        rng_step, self.rng_step = self.rng_step, self.rng_step + 1
        weights, loss_weights = row_factors(agreed.rows, m), None
        if b.raw_weights is not None:
            dp = 1 if forward_only else self.topology.dp_size
            try:  # the other replicas are in its all-reduce: an interrupt is held until it completed
                weights, loss_weights = weight_factors(
                    b.raw_weights, dp, self.topology.dp_group,
                    wait=lambda work: self._agreement.wait_collective(work, self.device))
            except Exception as exc:  # noqa: BLE001 - a replica is gone (marked broken): this rank drains
                held = held or exc
            held = held or self._agreement.take_held()  # drains the step, raised after the end agreement
        data = StepInputs(b.inputs, b.targets, weights, loss_weights,
                          self._rng_of(self._base_seed, rng_step) if self.seeded else None)
        new_signature = agreed.signature not in self._specs
        specs = self._specs.setdefault(agreed.signature, {})
        self._specs.move_to_end(agreed.signature)
        while len(self._specs) > _MAX_SIGNATURES:  # same sequence of signatures on every rank: same eviction
            self._specs.popitem(last=False)
        program = (self._program if not forward_only else self._forward_program()).ranks[self.pp_rank]
        executor = StepExecutor(program, self.schedule.num_stages, self.stage_modules, self._wgrad,
                                self.loss_fn if (not forward_only or target is not None) else None,
                                forward_only=forward_only, split_wgrad=bool(self._split_stages),
                                free_sent_activations=self.free_sent_activations,
                                recorder=self._recorder if not forward_only else None)
        failure = StepFailure()
        if held is not None:
            failure.fail(held, None)
        comm = CommQueue(program, self._channels, specs, new_signature, self._in_flight, failure)
        return _Step(forward_only, agreed.signature, new_signature, data, executor, comm, failure, walks,
                     [] if forward_only else unique_parameters(walks), rng_step, agreed.rows)  # only training steps use params

    def _compute_stream(self, step: _Step) -> Any:  # with CUDA graphs a side stream (`GraphCache.stream`)
        return self._graph_cache.stream(self._in_flight) if self._graph_cache else contextlib.nullcontext()

    def _run_tasks(self, step: _Step) -> None:
        """This rank's tasks, through the runner of the step's signature (chosen after `begin`: a
        reducer may move ``main_grad``, which graphs bake in)."""
        graphs = self._graph_cache if not step.forward_only else None
        boundaries = self._reductions if not step.forward_only else None
        if graphs is None:
            step.results = step.executor.run(step.data, step.comm, step.failure, step.runner, boundaries)
            return
        step.runner = graphs.runner(step.signature, step.new_signature, step.params, step.cleared,
                                    module_buffers(m for modules, _ in step.walks.values() for m in modules))
        buffers = graphs.grad_buffers
        deciding = contextlib.ExitStack()

        def set_up_gradients() -> None:  # before the first task that may touch a gradient (after the first F)
            if step.cleared is not None:
                self._reductions.set_aside_cleared(step.params, step.cleared)
            buffers.prepare(step.runner, {s: params for s, (_, params) in step.walks.items()},
                            self._reductions.kept_copies())
            deciding.enter_context(buffers.deciding())  # where W writes a fixed .grad buffer instead of adding to it

        try:
            with deciding:
                step.results = step.executor.run(step.data, step.comm, step.failure, step.runner, boundaries,
                                                 before_gradients=set_up_gradients)
        finally:
            buffers.finish(step.runner)
        graphs.tasks_done()  # the end of a timed step of cuda_graphs="auto"

    def _agree_end(self, step: _Step, problem: BaseException | None) -> BaseException | None:
        """The end agreement: None when every rank succeeded, else the error this rank raises (its
        step then rolled back): a `PipelineError`, or this rank's own KeyboardInterrupt/SystemExit."""
        if problem is not None:
            step.failure.fail(problem, None)
        own = step.failure.error
        try:
            error, self._broken = decide_end(
                self._agreement, step.failure, step.executor.program.tasks, where=self.topology.describe(),
                schedule=self.schedule.name or "custom", rank=self.pp_rank, kept_grads=self.keep_grads_on_failure,
                broken=self._broken, roll_back=lambda: self._roll_back(step))
        except BrokenJob as exc:
            error = self._broken_error(exc, "end-of-step agreement")
        # an interrupt while this rank agreed: the outcome is shared, so it comes after it (`_Step.after`);
        # one while it rolled the step back (`_roll_back`) comes now
        held = self._agreement.take_held()
        if error is None:
            step.after = held
        elif step.after is not None or (held is not None and not isinstance(held, Exception)):
            return step.after or held
        if error is not None and own is not None and not isinstance(own, Exception):
            return own  # an interrupt or exit on this rank: the others were told, it goes on as asked
        return error

    def _roll_back(self, step: _Step) -> None:
        """A failed step: its wgrads pending, its reductions and gradients (`Reductions.rollback`),
        the shapes of a signature it was learning, a capture it cut short. A KeyboardInterrupt or
        SystemExit in a part (discarding wgrads may compute them, which takes time) neither cuts it
        short (the part runs again) nor leaves the end agreement, whose message exchange the other
        ranks are in: it is kept in `_Step.after` for `_agree_end`."""
        def forget() -> None:
            if step.new_signature:  # some shapes of this signature may never have been learnt
                self._specs.pop(step.signature, None)
            if self._graph_cache is not None:
                self._graph_cache.forget(step.signature, step.runner)

        # every rank rolls back alike (the end agreement decided): the retry of the batch draws the
        # uninterrupted run's dropout masks, and no stage runs a microbatch under another's seeds
        self.rng_step = step.rng_step

        for undo in [*(w.discard for w in self._wgrad.values()), self._reductions.rollback, forget]:
            held = _to_the_end(undo)  # a half-undone step would spoil the next ones
            step.after = step.after or held

    def _sync_buffers(self, step: _Step) -> None:
        """The replicas take replica 0's buffers (`zbpp.runtime.replica_buffers`) of the step's
        modules, at the end of every step (failed ones too: every rank is here, and replicas stay
        equal), before the end agreement: a failure on one replica then raises on every rank in this
        step, not only at their next call. It leaves the buffers out of step: the job is broken,
        marked in the store at once. A rank whose communication broke skips it: the end agreement
        marks the job broken at once, which ends its replicas' waits."""
        if self._replica_buffers is None or step.failure.comm_error is not None:
            return
        try:
            self._replica_buffers.sync(m for modules, _ in step.walks.values() for m in modules)
        except (Exception, KeyboardInterrupt, SystemExit) as exc:  # noqa: BLE001 - told in the end agreement
            self._broken = (f"this Pipeline is unusable: broadcasting the module buffers from replica 0 failed "
                            f"on {self.topology.describe()} ({describe_error(exc)}), so the replicas' buffers "
                            "differ or a rank is dead or hung. End the processes and restart")
            if not isinstance(exc, BrokenJob):  # a peer's mark (why it broke) stays
                self._agreement.mark_broken(self._broken)
            step.failure.fail(exc, None)

    def _delaying(self) -> list[tuple[bool, ...]]:
        """Which delayed-wgrad modules defer their weight gradients now, in the stages whose reductions
        wait for them (a split stage's wait for its last W anyway, `GradReducer.owe_all_to_wgrad`)."""
        return [w.delaying() for s, w in self._wgrad.items() if s not in self._split_stages]

    def _not_delaying(self) -> list[str]:
        """`_delaying`'s modules that no longer defer their weight gradients, named (for errors)."""
        return [name for s, w in self._wgrad.items() if s not in self._split_stages
                for name in w.not_delaying(s, self.stage_modules[s])]

    def _raise_if_unusable(self) -> None:
        """Raise the `PipelineError` that says why, once a step found the job broken: a collective
        over its ranks (a step, `check_ties`, `task_times`, `clip_grad_norm_`, a checkpoint) would
        wait for a dead rank until the group's timeout, or pair with a collective some rank left."""
        if self._broken is not None:
            raise PipelineError(self._broken)

    def _wait_collective(self, work: Any, device: torch.device, which: str) -> BaseException | None:
        """Wait for `work`, a collective among this Pipeline's ranks between steps (`which`, for the
        error; `Agreement.wait_collective`): a rank dead meanwhile makes it unusable, on every rank at
        once. Returns an interrupt that came meanwhile, held: the caller raises it once its call is done."""
        try:
            self._agreement.wait_collective(work, device)
        except BrokenJob as exc:
            raise self._broken_error(exc, which) from exc
        return self._agreement.take_held()

    def _agree_before_collectives(self, problem: BaseException | None, which: str,
                                  some_failed: bool | None = None) -> None:
        """Before the first collective of `which`, a call between steps: every rank tells whether its
        local part failed (`problem`; `agree_on_problems`), so that none waits in a collective for a rank
        that raised. Call it inside a `collective_call`; a rank dead meanwhile makes this unusable.
        `some_failed`: whether any rank failed, where the caller's own all-reduce told (`agree_nothing_failed`)."""
        try:
            agree_nothing_failed(self._agreement, problem, self.topology.world,
                                 f"{which} could not run on every rank (nothing was changed)", some_failed)
        except BrokenJob as exc:
            raise self._broken_error(exc, f"agreement of {which}") from exc

    def _broken_error(self, exc: BrokenJob, which: str) -> PipelineError:
        self._broken = (f"this Pipeline is unusable: the {which} among its ranks cannot complete "
                        f"({exc}), so a rank is dead or hung, or collectives broke. End the processes and restart")
        if self._channels is not None:
            self._channels.abort()  # NCCL: free the GPU from operations waiting for the dead peer
        error = PipelineError(self._broken)
        error.__cause__ = exc
        return error

    # -- construction and internals -----------------------------------------------------------
    def _set_up_reductions(self, reducer: Any, fsdp: Any, cuda_graphs: Any, span: timedelta) -> None:
        """The reducer (the default one's group first: a collective), the task graphs and `Reductions`."""
        if fsdp is not None or reducer is None:
            reducer = fsdp if fsdp is not None else default_reducer(self.stage_modules, self.topology, self._tied, span)
        if fsdp is not None and self.topology.dp_size > 1:
            fsdp.presence_group = presence_group(self.topology, span)
        for waiting in (reducer, self._tied, self._replica_buffers):  # their waits end when another rank marks the job broken
            if hasattr(waiting, "wait_check"):
                waiting.wait_check = self._agreement.check
        if self._split_stages and callable(getattr(reducer, "owe_all_to_wgrad", None)):
            reducer.owe_all_to_wgrad(self._split_stages)
        if fsdp is not None and (cuda_graphs == "auto" or isinstance(cuda_graphs, AutoGraphs)):
            cuda_graphs = False  # "auto" takes graphs only where they run (fast_pipeline_kwargs' choice)
        self._graph_cache = graph_cache(cuda_graphs, self.stage_modules, self.device)
        self.cuda_graphs = self._graph_cache is not None
        if self.cuda_graphs and fsdp is not None:
            raise ValueError(f"cuda_graphs={cuda_graphs!r} cannot capture fully_shard stages (FSDP all-gathers and "
                             "frees parameters from Python hooks around each task); pass cuda_graphs=False")
        stage_params = {s: {id(p) for p in m.parameters()} for s, m in self.stage_modules.items()}
        self._reductions = Reductions(
            reducer=reducer, fsdp=fsdp, tied=self._tied,
            owed_by_w=lambda s: stage_params[s] if s in self._split_stages else self._wgrad[s].wgrad_param_ids(),
            keep_grads_on_failure=self.keep_grads_on_failure,
            fixed_grads=self._graph_cache.grad_buffers if self._graph_cache is not None else None)

    def _rng_of(self, base: int, step: int) -> Callable[[int, int], Any]:
        replica, device = self.topology.dp_rank, self.device
        return lambda stage, microbatch: seeded(microbatch_seed(base, step, stage, microbatch, replica), device)

    def _forward_program(self) -> Program:
        if self._eval_program is None:
            self._eval_program = make_program(self.schedule, costs=self._costs, forward_only=True)
        return self._eval_program


def _schedule_key(schedule: Schedule) -> tuple[int, str]:
    """A hash of `schedule`'s tasks (its placement and every rank's order) and a description of it."""
    tasks = (schedule.num_ranks, schedule.num_stages, schedule.num_microbatches, tuple(schedule.placement),
             tuple(tuple(map(str, order)) for order in schedule.orders))
    return stable_hash(tasks), (f"{schedule.name or 'custom'!r} ({schedule.num_ranks} ranks, {schedule.num_stages} "
                                f"stages, {schedule.num_microbatches} microbatches)")


def _to_the_end(call: Callable[[], Any]) -> BaseException | None:
    """`call()`, again after each KeyboardInterrupt or SystemExit until it ends (it must go on
    where it stopped); the first of them, else None."""
    held: BaseException | None = None
    while True:
        try:
            call()
            return held
        except (KeyboardInterrupt, SystemExit) as exc:
            held = held or exc


def _first_error(*calls: Callable[[], Any]) -> BaseException | None:
    """Run `calls` in order until one raises; what it raised (the end agreement reports it). A
    KeyboardInterrupt or SystemExit too: leaving the step here would strand the peers in their
    receives or the end agreement until the group's timeout; `_agree_end` hands it back."""
    try:
        for call in calls:
            call()
    except (Exception, KeyboardInterrupt, SystemExit) as exc:  # noqa: BLE001
        return exc
    return None
