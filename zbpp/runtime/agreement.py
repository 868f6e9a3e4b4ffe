"""The two agreements of a step, among every rank of the job (every pipeline rank of every replica).

Both run on a gloo group over CPU tensors (`channels.agreement_group`): agreeing never waits for a
GPU, so a step whose input signature was seen before has no host-device synchronisation, and the
CPU can run ahead of the GPU across steps.

- At construction (`agree_to_build`), every rank tells whether its own checks failed, and the job
  takes one base seed for the random streams of the F tasks: global rank 0's (`zbpp.runtime.rng`;
  the replicas differ through their ``dp_rank`` only, so a checkpoint's one copy resumes them all).
- At the start of a step, every rank contributes a `StartReport`: whether its part of the input was
  rejected, a hash of its module state, and, from the ranks holding the first and the last stage,
  the input's hash and row count and the target's hash and row count. A rejected input, ranks of
  which some evaluate (``eval_step``) while others train, a target whose rows differ from the
  input's, or data-parallel replicas whose module states differ (a parameter
  frozen on one replica only: the reducers' buckets would pair other parameters' gradients) or in
  which delayed-wgrad layers still delay (``delay_wgrad_compute`` turned off on some replicas only:
  likewise) raise on every rank before any compute.
  `decide_start` decides: the step's rows and input signature (`StartDecision`). Under
  ``cuda_graphs="auto"`` a rank whose trial of a signature just ended also reports the slowest
  eager and the fastest replayed step it timed, and the decision carries the form every rank takes
  (`graphs_win`); other steps carry zeros: no collective is added.
- At the end, every rank contributes an `EndReport`: whether it failed (and in which task, and
  when), drained because a peer failed, or saw its communication break. If any rank failed, every
  rank raises; the failing ranks' messages travel with the agreement, so every rank names the first
  failure (by wall-clock time: a rank computing on a drained peer's placeholders may fail after it;
  `failed_step_error`).

A KeyboardInterrupt, a SystemExit or a store error that comes while a rank takes part in either
agreement does not make it leave the collective (the others would wait for it): the agreement
completes and the caller gets it with `Agreement.take_held`. So with the exchanges of messages
(`Agreement.gather_objects`) and those of a collective call (building a `Pipeline`, `check_ties`,
a checkpoint: `agree_on_problems`; ``clip_grad_norm_``: `agree_nothing_failed`), where it is raised
once the outermost call ends (`collective_call`): the peers complete the call too.

A rank that died makes the agreement fail. gloo tells only the ranks that exchange data with it
directly (a closed connection, at once); the others would wait for the group's timeout. So a rank
that sees the agreement fail, or a send or receive fail during the step, marks the job *broken*
in the default store; every rank looks for that mark before an agreement and while it waits for
one: all of them raise within moments, and none enters a collective that others have left.

>>> Agreement(None).gather(EndReport(failed=False, drained=False, comm_broken=False, task=-1))[0].failed
False
"""

from __future__ import annotations

import contextlib
import pickle
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Any, Callable, Iterable, Iterator, Sequence, TypeVar

import torch

from .._compat import default_store, process_group_name
from .errors import PipelineError, describe_error
from .polling import poll

if TYPE_CHECKING:
    from ..schedules.ir import Action
    from .failure import StepFailure

__all__ = ["StartReport", "EndReport", "Agreement", "BrokenJob", "StartDecision", "agree_nothing_failed", "agree_on_problems",
           "agree_to_build", "collective_call", "decide_start", "decide_end", "failed_step_error", "graphs_win"]

R = TypeVar("R", "StartReport", "EndReport")

_POLL_STORE_S = 0.02  # how often a waiting rank looks for the broken mark


