"""`Pipeline`: run any zbpp `Schedule` over the ranks of a pipeline, one step at a time.

Every rank runs the same script (torchrun) and builds a `Pipeline` with the stage modules it
holds. ``step(inputs, target)`` splits the batch into the schedule's microbatches, runs this rank's
tasks in the schedule's order (one interpreter for every schedule: `zbpp.runtime.executor`) and
leaves in ``.grad`` (or ``main_grad``) the gradient of the batch-mean loss, as one process running
the whole model on the whole batch would. See docs/DESIGN.md.

`Pipeline.step` is the story of a step: the start agreement, gradients of earlier steps set
aside, this rank's tasks, the data-parallel reduction, the end agreement, the gradients restored.
What a failure does is told where it happens: draining in `zbpp.runtime.executor`, the agreements
and a dead rank in `zbpp.runtime.agreement`.
"""

from __future__ import annotations

import contextlib
import hashlib
import pickle
import time
from collections import OrderedDict
from datetime import timedelta
from typing import Any, Callable, Iterator, Mapping, Sequence

import torch
from torch import nn

from ..schedules.ir import Action, Kind, Schedule
from ..schedules.plan import Plan, fifo_wgrad_problem, make_plan
from ..schedules.simulate import Costs
from .agreement import Agreement, BrokenJob, EndReport, StartReport
from .channels import Channels, agreement_group, cached_group, default_timeout
from .executor import PipelineError, StepExecutor
from .grad_aside import GradientsAside
from .profiling import TaskRecorder
from .task_graphs import GradBuffers, TaskGraphs, MAX_GRAPHED_SIGNATURES, external_addresses, refusal
from .tied import TiedParameters
from .topology import Topology
from .rng import microbatch_seed, seeded
from .tree import batch_rows, flatten, rebuild, split
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
            are data-parallel replicas, a `zbpp.runtime.fsdp.FsdpReducer` when the stages are
            ``fully_shard`` modules (then no other reducer may be given), else none.
        keep_grads_on_failure: gradients accumulated by earlier steps survive a failed step (only
            its own contribution goes; what it costs: `zbpp.runtime.grad_aside`). False: a failed
            step sets ``.grad`` to None and zeroes ``main_grad``.
        costs: the task and link times that place sends and receives
            (`zbpp.schedules.plan.make_plan`); default unit costs and a fast link. Pass measured
            costs (`Costs.from_profile`, with ``comm``) on slow links.
        timeout: seconds a peer may take before the pipeline's own groups fail; default: the
            default process group's timeout.
        tied_parameters: ``{name: parameter}``: this rank's copies of parameters that several
            ranks hold (GPT's embedding and LM head); every holder passes its copy under the same
            name; after each step every copy holds the sum of all uses' gradients, averaged over
            the replicas (`zbpp.runtime.tied`). Every rank builds its `Pipeline` with or without.
        loss_weight: ``loss_weight(target_j) -> w_j`` (a number or a one-element tensor, kept on the
            device: no host synchronisation), the weight of microbatch j's loss: the step's loss
            and gradients are those of ``sum_j w_j * loss_j / sum_j w_j``. For a loss averaged
            over tokens, the count of tokens it averages over, e.g. ``lambda y: (y != -100).sum()``
            for a cross-entropy with ``ignore_index=-100``: the step then gives the token mean over
            the whole batch. Weights must be non-negative (not checked). A microbatch of weight 0
            adds nothing (its loss may be NaN, a mean over no token: it is left out, and its
            backward gets a zero gradient); if every weight is 0 the step's loss and gradients are
            0. With data-parallel replicas W is the total over all replicas (one all-reduce of a
            scalar per training step): the gradient is the token mean over every replica's data,
            and each replica returns its own batch's weighted loss. Default (None): w_j = the
            rows of microbatch j. Every rank builds its `Pipeline` with the same ``loss_weight``.
        seed: the random draws of each F task (dropout...) use generators seeded from
            ``microbatch_seed(seed, step, stage, microbatch, dp_rank)`` (`zbpp.runtime.rng`), with
            the caller's generator states restored after each task: a step's result does not
            depend on the schedule, and two pipelines given the same seed draw the same. None (the
            default) or True: the base seed is ``torch.initial_seed()`` of pipeline rank 0 (agreed
            at each step's start); an int: that base seed; False: the global generators as they run.
            ``rng_step`` counts the steps (training and evaluation) in the derivation.
        split_wgrad: under schedules with W tasks, B computes only the gradient the previous stage
            needs and W every weight gradient, for any module: B keeps the incoming gradients of
            the autograd nodes that lead to weights, and W runs the rest of the graph from them
            (`zbpp.runtime._autograd_split`). What W needs of the forward's saved tensors is kept
            until W; what only B's nodes used is freed after B. Data-parallel and tied reductions
            of a split stage start after its last W. False: plain modules get their weight
            gradients in B (W only runs delayed-wgrad modules). BW tasks run the whole backward
            either way. A ``torch.compile``d region is one autograd node: the weights inside it
            get their gradients in B (zbpp's layers stay outside the compiled graph, W intact).
        cuda_graphs: from the second training step of each input signature on, replay every F, B,
            W and BW task of this rank from a CUDA graph captured in the schedule's order (sends,
            receives and reductions stay outside): for small layers, where launching kernels
            costs more than running them; bit-identical to eager steps (dropout included). CUDA
            only; each trainable parameter without ``main_grad`` keeps one ``.grad`` tensor; what is
            captured and what is refused: `zbpp.runtime.task_graphs`.

    Microbatches: every tensor of ``inputs`` (and of ``target``) is split along dim 0 with
    ``torch.tensor_split`` into ``schedule.num_microbatches`` parts (sizes may differ by one), except
    shared values, which every microbatch gets whole: a tensor with one row while the batch has more
    (Hugging Face's ``position_ids`` of shape ``[1, T]``) and any value wrapped in `Replicated`
    (``{"x": x, "table": Replicated(t)}``; the stage gets ``t`` itself). The batch's rows are those of
    the split tensors; a target whose rows differ from the input's raises on every rank. The loss of
    microbatch j is weighted by rows_j / rows (or by ``loss_weight``). A stage is called as
    ``module(*x)`` for a tuple/list, ``module(**x)`` for a dict, else ``module(x)``; stage outputs may
    be tensors, tuples, lists or dicts of them, with non-tensor values passed along.

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

    A token-mean loss over a right-padded batch, with a shared ``[1, T]`` tensor::

        >>> from zbpp.runtime import Replicated
        >>> class Tagger(torch.nn.Module):
        ...     def __init__(self):
        ...         super().__init__()
        ...         self.emb = torch.nn.Embedding(5, 5, dtype=torch.float64)
        ...     def forward(self, ids, pos, scale):
        ...         return self.emb(ids + pos) * scale
        >>> def ce(logits, y):
        ...     return torch.nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten())  # ignore_index=-100
        >>> model = Tagger()
        >>> pipe = Pipeline({0: model}, build("1f1b", num_ranks=1, num_microbatches=2), loss_fn=ce,
        ...                 loss_weight=lambda y: (y != -100).sum())
        >>> ids, pos = torch.tensor([[1, 2, 0], [3, 0, 0]]), torch.tensor([[0, 1, 2]])
        >>> y = torch.tensor([[2, 3, -100], [1, -100, -100]])
        >>> loss = pipe.step((ids, pos, Replicated(torch.tensor(2.0))), target=y)
        >>> bool(torch.allclose(loss, ce(model(ids, pos, 2.0), y)))  # the mean over the 3 tokens
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
        costs: Costs | None = None,
        timeout: float | None = None,
        tied_parameters: Mapping[str, nn.Parameter] | None = None,
        loss_weight: Callable[[Any], Any] | None = None,
        seed: int | bool | None = None,
        split_wgrad: bool = True,
        cuda_graphs: bool = False,
    ) -> None:
        if not isinstance(schedule, Schedule):
            raise TypeError(f"schedule must be a zbpp.schedules.Schedule, got {type(schedule).__name__}")
        if not callable(loss_fn):
            raise TypeError(f"loss_fn must be callable, got {type(loss_fn).__name__}")
        if not isinstance(stage_modules, Mapping):
            raise TypeError(f"stage_modules must be a mapping {{stage: module}}, got {type(stage_modules).__name__}")
        if costs is not None and not isinstance(costs, Costs):
            raise TypeError(f"costs must be a zbpp.schedules.Costs, got {type(costs).__name__}")
        if timeout is not None and not (isinstance(timeout, (int, float)) and not isinstance(timeout, bool) and timeout > 0):
            raise ValueError(f"timeout must be a positive number of seconds, got {timeout!r}")
        if loss_weight is not None and not callable(loss_weight):
            raise TypeError(f"loss_weight must be callable (target of one microbatch -> weight), got {type(loss_weight).__name__}")
        if not (seed is None or isinstance(seed, (bool, int))):
            raise TypeError(f"seed must be None, an int or a bool, got {type(seed).__name__}")
        self.loss_weight = loss_weight
        #: the F tasks run under seeded generators (`zbpp.runtime.rng`); False: the global ones as they run
        self.seeded = seed is not False
        self._base_seed = (torch.initial_seed() if seed is None or seed is True else int(seed)) & ((1 << 63) - 1)
        #: the index of the next step (training or evaluation) in the derivation of its seeds; save it
        #: with a checkpoint and set it back to resume the same random streams
        self.rng_step = 0
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
        self._plan: Plan = make_plan(schedule, costs=costs)
        self._costs = costs
        self._eval_plan: Plan | None = None
        self._wgrad = {s: StageWgrad(m) for s, m in self.stage_modules.items()}
        self.split_wgrad = bool(split_wgrad)
        has_b = {t.stage for t in self._plan.ranks[self.pp_rank].tasks if t.kind is Kind.B}
        self._split_stages = {s for s in self.stage_modules
                              if s in has_b and _has_own_wgrad(self.stage_modules[s], self._wgrad[s])} if self.split_wgrad else set()
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
            self._channels = Channels(self.topology, self._plan.channels, self.device, span)
        self._fsdp = self._fsdp_reducer(reducer)  # before the tied copies' first broadcast
        self._tied = TiedParameters(tied_parameters or {}, self.stage_modules, self.topology, schedule.placement,
                                    self._agreement.group, self.device, span,
                                    split=self._fsdp.split_copies() if self._fsdp is not None else ())
        self._reducer = reducer
        if self._fsdp is not None:
            self._reducer = self._fsdp
        elif reducer is None and self.topology.dp_size > 1:
            from .grad_reduce import GradReducer

            # a gloo group of this rank's replicas: the presence of .grad travels on the host
            presence = [cached_group("dp-presence", [line[r] for line in self.topology.pipelines], "gloo", span)
                        for r in range(self.topology.pp_size)][self.pp_rank]
            self._reducer = GradReducer(self.stage_modules, self.topology, exclude=self._tied.param_ids(),
                                        presence_group=presence)
        if self._split_stages and callable(getattr(self._reducer, "owe_all_to_wgrad", None)):
            self._reducer.owe_all_to_wgrad(self._split_stages)
        self.cuda_graphs = bool(cuda_graphs)
        self._graphs: OrderedDict[tuple[Any, ...], TaskGraphs] = OrderedDict()
        if self.cuda_graphs:
            self._setup_graphs()
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
        the schedule, with the constructor's ``costs``): where each rank issues
        each send and receive; `zbpp.schedules.plan.plan_makespan` predicts its step."""
        return self._plan

    @property
    def reducer(self) -> Any:
        """The data-parallel `GradReducer` (`FsdpReducer` for ``fully_shard`` stages), or None
        without data parallelism."""
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
        and only the one holding the last stage uses `target`. Returns the batch's loss (the mean
        over rows, or weighted by ``loss_weight``; a detached scalar tensor, never synchronised with
        the device) on the rank holding the last stage, None elsewhere. Gradients are accumulated
        into ``.grad`` (zero them between steps as usual) or ``main_grad``. With `losses` (a list), the rank holding the last stage appends
        each microbatch's loss as `loss_fn` returned it (unweighted, detached; NaN for a microbatch
        that ``loss_weight`` gives 0 if `loss_fn` averages over nothing).

        Raises `PipelineError` on every rank when any rank fails (see the module docstring).
        """
        if losses is not None and not isinstance(losses, list):
            raise TypeError(f"losses must be a list to append the microbatch losses to, got {type(losses).__name__}")
        ex, new_signature, signature = self._begin(inputs, target, forward_only=False)  # agree on the input
        reducing = self._sync_gradients  # False inside no_sync()
        if self.cuda_graphs:  # before the aside: it keeps what the fixed .grad buffers hold
            self._grad_buffers.attach(list(self.parameters()))
        aside = GradientsAside(self.parameters(), keep=self.keep_grads_on_failure,
                               in_place=(reducing and self._unreduced) or self.cuda_graphs,
                               copy_main_grad=not (reducing and self._reducer is not None and not self._unreduced))
        problem: BaseException | None = None
        with self._compute_stream():
            try:
                self._start_reductions(reducing, lambda: ex.draining)
                ex.graphs = self._graphs_of(signature, new_signature)
                loss = ex.run()  # this rank's tasks, with the plan's communication
                if not ex.draining:
                    self._finish_reductions(reducing)
            except Exception as exc:  # noqa: BLE001 - the reducers; reported through the agreement
                problem = exc
        failure = self._end(ex, problem, new_signature, signature)  # agree on the outcome
        if failure is not None:
            if ex.graphs is not None and ex.graphs.capturing:  # a capture cut short is no graph
                self._graphs.pop(signature, None)
            aside.discard_step()
            raise failure
        if ex.graphs is not None:
            ex.graphs.capturing = False
        aside.take_back()
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
        from the first microbatch); with `target`, the batch's loss (weighted as in `step`). None
        elsewhere. No gradient is touched; activations are freed as they go. Modules keep their train/eval mode: call
        ``module.eval()`` yourself for dropout or batch norm.

        >>> import torch
        >>> from zbpp.schedules import build
        >>> pipe = Pipeline({0: torch.nn.Linear(3, 2)}, build("1f1b", num_ranks=1, num_microbatches=2),
        ...                 loss_fn=torch.nn.functional.mse_loss)
        >>> tuple(pipe.eval_step(torch.ones(4, 3)).shape)
        (4, 2)
        """
        ex, new_signature, signature = self._begin(inputs, target, forward_only=True)
        problem: BaseException | None = None
        try:
            with torch.no_grad():
                if self._fsdp is not None:
                    self._fsdp.begin_step()
                loss = ex.run()
                if self._fsdp is not None:
                    self._fsdp.end_step()
        except Exception as exc:  # noqa: BLE001
            problem = exc
        failure = self._end(ex, problem, new_signature, signature)
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
        mbs = tgts = raw = None
        in_hash, n_in, n_tgt = 0, -1, -1
        try:
            if first:
                if inputs is None:
                    raise ValueError(f"pipeline rank {self.pp_rank} holds stage 0, so the step needs the inputs")
                inputs = self._to_device(inputs, "input")
                mbs = split(inputs, m, what="input")
                n_in, in_hash = batch_rows(inputs, m, what="input"), _hash((m, flatten(inputs)[1]))
            if last and target is not None:
                target = self._to_device(target, "target")
                tgts = split(target, m, what="target")
                n_tgt = batch_rows(target, m, what="target")
            if last and self.loss_weight is not None and (target is not None or not forward_only):
                raw = self._raw_weights(tgts if tgts is not None else [None] * m)
        except Exception as exc:  # noqa: BLE001 - reported to every rank below
            problem = exc
        state_hash = _hash((self._module_state(), forward_only))
        mine = StartReport(problem is not None, state_hash, in_hash, n_in, n_tgt, self._base_seed)
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
        pipeline_reports = [reports[self.topology.world.index(g)] for g in self.topology.pipeline]
        base_seed, rng_step = pipeline_reports[0].seed, self.rng_step
        self.rng_step += 1
        rows = pipeline_reports[self.schedule.rank_of(0)].input_rows
        first_rank, last_rank = self.schedule.rank_of(0), self.schedule.rank_of(self.schedule.num_stages - 1)
        for pipeline in self.topology.pipelines:  # every replica's, so that every rank of the job raises
            n_in = reports[self.topology.world.index(pipeline[first_rank])].input_rows
            n_tgt = reports[self.topology.world.index(pipeline[last_rank])].target_rows
            if n_tgt >= 0 and n_tgt != n_in:
                raise ValueError(
                    f"the target has {n_tgt} rows along dim 0 but the input has {n_in} (pipeline of global ranks "
                    f"{list(pipeline)}): every tensor of the input and of the target is split into the same "
                    "microbatches along dim 0, except shared ones (one row, or Replicated). Nothing was computed"
                )
        weights: list[Any] = [(rows // m + (1 if j < rows % m else 0)) / rows for j in range(m)]  # tensor_split's sizes
        loss_weights = None
        if raw is not None:
            weights, loss_weights = self._weights(raw, forward_only)
        signature = (forward_only, pipeline_reports[self.schedule.rank_of(0)].input_hash, rows,
                     *(r.state_hash for r in pipeline_reports))
        new_signature = signature not in self._specs
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
            new_signature=new_signature,
            inputs=mbs,
            targets=tgts if tgts is not None else ([None] * m if last else None),
            weights=weights,
            loss_weights=loss_weights,
            rng_of=self._rng_of(base_seed, rng_step) if self.seeded else None,
            in_flight=self._in_flight,
            recorder=self._recorder if not forward_only else None,
            free_sent_activations=self.free_sent_activations,
            forward_only=forward_only,
            split_wgrad=bool(self._split_stages),
            **hooks,
        )
        return ex, new_signature, signature

    def _end(self, ex: StepExecutor, problem: BaseException | None, new_signature: bool, signature: tuple) -> PipelineError | None:
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
            self._after_failure(ex, new_signature, signature)
            if isinstance(exc, BrokenJob):
                exc = self._broken_error(exc, "end")
            return exc
        if not any(r.failed or r.drained or r.comm_broken for r in reports):
            return None
        self._after_failure(ex, new_signature, signature)
        text = None
        if ex.failure is not None:
            where = f"task {ex.failed_task}" if ex.failed_task is not None else "outside any task"
            text = (f"{self.topology.describe()}, {where} of schedule {self.schedule.name or 'custom'!r}: "
                    f"{type(ex.failure).__name__}: {ex.failure}")
            if ex.failed_task in tasks:
                text += "\n" + tasks_around(tasks, tasks.index(ex.failed_task), self.pp_rank)
        texts = self._agreement.gather_texts(text)
        failed = sorted((r.failed_at_us, i) for i, r in enumerate(reports) if r.failed and texts[i] is not None)
        first = texts[failed[0][1]] if failed else None
        first, _, around = (first or "").partition("\n")  # the failing rank's tasks, for the end
        first = first or None
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
               + (f". {self._broken}" if self._broken else "; the pipeline is usable")
               + (f"\n{around}" if around else ""))
        error = PipelineError(msg)
        if ex.failure is not None:
            error.__cause__ = ex.failure
        return error

    def _stage_backward_done(self, stage: int) -> None:
        if self._reducer is not None:
            self._reducer.stage_backward_done(stage)
        owed = self._stage_param_ids[stage] if stage in self._split_stages else self._wgrad[stage].wgrad_param_ids()
        self._tied.stage_done(stage, owed)

    def _stage_wgrad_done(self, stage: int) -> None:
        if self._reducer is not None:
            self._reducer.stage_wgrad_done(stage)
        self._tied.stage_done(stage, None)

    def _after_failure(self, ex: StepExecutor, new_signature: bool, signature: tuple) -> None:
        for w in self._wgrad.values():
            w.discard()
        if self._fsdp is not None and (ex.forward_only or not self._sync_gradients):
            try:
                self._fsdp.abandon()
            except Exception:  # noqa: BLE001 - best effort: the step is lost anyway
                pass
        if not ex.forward_only and self._sync_gradients:
            for reducer in (self._reducer, self._tied):
                try:
                    if reducer is not None:
                        reducer.abandon()
                except Exception:  # noqa: BLE001 - best effort: the step is lost anyway
                    pass
        if new_signature:  # some shapes of this signature may never have been learnt
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

    # -- reductions across a step ------------------------------------------------------------
    def _start_reductions(self, reducing: bool, draining: Callable[[], bool]) -> None:
        if self._fsdp is not None:
            self._fsdp.begin_step(draining)
        if not reducing:
            return
        if self._reducer is not None:
            self._reducer.start_step(keep_main_grad=self._unreduced)  # no_sync steps' main_grad stays
        self._tied.start_step()

    def _finish_reductions(self, reducing: bool) -> None:
        if not reducing:  # no_sync: FSDP only reshards; the unsharded gradients accumulate
            if self._fsdp is not None:
                self._fsdp.end_step()
            return
        if self._reducer is not None:
            self._reducer.finish()
        self._tied.finish()

    # -- internals ----------------------------------------------------------------------------
    def _raw_weights(self, targets: list[Any]) -> list[Any]:
        """``loss_weight`` of each microbatch's target, checked: a number or a one-element tensor."""
        assert self.loss_weight is not None
        out = []
        for j, t in enumerate(targets):
            w = self.loss_weight(t)
            ok = (isinstance(w, torch.Tensor) and w.numel() == 1) or (
                isinstance(w, (int, float)) and not isinstance(w, bool))
            if not ok:
                got = f"a tensor of shape {tuple(w.shape)}" if isinstance(w, torch.Tensor) else type(w).__name__
                raise TypeError(f"loss_weight must return a number or a one-element tensor, got {got} for microbatch {j}")
            out.append(w)
        return out

    def _weights(self, raw: list[Any], forward_only: bool) -> tuple[list[torch.Tensor], list[torch.Tensor] | None]:
        """The factors w_j / W of the microbatches' losses (0 where w_j is 0), as device tensors (no
        host synchronisation). With data-parallel replicas a training step's W is the total over every
        replica (one all-reduce) and the factors are scaled by the replicas' count, which the
        gradient averaging divides out; the returned loss keeps this replica's own weighting."""
        dtype = torch.float64 if self.device.type in ("cpu", "cuda") else torch.float32
        ws = torch.stack([w.detach().reshape(()).to(self.device, dtype) if isinstance(w, torch.Tensor)
                          else torch.full((), float(w), dtype=dtype, device=self.device) for w in raw])
        nonzero = ws != 0

        def factors(total: torch.Tensor, scale: float = 1.0) -> list[torch.Tensor]:
            return list(torch.where(nonzero, ws * scale / total, torch.zeros_like(ws)).unbind())

        local = factors(ws.sum())
        dp = self.topology.dp_size
        if forward_only or dp == 1:
            return local, None
        import torch.distributed as dist

        total = ws.sum()
        dist.all_reduce(total, group=self.topology.dp_group)
        return factors(total, float(dp)), local

    def _rng_of(self, base: int, step: int) -> Callable[[int, int], Any]:
        replica, device = self.topology.dp_rank, self.device
        return lambda stage, microbatch: seeded(microbatch_seed(base, step, stage, microbatch, replica), device)

    # -- CUDA graphs (`zbpp.runtime.task_graphs`) ---------------------------------------------
    def _setup_graphs(self) -> None:
        why = refusal(self.stage_modules, self.device)
        if why is not None:
            raise ValueError(why)
        if self._fsdp is not None:
            raise ValueError("cuda_graphs=True cannot capture fully_shard stages (FSDP all-gathers and frees "
                             "parameters from Python hooks around each task); pass cuda_graphs=False")
        self._grad_buffers = GradBuffers()
        cuda = self.device.type == "cuda"
        self._graph_pool = torch.cuda.graph_pool_handle() if cuda else None
        self._graph_stream = torch.cuda.Stream(self.device) if cuda else None

    @contextlib.contextmanager
    def _compute_stream(self) -> Iterator[None]:
        """A training step's stream: with CUDA graphs a side stream (no capture on the default one),
        which first waits for the caller's work and the sends of earlier steps (their buffers are
        static outputs that the step rewrites)."""
        stream = self._graph_stream if self.cuda_graphs else None
        if stream is None:
            yield
            return
        caller = torch.cuda.current_stream(self.device)
        stream.wait_stream(caller)
        with torch.cuda.stream(stream):
            for works, _ in self._in_flight:
                for w in works:
                    w.wait()
            try:
                yield
            finally:
                caller.wait_stream(stream)

    def _graphs_of(self, signature: tuple, new_signature: bool) -> TaskGraphs | None:
        """The graphs this training step captures or replays; None on a signature's first step (eager)."""
        if not self.cuda_graphs:
            return None
        params = list(self.parameters())
        if new_signature:
            self._graphs.pop(signature, None)
            return None
        external = external_addresses(params)
        graphs = self._graphs.get(signature)
        if graphs is None or graphs.external != external:
            graphs = TaskGraphs(self._graph_pool, stand_in=self._graph_stream is None)
            graphs.external = external
            self._graphs[signature] = graphs
        else:
            graphs.replays += 1
        self._graphs.move_to_end(signature)
        while len(self._graphs) > MAX_GRAPHED_SIGNATURES:  # same signatures on every rank: same eviction
            self._graphs.popitem(last=False)
        return graphs

    def _fsdp_reducer(self, reducer: Any) -> Any:
        """An `FsdpReducer` when a stage holds ``fully_shard`` modules (`zbpp.runtime.fsdp`), else None."""
        from .fsdp import FsdpReducer, holds_fsdp

        if not holds_fsdp(self.stage_modules):
            return None
        if reducer is not None:
            raise ValueError("reducer= cannot be combined with fully_shard stages: FSDP reduces their gradients")
        first = list(dict.fromkeys(a.stage for a in self._plan.ranks[self.pp_rank].tasks if a.kind.name == "F"))
        return FsdpReducer(self.stage_modules, self.topology.dp_size, first)

    def _forward_plan(self) -> Plan:
        if self._eval_plan is None:
            self._eval_plan = make_plan(self.schedule, costs=self._costs, forward_only=True)
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


