"""`Pipeline`: run any zbpp `Schedule` over the ranks of a pipeline, one step at a time.

Every rank runs the same script (torchrun) and builds a `Pipeline` with the stage modules it
holds. ``step(inputs, target)`` splits the batch into the schedule's microbatches, runs this rank's
tasks in the schedule's order (one interpreter for every schedule: `zbpp.runtime.executor`) and
leaves in ``.grad`` (or ``main_grad``) the gradient of the batch-mean loss, as one process running
the whole model on the whole batch would. See DESIGN.md ("Runtime", "Communication on NCCL").

Per step, before any compute, the ranks of the pipeline agree on the step in one small all-reduce
over the pipeline group: the microbatch sizes (from the rank holding stage 0), a signature of the
input's structure and shapes and of every rank's module state (train mode, which parameters
require grad), and whether some rank rejected its part of the input. A rejected input therefore
raises on every rank and leaves the `Pipeline` usable. A new signature makes the step send its
activations' shapes ahead of them (cached for later steps; see the executor).

Failures during a step: the failing rank raises `PipelineError` naming itself and the task, with
the original exception chained, after discarding the step's partial gradients of its stages
(``.grad`` set to None, ``main_grad`` zeroed, pending delayed wgrads dropped; gradients accumulated
by earlier steps are lost too, since they cannot be told apart) and every buffer of the step. The
other ranks wait for messages that will not come: under torchrun the agent stops them when the
failed process exits; otherwise they fail when the process group's timeout expires (gloo: a
timeout error or, once the failed process exits, a connection error; NCCL: the watchdog). Set that
timeout with ``init_process_group(timeout=...)`` (or `zbpp.runtime.init_distributed`). A failed
step counts on its rank, and the count is part of the next step's signature, so every rank of the
pipeline re-learns the activation shapes afterwards; when the failure left the process group
consistent (all messages of the step had gone through), the next step is correct. Otherwise the
process group's state is unknown: end the processes.
"""

from __future__ import annotations

import hashlib
import pickle
from collections import OrderedDict
from typing import Any, Callable, Iterator, Mapping

import torch
from torch import nn

from ..schedules.ir import Schedule
from .executor import PipelineError, StepExecutor
from .plan import fifo_wgrad_problem, make_plan
from .profiling import TaskRecorder
from .tree import flatten, rebuild, rows_of, split
from .wgrad import delayed_modules, discard_pending, supports_keys

__all__ = ["Pipeline"]

_MAX_SIGNATURES = 16  # cached input signatures (each holds one Spec per cross-rank activation)


class _Ctx:
    """Who this rank is in its pipeline and how to reach the others."""

    def __init__(self, groups: Any, num_ranks: int) -> None:
        import torch.distributed as dist

        self.groups = groups
        self.distributed = dist.is_available() and dist.is_initialized()
        if groups is not None:
            self.pp_rank, self.size, self.group = groups.pp_rank, groups.pp, groups.pp_group
            self.global_rank_of: Callable[[int], int] = groups.pp_peer
        elif self.distributed:
            world = dist.get_world_size()
            if world != num_ranks:
                raise ValueError(
                    f"the schedule has {num_ranks} ranks but the default process group has {world}; "
                    f"for data parallelism pass groups=ParallelGroups(pp={num_ranks})"
                )
            self.pp_rank, self.size, self.group = dist.get_rank(), world, dist.group.WORLD
            self.global_rank_of = lambda r: r
        else:
            if num_ranks != 1:
                raise RuntimeError(
                    f"the schedule has {num_ranks} ranks: initialize torch.distributed first "
                    "(run under torchrun and call init_process_group, or zbpp.runtime.init_distributed())"
                )
            self.pp_rank, self.size, self.group = 0, 1, None
            self.global_rank_of = lambda r: r
        if self.size != num_ranks:
            raise ValueError(f"the schedule has {num_ranks} ranks but the pipeline group has {self.size}")
        self.backend = dist.get_backend(self.group) if self.distributed and self.group is not None else None