@dataclass(frozen=True)
class StartReport:
    """One rank's contribution to a step's start agreement (integers only)."""

    rejected: bool  #: its part of the input was refused (its error says why)
    state_hash: int  #: train/eval modes and requires_grad flags of its modules, the caller's autocast, the step kind
    input_hash: int  #: the input's structure and shapes (rank holding stage 0; else 0)
    input_rows: int  #: rows of the input (rank holding stage 0; else -1)
    target_rows: int  #: rows of the target (rank holding the last stage, when given; else -1)
    trial: bool = False  #: a signature's trial of task graphs ended on it (``cuda_graphs="auto"``)
    eager_us: int = 0  #: that trial's slowest eager step, microseconds (0: none timed)
    graphs_us: int = 0  #: that trial's fastest replayed step, microseconds (0: none timed)
    eager_issue_us: int = 0  #: the host's longest issue of that trial's eager steps, microseconds (0: not timed)
    #: the target's structure, shapes and non-tensor values (rank holding the last stage, when given; else 0)
    target_hash: int = 0
    #: a training step's reductions: 0 none on this rank (or evaluation), 1 synchronised, 2 inside ``no_sync()``
    reducing: int = 0
    evaluating: bool = False  #: an ``eval_step`` (its program has no backward), not a ``step``
    #: bit i: this rank holds a copy of tied parameter i (of every rank's, sorted) that trains / is frozen;
    #: wide: as many int64 words as the ties need (`tie_words`)
    ties_training: int = field(default=0, metadata={"wide": True})
    ties_frozen: int = field(default=0, metadata={"wide": True})
    #: which of its delayed-wgrad modules defer their weight gradients now, hashed (0: an ``eval_step``)
    delaying_hash: int = 0


#: bits of a wide report field (a bit set) per int64 word of the gathered tensor: kept non-negative
WORD_BITS = 62


