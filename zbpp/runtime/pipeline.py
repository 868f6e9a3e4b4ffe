"""`Pipeline`: run any zbpp `Schedule` over the ranks of a pipeline, one step at a time.

Every rank runs the same script (torchrun) and builds a `Pipeline` with the stage modules it
holds. ``step(inputs, target)`` splits the batch into the schedule's microbatches, runs this rank's
tasks in the schedule's order (one interpreter for every schedule: `zbpp.runtime.executor`) and
leaves in ``.grad`` (or ``main_grad``) the gradient of the batch-mean loss, as one process running
the whole model on the whole batch would. See docs/DESIGN.md.

A step, top to bottom:

1. *Start agreement* (`zbpp.runtime.agreement`, CPU only): every rank of the job says whether its
   part of the input is acceptable and what it looks like; a problem anywhere raises on every rank
   before any compute, and a new input signature makes the step send activation shapes ahead.
2. *Tasks* (`StepExecutor`): this rank's F, B and W tasks with the plan's communication
   (`zbpp.schedules.plan`). Gradients of earlier steps are set aside first, so that the step's own
   are known apart (``keep_grads_on_failure``).
3. *End agreement*: every rank says whether it failed. On success the set-aside gradients are
   added back and the loss is returned; on a failure anywhere every rank raises `PipelineError`
   naming the first failing rank and task, with the step's gradients discarded and earlier ones
   restored.

A rank whose task raises does not stop communicating: it *drains* (issues the rest of its sends
and receives with placeholders, see the executor), so the peers finish the step's communication
and reach the end agreement within about a step's time, whatever the process-group timeout, and
the communicators stay usable: the next step runs normally. Only a dead or hung rank makes the
end agreement fail; then every live rank raises, the `Pipeline` is marked unusable and its next
step raises at once saying so (restart the job).
"""

from __future__ import annotations

import contextlib
import hashlib
import pickle
import time
from collections import OrderedDict
from datetime import timedelta
from typing import Any, Callable, Iterator, Mapping

import torch
from torch import nn

from ..schedules.ir import Kind, Schedule
from ..schedules.plan import Plan, fifo_wgrad_problem, make_plan
from ..schedules.simulate import Costs
from .agreement import Agreement, BrokenJob, EndReport, StartReport
from .channels import Channels, CommOptions, agreement_group, default_timeout
from .executor import PipelineError, StepExecutor
from .profiling import TaskRecorder
from .tied import TiedParameters
from .topology import Topology
from .tree import flatten, rebuild, split
from .wgrad import StageWgrad

__all__ = ["Pipeline"]