class Pipeline:
    """Run `schedule` over this rank's `stage_modules`.

    Args:
        stage_modules: ``{stage: module}`` for exactly the stages `schedule` places on this rank
            (``schedule.stages_on(pp_rank)``). They must already be on `device`.
        schedule: a `zbpp.schedules.Schedule` (validated here; an invalid one raises `ScheduleError`).
        loss_fn: ``loss_fn(output, target) -> scalar tensor``, the mean over one microbatch. Used on
            the rank holding the last stage.
        groups: a `ParallelGroups` for data parallelism (gradients are averaged over the replicas);
            None uses the whole default process group as the pipeline (or, without
            torch.distributed, a one-rank schedule in this process).
        device: where activations live; default: the current CUDA device under NCCL, else the
            device of the stage modules' first parameter, else the CPU.
        profile: record each task's start and end (see `profile_records`).
        free_sent_activations: release a sent activation's memory as soon as its send completes
            (B still works: only the autograd node is kept). Turn off only if your code holds on
            to stage outputs.
        reducer: the gradient reducer to drive (``start_step``, ``stage_backward_done(stage)``
            after the stage's last B/BW, ``stage_wgrad_done(stage)`` after its last W/BW,
            ``finish``); default: a `zbpp.runtime.grad_reduce.GradReducer` when ``groups.dp > 1``,
            else none.

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
    ) -> None:
        if not isinstance(schedule, Schedule):
            raise TypeError(f"schedule must be a zbpp.schedules.Schedule, got {type(schedule).__name__}")
        if not callable(loss_fn):
            raise TypeError(f"loss_fn must be callable, got {type(loss_fn).__name__}")
        self.schedule = schedule
        self.loss_fn = loss_fn
        self.groups = groups
        self._ctx = _Ctx(groups, schedule.num_ranks)
        self.pp_rank: int = self._ctx.pp_rank
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
        self._plan = make_plan(schedule).ranks[self.pp_rank]
        self._delayed = {s: delayed_modules(m) for s, m in self.stage_modules.items()}
        self._keyed = {s: [supports_keys(d) for d in mods] for s, mods in self._delayed.items()}
        for s, flags in self._keyed.items():
            fifo = [type(d).__name__ for d, k in zip(self._delayed[s], flags) if not k]
            if fifo:
                problem = fifo_wgrad_problem(schedule, s)
                if problem is not None:
                    raise ValueError(
                        f"stage {s} has delayed-wgrad modules without microbatch keys ({', '.join(sorted(set(fifo)))}: "
                        f"backward_dw() takes the oldest pending wgrad), which schedule "
                        f"{schedule.name or 'custom'!r} cannot use: {problem}. Use a schedule that keeps each "
                        "stage's W in B order, or modules that take a microbatch key (zbpp.modules)"
                    )
        self.device = self._resolve_device(device)
        self.profile = bool(profile)
        self.free_sent_activations = bool(free_sent_activations)
        self._recorder = TaskRecorder(self.pp_rank, self.device) if self.profile else None
        self._specs: OrderedDict[tuple[int, ...], dict[tuple[int, int], Any]] = OrderedDict()
        self._failures = 0
        self._transport = None
        if self._ctx.size > 1:
            from .p2p import Transport

            self._transport = Transport(self._ctx.group, self._ctx.global_rank_of, self.device)
        self._reducer = reducer
        if reducer is None and groups is not None and int(getattr(groups, "dp", 1)) > 1:
            from .grad_reduce import GradReducer

            self._reducer = GradReducer(self.stage_modules, groups)

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

    def step(self, inputs: Any = None, target: Any = None) -> torch.Tensor | None:
        """Run one training step's forward and backward.

        Every rank may pass `inputs` and `target`; only the rank holding stage 0 uses `inputs`
        and only the one holding the last stage uses `target`. Returns the batch-mean loss (a
        detached scalar tensor) on the rank holding the last stage, None elsewhere. Gradients are
        accumulated into ``.grad`` (zero them between steps as usual) or ``main_grad``.
        """
        m = self.schedule.num_microbatches
        first, last = self.holds_first_stage, self.holds_last_stage
        problem: Exception | None = None
        mbs = tgts = None
        rows: list[int] = [0] * m
        in_hash = 0
        try:
            if first:
                if inputs is None:
                    raise ValueError(f"pipeline rank {self.pp_rank} holds stage 0, so step() needs the inputs")
                inputs = self._to_device(inputs)
                mbs = split(inputs, m, what="input")
                rows = [rows_of(x) for x in mbs]
                _, spec = flatten(inputs)
                in_hash = _hash((m, spec))
            if last and target is not None:
                tgts = split(self._to_device(target), m, what="target")
        except Exception as exc:  # noqa: BLE001 - reported to every rank below
            problem = exc
        # The failure count makes every rank's signature new after a failed step on any rank, so all
        # of them send shapes ahead again (a failed rank may have learnt only some of them).
        state_hash = _hash((self._module_state(), self._failures))
        flags, states, in_hash, rows = self._agree(problem is not None, state_hash, in_hash, rows)
        if problem is not None:
            raise problem
        if any(flags):
            bad = [r for r, f in enumerate(flags) if f]
            raise PipelineError(
                f"pipeline rank(s) {bad} rejected their part of the step's input (their error says why); "
                "nothing was computed"
            )
        if last and tgts is None:
            tgts = [None] * m
        total = sum(rows)
        weights = [r / total for r in rows]
        signature = (in_hash, *states, *rows)
        sync = signature not in self._specs
        specs = self._specs.setdefault(signature, {})
        self._specs.move_to_end(signature)
        while len(self._specs) > _MAX_SIGNATURES:  # same sequence of signatures on every rank: same eviction
            self._specs.popitem(last=False)

        ex = StepExecutor(
            plan=self._plan,
            num_stages=self.schedule.num_stages,
            modules=self.stage_modules,
            delayed=self._delayed,
            keyed=self._keyed,
            loss_fn=self.loss_fn,
            transport=self._transport,
            specs=specs,
            sync=sync,
            inputs=mbs,
            targets=tgts,
            weights=weights,
            recorder=self._recorder,
            on_backward_done=self._reducer.stage_backward_done if self._reducer is not None else None,
            on_wgrad_done=self._reducer.stage_wgrad_done if self._reducer is not None else None,
            free_sent_activations=self.free_sent_activations,
        )
        del mbs, tgts, inputs, target
        try:
            if self._reducer is not None:
                self._reducer.start_step()
            loss = ex.run()
            if self._reducer is not None:
                self._reducer.finish()
        except BaseException as exc:
            task = ex.current
            self._failures += 1
            ex.abandon()
            if sync:
                self._specs.pop(signature, None)
            self._discard_gradients()
            if not isinstance(exc, Exception):
                raise  # KeyboardInterrupt and friends: as they are
            where = f"task {task}" if task is not None else "outside any task"
            cls = type(exc) if isinstance(exc, PipelineError) else PipelineError
            raise cls(
                f"pipeline rank {self.pp_rank}, {where} of schedule {self.schedule.name or 'custom'!r}: "
                f"{type(exc).__name__}: {exc}. This rank's gradients of the step were discarded "
                "(.grad set to None, main_grad zeroed); the other ranks will fail with a timeout or a "
                "connection error"
            ) from exc
        return loss

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
        if self._ctx.size == 1:
            return mine
        import torch.distributed as dist

        root = self._ctx.global_rank_of(0)
        gathered: list[Any] | None = [None] * self._ctx.size if self.pp_rank == 0 else None
        dist.gather_object(mine, gathered, dst=root, group=self._ctx.group)
        if gathered is None:
            return None
        return [rec for recs in gathered for rec in recs]

    # -- internals ----------------------------------------------------------------------------
    def _resolve_device(self, device: torch.device | str | None) -> torch.device:
        if device is not None:
            return torch.device(device)
        if self._ctx.backend == "nccl":
            return torch.device("cuda", torch.cuda.current_device())
        for m in self.stage_modules.values():
            for t in list(m.parameters()) + list(m.buffers()):
                return t.device
        return torch.device("cpu")

    def _to_device(self, obj: Any) -> Any:
        leaves, spec = flatten(obj)
        return rebuild(spec, [t.to(self.device) for t in leaves])

    def _module_state(self) -> tuple:
        """What, besides the input, decides the shapes and requires_grad of the activations."""
        return tuple(
            (s, tuple(mod.training for mod in m.modules()), tuple(p.requires_grad for p in m.parameters()))
            for s, m in self.stage_modules.items()
        )

    def _agree(self, bad: bool, state_hash: int, in_hash: int, rows: list[int]) -> tuple[list[int], list[int], int, list[int]]:
        """All-reduce (sum) of [problem flag per rank | module-state hash per rank | input hash | rows]."""
        p, r = self._ctx.size, self.pp_rank
        if p == 1:
            return [int(bad)], [state_hash], in_hash, rows
        import torch.distributed as dist

        vec = [0] * (2 * p + 1 + len(rows))
        vec[r] = int(bad)
        vec[p + r] = state_hash
        vec[2 * p] = in_hash
        vec[2 * p + 1:] = rows
        dev = self.device if self._ctx.backend == "nccl" else torch.device("cpu")
        t = torch.tensor(vec, dtype=torch.int64, device=dev)
        dist.all_reduce(t, op=dist.ReduceOp.SUM, group=self._ctx.group)
        out = t.tolist()
        return out[:p], out[p:2 * p], out[2 * p], out[2 * p + 1:]

    def _discard_gradients(self) -> None:
        for mods in self._delayed.values():
            discard_pending(mods)
        for p in self.parameters():
            p.grad = None
            main = getattr(p, "main_grad", None)
            if isinstance(main, torch.Tensor):
                main.zero_()


def _hash(obj: Any) -> int:
    """A 55-bit hash of a picklable object (sums of a few of them stay inside int64)."""
    try:
        data = pickle.dumps(obj)
    except Exception as exc:  # noqa: BLE001
        raise ValueError(f"the step's input holds a non-tensor value that cannot be pickled: {exc}") from exc
    return int.from_bytes(hashlib.blake2b(data, digest_size=7).digest(), "little") >> 1