def tie_words(num_ties: int) -> int:
    """The int64 words a bit set of `num_ties` ties takes in the start agreement (at least one)."""
    return max(1, -(-num_ties // WORD_BITS))


def _encode(report: Any, words: int) -> list[int]:
    """`report`'s fields as int64 values, each wide one (a bit set) split into `words` words."""
    out: list[int] = []
    for f in fields(report):
        value = int(getattr(report, f.name))
        if not f.metadata.get("wide"):
            out.append(value)
            continue
        if value < 0 or value >> (WORD_BITS * words):  # its bits would be lost: no rank would see them
            raise ValueError(f"{type(report).__name__}.{f.name} = {value} does not fit {words} words of {WORD_BITS} bits")
        out.extend(value >> (WORD_BITS * j) & ((1 << WORD_BITS) - 1) for j in range(words))
    return out


def _decode(kind: type[R], values: list[int], words: int) -> R:
    """`_encode` undone."""
    args: list[Any] = []
    at = 0
    for f in fields(kind):
        if f.metadata.get("wide"):
            args.append(sum(v << (WORD_BITS * j) for j, v in enumerate(values[at:at + words])))
            at += words
        else:
            args.append(bool(values[at]) if f.type in ("bool", bool) else int(values[at]))
            at += 1
    return kind(*args)


@dataclass(frozen=True)
class EndReport:
    """One rank's contribution to a step's end agreement."""

    failed: bool  #: an exception on this rank (not a peer's POISON)
    drained: bool  #: it stopped computing because some rank failed
    comm_broken: bool  #: a send or receive failed (e.g. a dead peer): the pipeline is unusable
    task: int  #: index of the failed task in this rank's program (-1: none, or outside any task)
    failed_at_us: int = 0  #: wall-clock time of the failure (us since the epoch): the first one is the cause


class BrokenJob(RuntimeError):
    """An agreement could not complete: a rank of the job is dead or hung."""


class Agreement:
    """Gathers every rank's report over the job's gloo group (None: a one-process pipeline)."""

    def __init__(self, group: Any) -> None:
        self.group = group
        self._store: Any = None
        self._key = ""
        self._held: BaseException | None = None  # see `take_held`
        if group is not None:
            self._store = default_store()
            self._key = f"zbpp/{process_group_name(group)}/broken"

    def gather(self, mine: R, words: int = 1) -> list[R]:
        """Every rank's report, in the group's rank order; raises `BrokenJob` when a rank is gone.
        `words`: the int64 words of each wide field (a bit set), the same on every rank."""
        if self.group is None:
            return [mine]
        import torch.distributed as dist

        self._holding(self.check)  # a collective some ranks already left would fail, or mismatch gloo's buffers
        t = torch.tensor(_encode(mine, words), dtype=torch.int64)
        out = [torch.empty_like(t) for _ in range(dist.get_world_size(self.group))]
        self._wait(dist.all_gather(out, t, group=self.group, async_op=True))
        return [_decode(type(mine), o.tolist(), words) for o in out]

    def any(self, flag: bool) -> bool:
        """Whether some rank's `flag` is set: one all-reduce of an int, cheaper than `gather` (for
        calls made every step), waited for as `gather` waits; `BrokenJob` when a rank is gone."""
        if self.group is None:
            return flag
        import torch.distributed as dist

        self._holding(self.check)
        t = torch.tensor([int(flag)], dtype=torch.int32, device=self._device())
        self._wait(dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group, async_op=True))
        return bool(t.item())

    def _device(self) -> torch.device:
        """Where this group's tensors go: the GPU for an NCCL-only group (a caller's, such as
        ``clip_grad_norm_``'s or a checkpoint's), else the host."""
        import torch.distributed as dist

        backend = str(dist.get_backend(self.group))
        on_cuda = "nccl" in backend and "gloo" not in backend
        return torch.device("cuda", torch.cuda.current_device()) if on_cuda else torch.device("cpu")

    def gather_texts(self, text: str | None) -> list[str | None]:
        """Every rank's `text` (only when some rank has one to tell: it pickles)."""
        return self.gather_objects(text)

    def gather_objects(self, obj: Any) -> list[Any]:
        """Every rank's picklable `obj`, in the group's rank order (rare exchanges only: it pickles).

        Two collectives, the lengths then the bytes, each waited for as `gather` waits (an interrupt
        is held, the broken mark looked for): ``all_gather_object`` blocks in each, and an interrupt
        that came meanwhile was raised between them, leaving the peers in the second one (which
        then paired with this rank's next collective: gloo aborted the process)."""
        if self.group is None:
            return [obj]
        import torch.distributed as dist

        self._holding(self.check)
        device = self._device()
        data = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8).to(device)
        n = dist.get_world_size(self.group)
        lengths = [torch.empty(1, dtype=torch.int64, device=device) for _ in range(n)]
        mine = torch.tensor([data.numel()], dtype=torch.int64, device=device)
        self._wait(dist.all_gather(lengths, mine, group=self.group, async_op=True))
        sizes = [int(t.item()) for t in lengths]
        padded = torch.zeros(max(sizes), dtype=torch.uint8, device=device)
        padded[: data.numel()] = data
        out = [torch.empty_like(padded) for _ in range(n)]
        self._wait(dist.all_gather(out, padded, group=self.group, async_op=True))
        return [pickle.loads(o[:k].cpu().numpy().tobytes()) for o, k in zip(out, sizes)]

    def check(self) -> None:
        """Raise `BrokenJob` if some rank marked the job broken."""
        if self._store is not None and self._store.check([self._key]):
            raise BrokenJob(self._store.get(self._key).decode(errors="replace"))

    def mark_broken(self, why: str) -> None:
        """Tell every rank waiting for an agreement that it will not complete."""
        if self._store is not None:
            try:
                self._store.set(self._key, why)
            except Exception:  # noqa: BLE001 - the store's host may be the dead one
                pass

    def take_held(self) -> BaseException | None:
        """What interrupted this rank while it took part in the last `gather` (a KeyboardInterrupt,
        a SystemExit, an error of the store other than the broken mark), and forget it; None: nothing.

        Leaving the collective then would strand the peers: they would wait for this rank's part
        until the group's timeout (it came before posting it) or, the agreement complete, go into a
        step this rank never runs. So `gather` holds it and completes; the caller decides what to
        do with it (`Pipeline` drains the step, or raises it once the step's outcome is settled)."""
        held, self._held = self._held, None
        return held

    def wait_collective(self, work: Any, device: torch.device) -> None:
        """Wait for `work`, a collective of another group that every rank posts outside the
        agreements (a step's all-reduce of the loss weights, ``clip_grad_norm_``'s), as `gather` waits
        for its own: an interrupt is held (`take_held`), the broken mark looked for, a failure marks
        the job broken (`BrokenJob`). On CUDA ``wait`` only orders streams: waited for plainly."""
        if device.type == "cuda":
            work.wait()
            return
        self._wait(work)

    def _holding(self, fn: Callable[[], None]) -> bool:
        """``fn()``; an interrupt or error in it other than `BrokenJob` is held (`take_held`).
        True when it returned."""
        try:
            fn()
        except BrokenJob:
            raise
        except (Exception, KeyboardInterrupt, SystemExit) as exc:  # noqa: BLE001 - held, see take_held
            self._held = self._held or exc
            return False
        return True

    def _wait(self, work: Any) -> None:
        """Wait for the collective `work` to the end, looking for the broken mark meanwhile."""
        while not self._holding(lambda: poll(work, self.check, _POLL_STORE_S)):
            pass  # held; the peers are in the collective with this rank: wait on
        try:
            work.wait()
        except Exception as exc:  # noqa: BLE001 - gloo: a closed connection or a timeout
            why = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
            self.mark_broken(why)
            raise BrokenJob(why) from exc