_MAX_SIGNATURES = 16  # cached input signatures (each holds one Spec per cross-rank activation)


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
            parallelism gradients are averaged over the replicas (`zbpp.runtime.topology`).
        device: where activations live; default: the current CUDA device under NCCL, else the
            device of the stage modules' first parameter, else the CPU.
        profile: record each task's start and end (see `profile_records`).
        free_sent_activations: release a sent activation's memory as soon as it is handed to its
            send (B still works: only the autograd node is kept). Turn off only if your code holds
            on to stage outputs.
        reducer: the gradient reducer to drive (``start_step``, ``stage_backward_done(stage)``
            after the stage's last B/BW, ``stage_wgrad_done(stage)`` after its last W/BW,
            ``finish``, ``abandon``); default: a `zbpp.runtime.grad_reduce.GradReducer` when there
            are data-parallel replicas, else none.
        keep_grads_on_failure: gradients accumulated by earlier steps survive a failed step (only
            its own contribution goes). ``.grad`` is set aside at the start of each step and added
            back at its end (no copy; one addition per parameter when ``.grad`` was set), and a
            ``main_grad`` that no data-parallel reducer owns is copied at the start of each step
            (memory and time of one copy). False: a failed step sets ``.grad`` to None and zeroes
            ``main_grad``, and a step accumulates in place.
        comm: how the point-to-point channels use NCCL (`CommOptions`; ignored on gloo).
        costs: the task and link times that place sends and receives
            (`zbpp.schedules.plan.make_plan`); default unit costs and a fast link. Pass measured
            costs (`Costs.from_profile`, with ``comm``) on slow links.
        recv_lead: extra tasks of margin before each receive (`make_plan`).
        timeout: seconds a peer may take before the pipeline's own groups fail; default: the
            default process group's timeout.
        tied_parameters: ``{name: parameter}``: this rank's copies of parameters that several
            ranks hold (GPT's embedding and LM head); every holder passes its copy under the same
            name; after each step every copy holds the sum of all uses' gradients, averaged over
            the replicas (`zbpp.runtime.tied`). Every rank builds its `Pipeline` with or without.
        split_wgrad: under schedules with W tasks, B computes only the gradient the previous stage
            needs and W every weight gradient, for any module: B keeps the incoming gradients of
            the autograd nodes that lead to weights, and W runs the rest of the graph from them
            (`zbpp.runtime._autograd_split`). What W needs of the forward's saved tensors is kept
            until W; what only B's nodes used is freed after B. Data-parallel and tied reductions
            of a split stage start after its last W. False: plain modules get their weight
            gradients in B (W only runs delayed-wgrad modules). BW tasks run the whole backward
            either way.

    Microbatches: every tensor of ``inputs`` (and of ``target``) is split along dim 0 with
    ``torch.tensor_split`` into ``schedule.num_microbatches`` parts (sizes may differ by one); the
    loss of microbatch j is weighted by rows_j / rows. A stage is called as ``module(*x)`` for a
    tuple/list, ``module(**x)`` for a dict, else ``module(x)``; stage outputs may be tensors,
    tuples, lists or dicts of them, with non-tensor values passed along.

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

    def __init__(
        self,
        stage_modules: Mapping[int, nn.Module],
        schedule: Schedule,
        loss_fn: Callable[[Any, Any], torch.Tensor],
        *,
        groups: Any = None,
        device: torch.device | str | None = None,
        profile: bool = False,
        free_sent_activations: bool = True,
        reducer: Any = None,
        keep_grads_on_failure: bool = True,
        comm: CommOptions | None = None,
        costs: Costs | None = None,
        recv_lead: int = 0,
        timeout: float | None = None,
        tied_parameters: Mapping[str, nn.Parameter] | None = None,
        split_wgrad: bool = True,
    ) -> None:
        if not isinstance(schedule, Schedule):
            raise TypeError(f"schedule must be a zbpp.schedules.Schedule, got {type(schedule).__name__}")
        if not callable(loss_fn):
            raise TypeError(f"loss_fn must be callable, got {type(loss_fn).__name__}")
        if not isinstance(stage_modules, Mapping):
            raise TypeError(f"stage_modules must be a mapping {{stage: module}}, got {type(stage_modules).__name__}")
        if comm is not None and not isinstance(comm, CommOptions):
            raise TypeError(f"comm must be a zbpp.runtime.CommOptions, got {type(comm).__name__}")
        if costs is not None and not isinstance(costs, Costs):
            raise TypeError(f"costs must be a zbpp.schedules.Costs, got {type(costs).__name__}")
        if timeout is not None and not (isinstance(timeout, (int, float)) and not isinstance(timeout, bool) and timeout > 0):
            raise ValueError(f"timeout must be a positive number of seconds, got {timeout!r}")
        self.schedule = schedule
        self.loss_fn = loss_fn
        self.groups = groups
        self.topology = Topology.resolve(groups, schedule.num_ranks)
        self.pp_rank: int = self.topology.pp_rank
        mine = schedule.stages_on(self.pp_rank)
        given = sorted(stage_modules)
        if given != mine:
            raise ValueError(
                f"pipeline rank {self.pp_rank} holds stages {mine} of schedule {schedule.name or 'custom'!r} "
                f"but stage_modules has {given}; pass exactly {{s: module for s in schedule.stages_on({self.pp_rank})}}"
            )
        for s, m in stage_modules.items():
            if not isinstance(m, nn.Module):
                raise TypeError(f"stage {s}: expected an nn.Module, got {type(m).__name__}")
        self.stage_modules: dict[int, nn.Module] = dict(sorted(stage_modules.items()))
        self._plan: Plan = make_plan(schedule, costs=costs, recv_lead=recv_lead)
        self._costs, self._recv_lead = costs, recv_lead
        self._eval_plan: Plan | None = None
        self._wgrad = {s: StageWgrad(m) for s, m in self.stage_modules.items()}
        self.split_wgrad = bool(split_wgrad)
        has_b = {t.stage for t in self._plan.ranks[self.pp_rank].tasks if t.kind is Kind.B}
        self._split_stages = {s for s in self.stage_modules if s in has_b} if self.split_wgrad else set()
        self._stage_param_ids = {s: {id(p) for p in m.parameters()} for s, m in self.stage_modules.items()}
        for s, w in self._wgrad.items():
            fifo = w.fifo_modules
            problem = fifo_wgrad_problem(schedule, s) if fifo else None
            if problem is not None:
                names = ", ".join(sorted({type(d).__name__ for d in fifo}))
                raise ValueError(
                    f"stage {s} has delayed-wgrad modules without microbatch keys ({names}: backward_dw() takes "
                    f"the oldest pending wgrad), which schedule {schedule.name or 'custom'!r} cannot use: {problem}. "
                    "Use a schedule that keeps each stage's W in B order, or modules that take a microbatch key "
                    "(zbpp.modules)"
                )
        self.device = self._resolve_device(device)
        self.profile = bool(profile)
        self.free_sent_activations = bool(free_sent_activations)
        self.keep_grads_on_failure = bool(keep_grads_on_failure)
        self._recorder = TaskRecorder(self.pp_rank, self.device) if self.profile else None
        self._specs: OrderedDict[tuple[Any, ...], dict[tuple[int, int], Any]] = OrderedDict()
        self._in_flight: list[tuple[list[Any], list[torch.Tensor]]] = []
        self._broken: str | None = None
        span = timedelta(seconds=timeout) if timeout is not None else (default_timeout() if self.topology.distributed else timedelta(minutes=10))
        self._agreement = Agreement(agreement_group(self.topology, span))
        self._channels = None
        if self.topology.pp_size > 1:
            self._channels = Channels(self.topology, self._plan.channels, self.device, comm or CommOptions(), span)
        self._tied = TiedParameters(tied_parameters or {}, self.stage_modules, self.topology, schedule.placement,
                                    self._agreement.group, self.device, span)
        self._reducer = reducer
        if reducer is None and self.topology.dp_size > 1:
            from .grad_reduce import GradReducer

            self._reducer = GradReducer(self.stage_modules, self.topology, exclude=self._tied.param_ids())
        if self._split_stages and callable(getattr(self._reducer, "owe_all_to_wgrad", None)):
            self._reducer.owe_all_to_wgrad(self._split_stages)
        self._sync_gradients = True  # False inside no_sync()
        self._unreduced = False  # gradients hold steps accumulated inside no_sync()

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
    def plan(self) -> Plan:
        """The communication plan its training steps execute (`zbpp.schedules.plan.make_plan` of
        the schedule, with the constructor's ``costs`` and ``recv_lead``): where each rank issues
        each send and receive; `zbpp.schedules.plan.plan_makespan` predicts its step."""
        return self._plan

    @property
    def reducer(self) -> Any:
        """The data-parallel `GradReducer`, or None without data parallelism."""
        return self._reducer

    def parameters(self) -> Iterator[nn.Parameter]:
        """This rank's parameters (of all its stages), each once."""
        seen: set[int] = set()
        for m in self.stage_modules.values():
            for p in m.parameters():
                if id(p) not in seen:
                    seen.add(id(p))
                    yield p

    def step(self, inputs: Any = None, target: Any = None, *, losses: list | None = None) -> torch.Tensor | None:
        """Run one training step's forward and backward.

        Every rank may pass `inputs` and `target`; only the rank holding stage 0 uses `inputs`
        and only the one holding the last stage uses `target`. Returns the batch-mean loss (a
        detached scalar tensor, never synchronised with the device) on the rank holding the last
        stage, None elsewhere. Gradients are accumulated into ``.grad`` (zero them between steps as
        usual) or ``main_grad``. With `losses` (a list), the rank holding the last stage appends
        each microbatch's loss as `loss_fn` returned it (unweighted, detached).

        Raises `PipelineError` on every rank when any rank fails (see the module docstring).
        """
        if losses is not None and not isinstance(losses, list):
            raise TypeError(f"losses must be a list to append the microbatch losses to, got {type(losses).__name__}")
        ex, sync, signature = self._begin(inputs, target, forward_only=False)
        reducing = self._sync_gradients
        self._set_gradients_aside(in_place=reducing and self._unreduced)
        problem: BaseException | None = None
        try:
            if reducing:
                if self._reducer is not None:
                    self._reducer.start_step(keep_main_grad=self._unreduced)
                self._tied.start_step()
            loss = ex.run()
            if reducing and not ex.draining:
                if self._reducer is not None:
                    self._reducer.finish()
                self._tied.finish()
        except Exception as exc:  # noqa: BLE001 - the reducers; reported through the agreement
            problem = exc
        failure = self._end(ex, problem, sync, signature)
        if failure is not None:
            self._discard_step_gradients()
            raise failure
        self._take_back_gradients()
        self._unreduced = not reducing
        if losses is not None and self.holds_last_stage:
            losses.extend(ex.losses)
        return loss

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Steps inside accumulate gradients without the data-parallel reduction (DDP's ``no_sync``)
        nor the tied parameters' one: each copy keeps its own. The next step outside reduces
        everything accumulated, once.

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
        all microbatches merged along dim 0 (the batch's output, tensors concatenated, other values
        from the first microbatch); with `target`, the batch-mean loss. None elsewhere. No gradient
        is touched; activations are freed as they go. Modules keep their train/eval mode: call
        ``module.eval()`` yourself for dropout or batch norm.

        >>> import torch
        >>> from zbpp.schedules import build
        >>> pipe = Pipeline({0: torch.nn.Linear(3, 2)}, build("1f1b", num_ranks=1, num_microbatches=2),
        ...                 loss_fn=torch.nn.functional.mse_loss)
        >>> tuple(pipe.eval_step(torch.ones(4, 3)).shape)
        (4, 2)
        """
        ex, sync, signature = self._begin(inputs, target, forward_only=True)
        problem: BaseException | None = None
        try:
            with torch.no_grad():
                loss = ex.run()
        except Exception as exc:  # noqa: BLE001
            problem = exc
        failure = self._end(ex, problem, sync, signature)
        if failure is not None:
            raise failure
        if not self.holds_last_stage:
            return None
        if target is not None:
            return loss
        return _merge([ex.outputs[j] for j in range(self.num_microbatches)])

    def profile_records(self) -> list[dict[str, Any]] | None:
        """The last step's task records of every rank, on pipeline rank 0 (None on the others).

        Each record is ``{"rank", "action", "start", "end"}`` (seconds from the step's start on that
        rank). Collective over the pipeline group: every rank of the pipeline must call it. Needs
        ``profile=True``.
        """
        if not self.profile:
            raise RuntimeError("profile_records() needs Pipeline(..., profile=True)")
        assert self._recorder is not None
        mine = self._recorder.records()  # resolved now, so that step() never waits for the device
        if self.topology.pp_size == 1:
            return mine
        import torch.distributed as dist

        root = self.topology.pipeline[0]
        gathered: list[Any] | None = [None] * self.topology.pp_size if self.pp_rank == 0 else None
        dist.gather_object(mine, gathered, dst=root, group=self.topology.pp_group)
        if gathered is None:
            return None
        return [rec for recs in gathered for rec in recs]

    # -- a step's beginning and end ------------------------------------------------------------
    def _begin(self, inputs: Any, target: Any, *, forward_only: bool) -> tuple[StepExecutor, bool, tuple]:
        """Check the input everywhere (start agreement) and build the step's executor."""
        if self._broken is not None:
            raise PipelineError(self._broken)
        m = self.schedule.num_microbatches
        first, last = self.holds_first_stage, self.holds_last_stage
        problem: Exception | None = None
        mbs = tgts = None
        in_hash, n_in, n_tgt = 0, -1, -1
        try:
            if first:
                if inputs is None:
                    raise ValueError(f"pipeline rank {self.pp_rank} holds stage 0, so the step needs the inputs")
                inputs = self._to_device(inputs, "input")
                mbs = split(inputs, m, what="input")
                leaves, spec = flatten(inputs)
                n_in, in_hash = int(leaves[0].shape[0]), _hash((m, spec))
            if last and target is not None:
                target = self._to_device(target, "target")
                tgts = split(target, m, what="target")
                n_tgt = int(flatten(target)[0][0].shape[0])
        except Exception as exc:  # noqa: BLE001 - reported to every rank below
            problem = exc
        state_hash = _hash((self._module_state(), forward_only))
        mine = StartReport(problem is not None, state_hash, in_hash, n_in, n_tgt)
        reports = self._gather(mine, "start")
        if any(r.rejected for r in reports):
            texts = self._agreement.gather_texts(None if problem is None else f"{type(problem).__name__}: {problem}")
            if problem is not None:
                raise problem
            bad = [(rank, t) for rank, t in zip(self.topology.world, texts) if t is not None]
            raise PipelineError(
                f"global rank {bad[0][0]} rejected its part of the step's input ({bad[0][1]}); "
                f"ranks {[r for r, _ in bad]} rejected theirs. Nothing was computed"
            )
        line = [reports[self.topology.world.index(g)] for g in self.topology.pipeline]
        rows = line[self.schedule.rank_of(0)].input_rows
        target_rows = line[self.schedule.rank_of(self.schedule.num_stages - 1)].target_rows
        if target_rows >= 0 and target_rows != rows:
            raise ValueError(
                f"the target has {target_rows} rows along dim 0 but the input has {rows}: every tensor of the "
                "input and of the target is split into the same microbatches along dim 0. Nothing was computed"
            )
        weights = [(rows // m + (1 if j < rows % m else 0)) / rows for j in range(m)]  # tensor_split's sizes
        signature = (forward_only, line[self.schedule.rank_of(0)].input_hash, rows, *(r.state_hash for r in line))
        sync = signature not in self._specs
        specs = self._specs.setdefault(signature, {})
        self._specs.move_to_end(signature)
        while len(self._specs) > _MAX_SIGNATURES:  # same sequence of signatures on every rank: same eviction
            self._specs.popitem(last=False)
        plan = self._plan if not forward_only else self._forward_plan()
        hooks = {}
        if not forward_only and self._sync_gradients:
            hooks = {"on_backward_done": self._stage_backward_done, "on_wgrad_done": self._stage_wgrad_done}
        ex = StepExecutor(
            plan=plan.ranks[self.pp_rank],
            num_stages=self.schedule.num_stages,
            modules=self.stage_modules,
            wgrad=self._wgrad,
            loss_fn=self.loss_fn if (not forward_only or target is not None) else None,
            channels=self._channels,
            specs=specs,
            sync=sync,
            inputs=mbs,
            targets=tgts if tgts is not None else ([None] * m if last else None),
            weights=weights,
            in_flight=self._in_flight,
            recorder=self._recorder if not forward_only else None,
            free_sent_activations=self.free_sent_activations,
            forward_only=forward_only,
            split_wgrad=bool(self._split_stages),
            **hooks,
        )
        return ex, sync, signature

    def _end(self, ex: StepExecutor, problem: BaseException | None, sync: bool, signature: tuple) -> PipelineError | None:
        """The end agreement: None when every rank succeeded, else the error this rank raises."""
        if problem is not None and ex.failure is None:
            ex.failure, ex.failed_task, ex.failed_at = problem, None, time.time()
        tasks = self._plan.ranks[self.pp_rank].tasks if not ex.forward_only else ex.plan.tasks
        mine = EndReport(
            failed=ex.failure is not None,
            drained=ex.draining,
            comm_broken=ex.comm_error is not None,
            task=tasks.index(ex.failed_task) if ex.failed_task in tasks else -1,
            failed_at_us=int(ex.failed_at * 1e6),
        )
        try:
            if ex.comm_error is not None:  # a dead peer: no agreement can complete; tell the others
                why = f"{self.topology.describe()} could not communicate: {type(ex.comm_error).__name__}: {ex.comm_error}"
                self._agreement.mark_broken(why)
                raise BrokenJob(why)
            reports = self._gather(mine, "end")
        except (PipelineError, BrokenJob) as exc:
            self._after_failure(ex, sync, signature)
            if isinstance(exc, BrokenJob):
                exc = self._broken_error(exc, "end")
            return exc
        if not any(r.failed or r.drained or r.comm_broken for r in reports):
            return None
        self._after_failure(ex, sync, signature)
        text = None
        if ex.failure is not None:
            where = f"task {ex.failed_task}" if ex.failed_task is not None else "outside any task"
            text = (f"{self.topology.describe()}, {where} of schedule {self.schedule.name or 'custom'!r}: "
                    f"{type(ex.failure).__name__}: {ex.failure}")
        texts = self._agreement.gather_texts(text)
        failed = sorted((r.failed_at_us, i) for i, r in enumerate(reports) if r.failed and texts[i] is not None)
        first = texts[failed[0][1]] if failed else None
        if len(failed) > 1:
            first += f" ({len(failed) - 1} more rank(s) failed after it)"
        if any(r.comm_broken for r in reports):
            self._broken = (
                "this Pipeline is unusable: a send or receive failed during a failed step (a dead peer?), so its "
                f"communicators are in an unknown state. First failure: {first}. End the processes and restart"
            )
        kept = "gradients of earlier steps kept" if self.keep_grads_on_failure else ".grad set to None, main_grad zeroed"
        msg = (f"step failed on {first or 'a rank whose message did not arrive'}. Every rank of the job raised; "
               f"this rank discarded the step's gradients ({kept})"
               + (f". {self._broken}" if self._broken else "; the pipeline is usable"))
        error = PipelineError(msg)
        if ex.failure is not None:
            error.__cause__ = ex.failure
        return error

    def _stage_backward_done(self, stage: int) -> None:
        if self._reducer is not None:
            self._reducer.stage_backward_done(stage)
        owed = self._stage_param_ids[stage] if stage in self._split_stages else self._wgrad[stage].owed_params()
        self._tied.stage_done(stage, owed)

    def _stage_wgrad_done(self, stage: int) -> None:
        if self._reducer is not None:
            self._reducer.stage_wgrad_done(stage)
        self._tied.stage_done(stage, None)

    def _after_failure(self, ex: StepExecutor, sync: bool, signature: tuple) -> None:
        for w in self._wgrad.values():
            w.discard()
        if not ex.forward_only and self._sync_gradients:
            for reducer in (self._reducer, self._tied):
                try:
                    if reducer is not None:
                        reducer.abandon()
                except Exception:  # noqa: BLE001 - best effort: the step is lost anyway
                    pass
        if sync:  # some shapes of this signature may never have been learnt
            self._specs.pop(signature, None)

    def _gather(self, report: Any, which: str) -> list[Any]:
        try:
            return self._agreement.gather(report)
        except BrokenJob as exc:
            raise self._broken_error(exc, which) from exc

    def _broken_error(self, exc: BrokenJob, which: str) -> PipelineError:
        self._broken = (
            f"this Pipeline is unusable: the {which}-of-step agreement among its ranks cannot complete ({exc}), so a "
            "rank is dead or hung. End the processes and restart"
        )
        if self._channels is not None:
            self._channels.abort()  # NCCL: free the GPU from operations waiting for the dead peer
        error = PipelineError(self._broken)
        error.__cause__ = exc
        return error

    # -- gradients across a step ---------------------------------------------------------------
    def _set_gradients_aside(self, in_place: bool) -> None:
        """Keep what earlier steps accumulated apart from this step's gradients (see
        ``keep_grads_on_failure``): set ``.grad`` aside (`in_place` False), or, when this step must
        reduce what no_sync steps accumulated together with its own, copy it; copy the ``main_grad``
        that no reducer zeroes at the start of the step."""
        self._aside: list[tuple[nn.Parameter, torch.Tensor | None]] = []
        self._copies: list[tuple[torch.Tensor, torch.Tensor]] = []
        if not self.keep_grads_on_failure:
            return
        zeroed_by_reducer = self._reducer is not None and self._sync_gradients and not self._unreduced
        for p in self.parameters():
            self._aside.append((p, p.grad))
            if in_place:  # p.grad stays; on failure it becomes this tensor again, with these values
                if p.grad is not None:
                    self._copies.append((p.grad, p.grad.clone()))
            else:
                p.grad = None
            main = getattr(p, "main_grad", None)
            if isinstance(main, torch.Tensor) and not zeroed_by_reducer:
                self._copies.append((main, main.clone()))

    def _take_back_gradients(self) -> None:
        for p, g in self._aside:
            if g is None or g is p.grad:  # nothing set aside, or accumulated in place
                continue
            if p.grad is not None:
                g.add_(p.grad)
            p.grad = g
        self._aside, self._copies = [], []

    def _discard_step_gradients(self) -> None:
        if self.keep_grads_on_failure:
            for p, g in self._aside:
                p.grad = g
            for kept, copy in self._copies:
                kept.copy_(copy)
        else:
            for p in self.parameters():
                p.grad = None
                main = getattr(p, "main_grad", None)
                if isinstance(main, torch.Tensor):
                    main.zero_()
        self._aside, self._copies = [], []

    # -- internals ----------------------------------------------------------------------------
    def _forward_plan(self) -> Plan:
        if self._eval_plan is None:
            self._eval_plan = make_plan(self.schedule, costs=self._costs, recv_lead=self._recv_lead, forward_only=True)
        return self._eval_plan

    def _resolve_device(self, device: torch.device | str | None) -> torch.device:
        if device is not None:
            return torch.device(device)
        if self.topology.distributed:
            import torch.distributed as dist

            if "nccl" in str(dist.get_backend()) and torch.cuda.is_available():
                return torch.device("cuda", torch.cuda.current_device())
        for m in self.stage_modules.values():
            for t in list(m.parameters()) + list(m.buffers()):
                return t.device
        return torch.device("cpu")

    def _to_device(self, obj: Any, what: str) -> Any:
        leaves, spec = flatten(obj)
        if not leaves:
            raise ValueError(f"the {what} holds no tensor ({spec}): the step splits its tensors into microbatches")
        return rebuild(spec, [t.to(self.device) for t in leaves])

    def _module_state(self) -> tuple:
        """What, besides the input, decides the shapes and requires_grad of the activations."""
        return tuple(
            (s, tuple(mod.training for mod in m.modules()), tuple(p.requires_grad for p in m.parameters()))
            for s, m in self.stage_modules.items()
        )


def _merge(outputs: list[Any]) -> Any:
    """The microbatches' outputs as one batch: tensor leaves concatenated along dim 0."""
    leaves = [flatten(o) for o in outputs]
    spec = leaves[0][1]
    merged = []
    for i, t in enumerate(leaves[0][0]):
        merged.append(torch.cat([ls[i] for ls, _ in leaves], dim=0) if t.dim() > 0 else t)
    return rebuild(spec, merged)


def _hash(obj: Any) -> int:
    """A 55-bit hash of a picklable object."""
    try:
        data = pickle.dumps(obj)
    except Exception as exc:  # noqa: BLE001
        raise ValueError(f"the step's input holds a non-tensor value that cannot be pickled: {exc}") from exc
    return int.from_bytes(hashlib.blake2b(data, digest_size=7).digest(), "little") >> 1