def tasks_around(tasks: Sequence[Action], index: int, rank: int, context: int = 4) -> str:
    """One rank's schedule around its task `index`, that task marked (as torch.distributed.pipelining
    marks the failing action in its schedule grid).

    >>> from zbpp.schedules import build
    >>> print(tasks_around(build("zb-h1", num_ranks=2, num_microbatches=4).orders[1], 4, rank=1))
    pipeline rank 1, tasks 1-9 of 12:  F1.0 B1.0 F1.1 B1.1 [W1.0] F1.2 B1.2 W1.1 F1.3 ...
    """
    lo, hi = max(0, index - context), min(len(tasks), index + context + 1)
    shown = [f"[{a}]" if i == index else str(a) for i, a in enumerate(tasks[lo:hi], start=lo)]
    return (f"pipeline rank {rank}, tasks {lo + 1}-{hi} of {len(tasks)}:  "
            + ("... " if lo > 0 else "") + " ".join(shown) + (" ..." if hi < len(tasks) else ""))


def _has_own_wgrad(stage: nn.Module, wgrad: StageWgrad) -> bool:
    """The stage has a parameter that no delayed-wgrad module computes in W: only then is there
    anything for the generic split to move out of B (a walk of the graph per microbatch)."""
    delayed = {id(p) for m in wgrad.modules for p in m.parameters()}
    return any(id(p) not in delayed for p in stage.parameters())


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