#: interrupts held by the exchanges of the collective call in progress (`collective_call`), and its depth
_DEFERRED: list[BaseException] = []
_DEPTH = [0]


@contextlib.contextmanager
def collective_call() -> Iterator[None]:
    """A collective call made of several exchanges (building a `Pipeline`, `check_ties`, a
    checkpoint, which may call `check_ties`): an interrupt that an exchange of `agree_on_problems`
    held is raised when the outermost call ends (from the call's own error, if it raised one), so
    the peers complete the call with this rank rather than wait in its next exchange."""
    _DEPTH[0] += 1
    try:
        yield
    except BaseException as exc:
        _DEPTH[0] -= 1
        held = _take_deferred()
        if held is not None and not isinstance(held, Exception):
            raise held from exc
        raise
    _DEPTH[0] -= 1
    held = _take_deferred()
    if held is not None:
        raise held


def _take_deferred() -> BaseException | None:
    """The first interrupt held during the outermost `collective_call`, once it ends (else None)."""
    if _DEPTH[0] > 0 or not _DEFERRED:
        return None
    held = _DEFERRED[0]
    _DEFERRED.clear()
    return held


def agree_on_problems(agreement: Agreement, problem: BaseException | None, world: Sequence[int], failed: str,
                      payload: Any = None) -> list[Any]:
    """A collective call's local part done: every rank tells whether it failed (`problem`), before
    any rank waits in a collective for one that will never come. The failed rank raises its own
    error; every other raises a `PipelineError` ``"<failed>; global rank <g>: <error>"`` (`world`:
    the group's global ranks). Returns every rank's `payload`, in the group's rank order. An
    interrupt while this rank exchanged is raised after the exchange, or at the end of the
    `collective_call` it is part of."""
    told = agreement.gather_objects((None if problem is None else describe_error(problem), payload))
    _raise_or_defer(agreement.take_held())
    if problem is not None:
        raise problem
    bad = [f"global rank {g}: {text}" for g, (text, _) in zip(sorted(world), told) if text is not None]
    if bad:
        raise PipelineError(f"{failed}; " + "; ".join(bad))
    return [p for _, p in told]


def agree_nothing_failed(agreement: Agreement, problem: BaseException | None, world: Sequence[int],
                         failed: str, some_failed: bool | None = None) -> None:
    """`agree_on_problems` without a payload, for a call made every step (``clip_grad_norm_``): one
    all-reduce of a flag where no rank failed (`Agreement.any`); the messages travel only when one did.
    `some_failed`: the flag's maximum over the ranks, where the caller's own all-reduce carried it
    (``unscale_``): then no exchange at all unless some rank failed."""
    if agreement.any(problem is not None) if some_failed is None else some_failed:
        agree_on_problems(agreement, problem, world, failed)  # takes the held interrupt too
    _raise_or_defer(agreement.take_held())


def _raise_or_defer(held: BaseException | None) -> None:
    """An interrupt held while this rank exchanged: raised now, or at the end of the outermost
    `collective_call` in progress."""
    if held is not None:
        if _DEPTH[0] == 0:
            raise held
        _DEFERRED.append(held)


def agree_to_build(agreement: Agreement, problem: BaseException | None, world: Sequence[int], seed: int,
                   schedule: tuple[int, str] | None = None) -> int:
    """`Pipeline`'s construction (`agree_on_problems`). Returns the job's base seed: the `seed` of
    the lowest global rank (rank 0 of the default group). `schedule`: this rank's schedule, as a
    hash of its tasks and a description; ranks whose schedules differ raise a ValueError on every rank
    (their programs would wait for each other's messages until the group's timeout)."""
    told = agree_on_problems(agreement, problem, world, "Pipeline could not be built on every rank", (seed, schedule))
    holders: dict[tuple[int, str] | None, list[int]] = {}
    for g, (_, theirs) in zip(sorted(world), told):
        holders.setdefault(theirs, []).append(g)
    if len(holders) > 1:
        raise ValueError(
            "the ranks build their Pipeline with different schedules: "
            + "; ".join(f"global ranks {ranks}: {key[1] if key else 'none'}" for key, ranks in holders.items())
            + ". Every rank of the job builds it with the same schedule (the same tasks in the same order)"
        )
    return int(told[0][0])


@dataclass(frozen=True)
class StartDecision:
    """What the start agreement decided for one pipeline (every rank of it decides the same)."""

    rows: int  #: rows of the batch (from the rank holding stage 0)
    signature: tuple  #: the step's input signature: the input's and target's shapes and rows, every rank's module state
    graphs: bool | None = None  #: the form of the signature whose trial ended (`graphs_win`; None: no trial ended)


#: how much faster the replays must be for task graphs to be kept: a closer result is within what
#: two timed steps resolve, and graphs hold memory (static inputs, their pool) for it
GRAPHS_MARGIN = 0.02

#: how much slower than during its trial a host may run later: the GPU machines' hosts ran a fixed
#: piece of host work at speeds up to 2x apart within one process (docs/benchmarks.md); an eager step
#: whose issue would then outlast it is paced by the host, and its trial saw only that moment's speed.
#: The issue time counts the host's waits on the device (the previous step's tail, a synchronising
#: allocation) too: on a GPU-paced stage it may reach half of the step, costing at most the margin
HOST_SPEED_SPREAD = 2.0


def graphs_win(reports: Sequence[StartReport]) -> bool | None:
    """The form a trial chose, from the reports of the ranks whose trial ended (None: none did):
    the slowest rank of each form sets its pace, and graphs win if eager was not timed or their
    slowest rank was at least `GRAPHS_MARGIN` faster than eager's slowest; or, where a host
    `HOST_SPEED_SPREAD` times slower would have set eager's pace (its longest issue time that many
    times over is at least eager's step), if they were at most `GRAPHS_MARGIN` slower: replays do
    not follow the host's speed, which the trial saw only at one moment.

    >>> graphs_win([StartReport(False, 0, 0, -1, -1, trial=True, eager_us=90, graphs_us=100),
    ...             StartReport(False, 0, 0, -1, -1, trial=True, eager_us=130, graphs_us=95)])
    True
    >>> graphs_win([StartReport(False, 0, 0, -1, -1, trial=True, eager_us=90, graphs_us=100)])
    False
    >>> graphs_win([StartReport(False, 0, 0, -1, -1, trial=True, eager_us=100, graphs_us=99)])
    False
    >>> graphs_win([StartReport(False, 0, 0, -1, -1, trial=True, eager_us=100, graphs_us=101, eager_issue_us=60)])
    True
    """
    ended = [r for r in reports if r.trial]
    if not ended:
        return None
    eager, graphs = max(r.eager_us for r in ended), max(r.graphs_us for r in ended)
    host_paced = HOST_SPEED_SPREAD * max(r.eager_issue_us for r in ended) >= eager
    return eager <= 0 or graphs <= eager * (1 + GRAPHS_MARGIN if host_paced else 1 - GRAPHS_MARGIN)


def decide_start(agreement: Agreement, mine: StartReport, problem: BaseException | None, topology: Any,
                 schedule: Any, forward_only: bool, tie_names: Sequence[str] = (),
                 not_delaying: Callable[[], list[str]] = list) -> StartDecision:
    """Gather every rank's `StartReport` and decide: raise on every rank when one rejected its
    input (that rank: its own error), a target's rows differ from the input's, a tie's copies
    (`tie_names`: the bits of ``ties_training``) are frozen unalike or replicas differ in which
    delayed-wgrad modules delay (`not_delaying`: this rank's modules that no longer do, for the
    error); else the step's rows and signature, and the form a trial that ended chose. `BrokenJob`
    when a rank is gone."""
    reports = agreement.gather(mine, words=tie_words(len(tie_names)))  # every rank's tie_names are alike
    if any(r.rejected for r in reports):
        texts = agreement.gather_texts(None if problem is None else describe_error(problem))
        if problem is not None:
            raise problem
        bad = [(rank, t) for rank, t in zip(topology.world, texts) if t is not None]
        raise PipelineError(
            f"global rank {bad[0][0]} rejected its part of the step's input ({bad[0][1]}); "
            f"ranks {[r for r, _ in bad]} rejected theirs. Nothing was computed"
        )
    if len({r.evaluating for r in reports}) > 1:  # the training ranks would wait for gradients never sent
        evaluating = [g for g, r in zip(topology.world, reports) if r.evaluating]
        training = [g for g, r in zip(topology.world, reports) if not r.evaluating]
        raise ValueError(
            f"global ranks {evaluating} call Pipeline.eval_step() and global ranks {training} Pipeline.step() "
            "together: their programs differ (forward only, forward and backward), so each would wait for the "
            "other's messages. Every rank takes the same kind of step at once. Nothing was computed"
        )
    modes = {r.reducing for r in reports} - {0}
    if len(modes) > 1:  # the synchronised ranks would wait for all-reduces the others skip
        inside = [g for g, r in zip(topology.world, reports) if r.reducing == 2]
        outside = [g for g, r in zip(topology.world, reports) if r.reducing == 1]
        raise ValueError(
            f"global ranks {inside} step inside Pipeline.no_sync() and global ranks {outside} outside it: the "
            "data-parallel and tied-parameter reductions of the ones outside would wait for the others. Enter "
            "no_sync() alike on every rank. Nothing was computed"
        )
    trains = frozen = 0
    for r in reports:
        trains, frozen = trains | r.ties_training, frozen | r.ties_frozen
    if trains & frozen:  # a trained copy's all-reduce would wait for the frozen ones until the timeout
        i = (trains & frozen).bit_length() - 1
        name = tie_names[i] if i < len(tie_names) else f"number {i}"
        frozen_on, trains_on = ([g for g, r in zip(topology.world, reports) if getattr(r, flag) >> i & 1]
                                for flag in ("ties_frozen", "ties_training"))
        raise ValueError(
            f"tied parameter {name!r} is frozen (requires_grad=False) on global ranks {frozen_on} but trains on "
            f"{trains_on}: its copies are one parameter, whose gradient is summed over all of them. Freeze or "
            "unfreeze every copy alike (each rank holding one). Nothing was computed"
        )
    # the reducers pair the replicas' gradients slot by slot; only where every pipeline is a
    # data-parallel replica (a mesh's other dimensions, tensor parallelism, may hold other modules)
    positions = range(topology.pp_size) if len(topology.pipelines) == topology.dp_size > 1 else range(0)
    for position in positions:
        line = [pipeline[position] for pipeline in topology.pipelines]
        alike: dict[int, list[int]] = {}
        for g in line:
            alike.setdefault(reports[topology.world.index(g)].state_hash, []).append(g)
        if len(alike) > 1:
            raise ValueError(
                f"the data-parallel replicas of pipeline rank {position} hold their stages differently (global ranks "
                f"{list(alike.values())} differ in some parameter's requires_grad, some module's train/eval mode or "
                "torch.autocast around the step): freeze parameters and set modes alike on every replica. "
                "Nothing was computed"
            )
    _check_replicas_delay_alike(agreement, reports, topology, positions, not_delaying)
    first_rank, last_rank = schedule.rank_of(0), schedule.rank_of(schedule.num_stages - 1)
    for pipeline in topology.pipelines:  # every replica's, so that every rank of the job raises
        n_in = reports[topology.world.index(pipeline[first_rank])].input_rows
        n_tgt = reports[topology.world.index(pipeline[last_rank])].target_rows
        if n_tgt >= 0 and n_tgt != n_in:
            raise ValueError(
                f"the target has {n_tgt} rows along dim 0 but the input has {n_in} (pipeline of global ranks "
                f"{list(pipeline)}): every tensor of the input and of the target is split into the same "
                "microbatches along dim 0, except shared ones (one row, or Replicated). Nothing was computed"
            )
    mine_ = [reports[topology.world.index(g)] for g in topology.pipeline]
    rows = mine_[first_rank].input_rows
    # the target's values that are no tensor (and its shapes) are baked into a captured loss, as the input's are
    signature = (forward_only, mine_[first_rank].input_hash, mine_[last_rank].target_hash, rows,
                 *(r.state_hash for r in mine_))
    return StartDecision(rows, signature, graphs_win(reports))


def _check_replicas_delay_alike(agreement: Agreement, reports: Sequence[StartReport], topology: Any,
                                positions: Iterable[int], not_delaying: Callable[[], list[str]]) -> None:
    """Raise on every rank when the replicas of a pipeline rank differ in which delayed-wgrad modules
    defer their weight gradients (``delay_wgrad_compute`` turned off on some replicas only): their
    reducers would launch the buckets in another order and gloo would pair unlike buckets (averaging
    other parameters' gradients, silently) or wait. Every rank names its modules that stopped."""
    lines = {position: [pipeline[position] for pipeline in topology.pipelines] for position in positions}
    unlike = [(position, line) for position, line in lines.items()
              if len({reports[topology.world.index(g)].delaying_hash for g in line}) > 1]
    if not unlike:
        return
    texts = agreement.gather_objects(not_delaying())  # every rank is here: the reports are the same everywhere
    position, line = unlike[0]
    told = "; ".join(f"global rank {g}: {', '.join(texts[topology.world.index(g)]) or 'none'}" for g in line)
    raise ValueError(
        f"the data-parallel replicas of pipeline rank {position} differ in which layers defer their "
        "weight gradients to W (delay_wgrad_compute turned off after the Pipeline was built, on some replicas "
        f"only; layers that no longer defer them: {told}): their reductions would pair unlike gradients. Set "
        "delay_wgrad_compute alike on every replica. Nothing was computed"
    )


def decide_end(agreement: Agreement, record: StepFailure, tasks: Sequence[Action], *, where: str, schedule: str,
               rank: int, kept_grads: bool, broken: str | None,
               roll_back: Callable[[], None]) -> tuple[PipelineError | None, str | None]:
    """Gather every rank's `EndReport` (this rank's from its failure `record` of the step, whose
    program is `tasks`) and decide: None when every rank succeeded; else `roll_back` this rank's step
    and return the error it raises, and why the pipeline is unusable now (`broken`). Raises
    `BrokenJob` (after `roll_back`) when a rank is gone or this rank's communication broke."""
    mine = EndReport(failed=record.error is not None, drained=record.draining, comm_broken=record.comm_error is not None,
                     task=tasks.index(record.task) if record.task in tasks else -1, failed_at_us=int(record.at * 1e6))
    try:
        if record.comm_error is not None:  # a dead peer: no agreement can complete; tell the others
            why = f"{where} could not communicate: {describe_error(record.comm_error)}"
            agreement.mark_broken(why)
            raise BrokenJob(why)
        reports = agreement.gather(mine)
    except BrokenJob:
        roll_back()
        raise
    if not any(r.failed or r.drained or r.comm_broken for r in reports):
        return None, broken
    roll_back()
    error, broken = failed_step_error(agreement, reports, record.report(tasks, where, schedule, rank),
                                      kept_grads=kept_grads, broken=broken)
    if record.error is not None:
        error.__cause__ = record.error
    return error, broken


def failed_step_error(agreement: Agreement, reports: list[EndReport], text: str | None, *, kept_grads: bool,
                      broken: str | None) -> tuple[PipelineError, str | None]:
    """After a failed step: every failing rank's `text` gathered; the error every rank raises, naming
    the first failure (by wall-clock time, with how many failed after it) and the schedule around
    its task; and why the pipeline is unusable now (`broken`, or a send or receive that failed)."""
    texts = agreement.gather_texts(text)
    failed = sorted((r.failed_at_us, i) for i, r in enumerate(reports) if r.failed and texts[i] is not None)
    first, _, around = (texts[failed[0][1]] if failed else "").partition("\n")  # the failing rank's tasks, at the end
    if first and len(failed) > 1:
        first += f" ({len(failed) - 1} more rank(s) failed after it)"
    if any(r.comm_broken for r in reports):
        broken = (
            "this Pipeline is unusable: a send or receive failed during a failed step (a dead peer?), so its "
            f"communicators are in an unknown state. First failure: {first or None}. End the processes and restart"
        )
    kept = "gradients of earlier steps kept" if kept_grads else ".grad set to None, main_grad zeroed"
    msg = (f"step failed on {first or 'a rank whose message did not arrive'}. Every rank of the job raised; "
           f"this rank discarded the step's gradients ({kept})"
           + (f". {broken}" if broken else "; the pipeline is usable")
           + (f"\n{around}" if around else ""))
    return PipelineError(msg), broken
