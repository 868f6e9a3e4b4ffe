"""The `zbpp` command.

    zbpp show zb-h1 -p 4 -m 8                   # ASCII timeline and summary
    zbpp show zb-auto -p 8 -m 24 --f 18.5 --b 18.1 --w 9.3 --comm 0.6 --memory-limit 16
    zbpp compare -p 8 -m 24                     # every schedule's bubble rate and peak memory
    zbpp plot zb-v -p 4 -m 8 -o zbv.svg         # figure (needs matplotlib: pip install zbpp[viz])
    zbpp trace zb-h1 -p 4 -m 8 -o sim.json      # Perfetto / chrome://tracing trace of the simulated step
    zbpp measure --hf-config config.json --seq 4096 --dtype bfloat16 --device cuda -o llama3-8b.json
                                                # per-layer profile of a HF causal LM, measured
    zbpp plan --profile llama3-8b.json -p 8 -m 32 --budget-gb 80   # layers and schedule chosen together
    zbpp demo                                   # train a small model on 4 CPU ranks
    zbpp --version

`python -m zbpp ...` works the same. Bad input ends the command with one line on stderr that names
the argument, and exit code 2 (1 when a file cannot be written or read).
"""

from __future__ import annotations

import argparse
import math
import os
import shutil
import sys
import textwrap
from dataclasses import replace
from typing import Any, Callable, Collection, NoReturn, Sequence

from . import __version__
from .demo import MAX_MICROBATCHES as MAX_DEMO_MICROBATCHES, MAX_RANKS as MAX_DEMO_RANKS
from .schedules import Costs, Kind, Memory, available, build, options_of, simulate, validate
from .schedules.planner import MAX_SPLITS
from .schedules.registry import stage_count

__all__ = ["main"]


class _Parser(argparse.ArgumentParser):
    """An ArgumentParser whose errors are one line (the usage is one `--help` away)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _integer(minimum: int, maximum: int | None = None) -> Callable[[str], int]:
    """An argparse type: an integer in minimum..maximum."""
    accepted = f"an integer >= {minimum}" if maximum is None else f"an integer in {minimum}..{maximum}"

    def integer(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = None
        if value is None or value < minimum or (maximum is not None and value > maximum):
            raise argparse.ArgumentTypeError(f"expected {accepted}, got {text!r}")
        return value

    return integer


def _finite(text: str) -> float | None:
    try:
        value = float(text)
    except ValueError:
        return None
    return value if math.isfinite(value) and value >= 0 else None


def _number(text: str) -> float:
    """An argparse type: a finite number >= 0 (no nan, no inf)."""
    value = _finite(text)
    if value is None:
        raise argparse.ArgumentTypeError(f"expected a finite number >= 0, got {text!r}")
    return value


def _gigabytes(unit: str, *, positive: bool = False) -> Callable[[str], float]:
    """An argparse type: GB (or GB/s), a finite number (> 0 if `positive`) of at most 1e299, so that
    its bytes (x 1e9) are finite too: else the planner or the profile met inf (or a bandwidth of
    0) and named its own argument, not the flag."""
    accepted = f"a number {'>' if positive else '>='} 0 and at most 1e299 ({unit})"

    def gigabytes(text: str) -> float:
        value = _finite(text)
        if value is None or value > 1e299 or (positive and value == 0):
            raise argparse.ArgumentTypeError(f"expected {accepted}, got {text!r}")
        return value

    return gigabytes


def _float_list(text: str) -> float | list[float]:
    """'1.5' -> 1.5; '1,2,3' -> [1, 2, 3] (one value per stage); each a finite number >= 0.

    An empty field ('1,,2', '1,2,') is refused: dropped, it shifted every later stage's value
    onto the stage before it."""
    values = [_finite(p) for p in text.split(",")]
    if any(v is None for v in values):
        raise argparse.ArgumentTypeError(
            f"expected a finite number >= 0, or such numbers separated by commas (one per stage), got {text!r}")
    return values[0] if len(values) == 1 else values  # type: ignore[return-value]


def _check_output(path: str, suffixes: tuple[str, ...] = ()) -> None:
    """Refuse an output path that cannot be written (or, given `suffixes`, a name ending in none of
    them), before any work is done: a search or a measurement would otherwise run to be lost."""
    if not path:  # as the current folder, '' passed the checks below and failed only on writing
        raise ValueError("-o '': give a file name")
    if suffixes and os.path.splitext(path)[1].lower() not in suffixes:
        raise ValueError(f"-o {path}: use a {' or '.join(suffixes)} file name")
    folder = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path):
        raise ValueError(f"-o {path}: that is a folder; give a file name")
    if not os.path.isdir(folder):
        raise ValueError(f"-o {path}: the folder {folder} does not exist")


class _Given(argparse.Action):
    """Store the value, and note the option as given (in ``args.given``): flags that some
    combinations ignore are refused there, while their defaults, never typed, pass."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:
        setattr(namespace, self.dest, values)
        namespace.given = getattr(namespace, "given", frozenset()) | {max(self.option_strings, key=len)}


def _given(args: argparse.Namespace, *flags: str) -> list[str]:
    """Those of `flags` the command line gave, in the order listed."""
    given = getattr(args, "given", frozenset())
    return [f for f in flags if f in given]


_COST_FLAGS = ("--f", "--b", "--w", "--comm", "--message-overhead")


def _add_schedule_args(parser: argparse.ArgumentParser, *, with_name: bool = True) -> None:
    if with_name:
        parser.add_argument("name", help=f"schedule name ({', '.join(available())})")
    parser.add_argument("-p", "--ranks", type=_integer(1), required=True, help="pipeline ranks")
    parser.add_argument("-m", "--microbatches", type=_integer(1), required=True, help="microbatches per step")
    parser.add_argument("--chunks", action=_Given, type=_integer(1), default=None,
                        help="stages per rank (interleaved-1f1b, zb-interleaved, zbi-auto)")
    costs = parser.add_argument_group("costs (a number, or one per stage separated by commas)")
    costs.add_argument("--f", action=_Given, type=_float_list, default=1.0, help="forward time (default 1)")
    costs.add_argument("--b", action=_Given, type=_float_list, default=1.0, help="input-gradient time (default 1)")
    costs.add_argument("--w", action=_Given, type=_float_list, default=1.0, help="weight-gradient time (default 1)")
    costs.add_argument("--comm", action=_Given, type=_number, default=0.0,
                       help="time of one message between ranks (default 0)")
    costs.add_argument("--message-overhead", action=_Given, type=_number, default=0.0,
                       help="compute time a rank loses per message it sends or receives (default 0)")
    mem = parser.add_argument_group("memory (per stage and microbatch)")
    mem.add_argument("--activation", type=_float_list, default=1.0, help="memory F allocates (default 1)")
    mem.add_argument("--wgrad", action=_Given, type=_float_list, default=None,
                     help="memory B keeps until W (default: 1/3 of --activation); only for schedules with a separate W")
    mem.add_argument("--memory-limit", action=_Given, type=_number, default=None,
                     help="per-rank memory limit, for the automatic schedules (zb-auto, zbv-auto, zbi-auto); "
                          "compare marks with * the schedules whose peak exceeds it")


def _costs_memory(args: argparse.Namespace) -> tuple[Costs, Memory]:
    costs = Costs(f=args.f, b=args.b, w=args.w, comm=args.comm, message_overhead=args.message_overhead)
    act = args.activation
    if args.wgrad is not None:
        wgrad = args.wgrad
    elif isinstance(act, list):
        wgrad = [a / 3 for a in act]
    else:
        wgrad = act / 3
    return costs, Memory(activation=act, wgrad=wgrad)


_STAGE_FLAGS = ("--f", "--b", "--w", "--activation", "--wgrad")


def _check_stage_lists(name: str, args: argparse.Namespace, opts: dict[str, Any]) -> None:
    """A comma-separated flag has one value per stage of `name`: refuse another count naming the
    flag and the count wanted (`Costs`/`Memory` would name their own fields, not the flag)."""
    stages = stage_count(name, args.ranks, **opts)
    for flag in _STAGE_FLAGS:
        values = getattr(args, flag[2:])
        if isinstance(values, list) and len(values) != stages:
            held = "" if stages == args.ranks else f", {stages // args.ranks} per rank"
            raise ValueError(f"{flag} has {len(values)} values, but {name} on {args.ranks} ranks has {stages} "
                             f"stages{held}: give one number, or {stages} separated by commas (one per stage)")


def _build_from_args(name: str, args: argparse.Namespace, costs: Costs, memory: Memory, *, strict: bool = True):
    """Build `name` from the command line. With `strict`, an option it does not take is an error;
    without (for `compare`), such options apply only to the schedules that take them."""
    opts: dict[str, Any] = {}
    takes = options_of(name)
    if args.chunks is not None and (strict or "chunks" in takes):
        if "chunks" not in takes:
            raise ValueError(f"schedule {name!r} does not take --chunks")
        opts["chunks"] = args.chunks
    _check_stage_lists(name, args, opts)
    if "costs" in takes:
        opts["costs"] = costs
    if "memory" in takes:
        opts["memory"] = memory
    if args.memory_limit is not None and (strict or "memory_limit" in takes):
        if "memory_limit" not in takes:
            raise ValueError(f"schedule {name!r} does not take --memory-limit (only the automatic schedules do)")
        opts["memory_limit"] = args.memory_limit
    return validate(build(name, num_ranks=args.ranks, num_microbatches=args.microbatches, **opts))


def _check_wgrad(args: argparse.Namespace, sched) -> None:
    """--wgrad is memory B keeps until its W: refused for a schedule that has no separate W (its
    full backward BW frees all at once), where it would be silently ignored."""
    if _given(args, "--wgrad") and not any(a.kind is Kind.W for _, a in sched.actions()):
        raise ValueError(f"--wgrad is memory B keeps until W, and {sched.name or 'this schedule'} has no separate W "
                         "(its full backward frees the activation at once); drop --wgrad")


def _gap_to_bound(res, costs: Costs, memory: Memory, memory_limit: float | None) -> str:
    """How far an automatic schedule is from `zbpp.schedules.bounds.lower_bound` at its limit."""
    from .schedules.bounds import lower_bound
    from .schedules.generators.auto import default_memory_limit

    sched = res.schedule
    limit = memory_limit if memory_limit is not None else default_memory_limit(sched.placement, memory)
    lb = lower_bound(sched.placement, sched.num_microbatches, costs, memory, limit)
    def gap(value: float, bound: float) -> str:  # the bound never exceeds the value but by rounding
        return f"+{max(0.0, 100 * (value / bound - 1)) if bound > 0 else 0.0:.2f}%"

    return (f"longest span >= {lb.cost:.6g} (this one {gap(res.cost, lb.cost)}), "
            f"makespan >= {lb.makespan:.6g} ({gap(res.makespan, lb.makespan)}), bubble rate >= {lb.bubble_rate:.4f}")


def _cmd_show(args: argparse.Namespace) -> int:
    from .viz.ascii import legend, render_ascii

    costs, memory = _costs_memory(args)
    sched = _build_from_args(args.name, args, costs, memory)
    _check_wgrad(args, sched)
    res = simulate(sched, costs, memory)
    width = args.width or shutil.get_terminal_size((120, 24)).columns
    print(render_ascii(res, width=width))
    for line in legend().splitlines():  # 85 columns: wrapped as the timeline is
        print(textwrap.fill(line, width=max(40, width), subsequent_indent="  "))
    print()
    print(f"schedule     {sched.name}  (ranks={sched.num_ranks}, stages={sched.num_stages}, microbatches={sched.num_microbatches})")
    print(f"bubble rate  {res.bubble_rate:.4f}")
    print(f"makespan     {res.makespan:g}   longest rank span {res.cost:g}   busiest rank {res.busy:g}")
    peaks = "  ".join(f"r{r}={v:.4g}" for r, v in enumerate(res.peak_memory))
    print(textwrap.fill(peaks, width=max(40, width), initial_indent="peak memory  ", subsequent_indent=" " * 13))
    if "memory_limit" in options_of(sched.name):  # an automatic schedule: how far from the best possible
        print(textwrap.fill(_gap_to_bound(res, costs, memory, args.memory_limit), width=max(40, width),
                            initial_indent="lower bound  ", subsequent_indent=" " * 13))
    return 0


def _over_limit(peaks: list[float], limit: float | None) -> bool:
    """Whether a rank's simulated peak exceeds `limit` (None: no limit); equal within float
    rounding of the summed memory fits, as `zbpp.schedules.select` counts it."""
    return limit is not None and max(peaks, default=0.0) > limit * (1 + 1e-9)


def _cmd_compare(args: argparse.Namespace) -> int:
    costs, memory = _costs_memory(args)
    # Schedules with more stages than ranks (interleaved, V) cut the same model finer: given one
    # number per quantity, each of their stages gets ranks/stages of it (comm is per message).
    scalars = all(isinstance(v, float) for v in (args.f, args.b, args.w, args.activation, memory.wgrad))
    rows, scaled = [], []
    for name in available():
        try:
            c, mem = costs, memory
            chunks = {"chunks": args.chunks} if args.chunks is not None and "chunks" in options_of(name) else {}
            stages = stage_count(name, args.ranks, **chunks)  # counted: building would run an auto search
            if scalars and stages > args.ranks:
                k = args.ranks / stages
                c = replace(costs, f=costs.f * k, b=costs.b * k, w=costs.w * k)
                mem = Memory(activation=memory.activation * k, wgrad=memory.wgrad * k)
            sched = _build_from_args(name, args, c, mem, strict=False)
            res = simulate(sched, c, mem)
        except ValueError as exc:  # e.g. a memory limit an auto schedule cannot meet, per-stage costs of p stages
            rows.append((name, None, str(exc)))
            continue
        if c is not costs:
            scaled.append(name)
        rows.append((name, res, ""))
    if all(res is None for _, res, _ in rows):
        raise ValueError(f"no schedule accepts these arguments; {rows[0][0]}: {rows[0][2]}")
    print(f"ranks={args.ranks} microbatches={args.microbatches} f={args.f} b={args.b} w={args.w} comm={args.comm}")
    over: list[str] = []  # schedules whose simulated peak exceeds --memory-limit, marked with *
    print(f"{'schedule':<18} {'stages':>6} {'bubble':>8} {'span':>10} {'peak memory (max)':>18}  peak memory per rank")
    for name, res, err in rows:
        if res is None:
            print(f"{name:<18} {'-':>6} {'-':>8} {'-':>10} {'-':>18}  {err}")
            continue
        peaks = " ".join(f"{v:.3g}" for v in res.peak_memory)
        mark = "*" if _over_limit(res.peak_memory, args.memory_limit) else " "
        if mark == "*":
            over.append(name)
        print(f"{name:<18} {res.schedule.num_stages:>6} {res.bubble_rate:>8.4f} {res.cost:>10.4g} "
              f"{max(res.peak_memory):>17.4g}{mark}  {peaks}")
    print("bubble = (longest rank span - busiest rank's work) / longest rank span")
    if over:
        print(f"* peak memory above --memory-limit={args.memory_limit:g} ({', '.join(over)}): only the automatic "
              "schedules take the limit; the fixed ones are listed as they run")
    for name, res, _ in rows:  # automatic schedules: how far from the best possible at their limit
        if res is not None and "memory_limit" in options_of(name):
            c, mem = costs, memory
            if res.schedule.num_stages > args.ranks and scalars:
                k = args.ranks / res.schedule.num_stages
                c = replace(costs, f=costs.f * k, b=costs.b * k, w=costs.w * k)
                mem = Memory(activation=memory.activation * k, wgrad=memory.wgrad * k)
            print(f"lower bound for {name}: {_gap_to_bound(res, c, mem, args.memory_limit)}")
    if scaled:
        print(f"{', '.join(scaled)}: more stages than ranks, so each stage's costs and memory are ranks/stages "
              "of the given ones (the same model cut finer; comm and message overhead unchanged)")
    return 0


def _ran_as(built, res) -> bool:
    """Whether the measured `res` ran `built`'s task order: each rank the same tasks, in the order of
    their (start, end). Tasks of one instant (zero-length ones, at the clock's resolution) may come
    in either order: the records cannot tell which ran first."""
    for order, ran in zip(built.orders, res.schedule.orders):
        if sorted(order) != sorted(ran):
            return False
        times = [(res.start[a], res.end[a]) for a in order]
        if any(x > y for x, y in zip(times, times[1:])):
            return False
    return True


def _measured_name(args: argparse.Namespace, res, costs: Costs, memory: Memory):
    """NAME checked against the schedule of the ``--measured`` trace (`res`): it must be the name
    the trace recorded or, where it recorded none, build the same task order at -p/-m (and the
    options given). The times drawn are the trace's: cost flags given are refused unless they build
    that order (an automatic NAME, checked against a trace that records no name). Returns the name
    and the schedule to draw: NAME's where it was built, whose order holds where records tie."""
    sched = res.schedule
    recorded = "" if sched.name in ("", "measured") else sched.name  # "measured": read off the records
    # the recorded name is checked first: it may be no registered schedule's (e.g. from_torch_csv's)
    if args.name not in available() and args.name != recorded:
        raise ValueError(f"unknown schedule NAME {args.name!r}; choose from {', '.join(available())}")
    if recorded:
        if args.name != recorded:
            raise ValueError(f"NAME {args.name!r} contradicts --measured {args.measured}, which recorded schedule "
                             f"{recorded!r}; give NAME {recorded}")
        unused = _given(args, *_COST_FLAGS, "--memory-limit")
        if unused:
            raise ValueError(f"{', '.join(unused)}: --measured {args.measured} records its times and its schedule "
                             f"({recorded}), so there is nothing for them to set; drop them")
        if args.chunks is not None and args.chunks * sched.num_ranks != sched.num_stages:
            raise ValueError(f"--chunks {args.chunks} contradicts --measured {args.measured}, whose {recorded} has "
                             f"{sched.num_stages} stages on {sched.num_ranks} ranks")
        return recorded, sched
    unused = _given(args, *_COST_FLAGS)
    if unused and "costs" not in options_of(args.name):
        raise ValueError(f"{', '.join(unused)}: the times drawn are those of --measured {args.measured}, and "
                         f"{args.name} does not take costs to build its order; drop them")
    # An unnamed trace (records only, or a custom schedule): NAME must reproduce what ran, else the
    # figure's title would name a schedule the trace never ran.
    try:
        built = _build_from_args(args.name, args, costs, memory)
    except ValueError as exc:
        raise ValueError(f"NAME {args.name!r}: cannot build it to check against --measured {args.measured} "
                         f"(which records no schedule name): {exc}") from None
    if built.placement != sched.placement or not _ran_as(built, res):
        rank = next((r for r in range(sched.num_ranks) if built.orders[r] != sched.orders[r]), 0)
        # shown from the first task that differs: the first few may well agree
        i = next((i for i, (a, b) in enumerate(zip(sched.orders[rank], built.orders[rank])) if a != b), 0)
        at = f" from its task {i} on" if i else ""
        raise ValueError(
            f"NAME {args.name!r} is not the schedule in --measured {args.measured} (which records no schedule "
            f"name): the task order differs, e.g. rank {rank} ran{at} {' '.join(map(str, sched.orders[rank][i:i + 6]))}"
            f" ... where {args.name} runs {' '.join(map(str, built.orders[rank][i:i + 6]))} ...")
    return args.name, built


def _cmd_plot(args: argparse.Namespace) -> int:
    """``zbpp plot``: a figure of the simulated schedule, or with ``--measured`` of the run recorded
    in a trace written by `zbpp.viz.trace.write_trace` (NAME, -p and -m must match it)."""
    _check_output(args.output, (".svg", ".png"))
    from .viz.figure import _require_matplotlib, plot
    from .viz.trace import measured_result, read_trace

    try:
        _require_matplotlib()
    except ImportError as exc:  # before any work, in one line as every other error
        print(f"zbpp plot: error: {exc}", file=sys.stderr)
        return 1

    costs, memory = _costs_memory(args)
    if args.measured:
        try:
            records, sched = read_trace(args.measured)
        except OSError as exc:
            raise OSError(f"--measured {args.measured}: cannot read it ({exc.strerror})") from None
        except ValueError as exc:  # its message starts with the path
            raise ValueError(f"--measured {exc}") from None
        try:
            res = measured_result(records, sched, memory)
        except ValueError as exc:
            raise ValueError(f"--measured {args.measured}: {exc}") from None
        sched = res.schedule
        if (sched.num_ranks, sched.num_microbatches) != (args.ranks, args.microbatches):
            raise ValueError(
                f"--measured {args.measured} holds p={sched.num_ranks}, m={sched.num_microbatches} "
                f"but the command line says -p {args.ranks} -m {args.microbatches}"
            )
        name, ran = _measured_name(args, res, costs, memory)
        if ran is not sched:  # NAME's order, where records of one instant left it open
            res = measured_result(records, ran, memory)
            sched = res.schedule
        _check_wgrad(args, sched)
        plot(res, path=args.output, title=f"measured {name}: p={sched.num_ranks}, "
             f"m={sched.num_microbatches}, stages={sched.num_stages}", time_unit="s")
    else:
        sched = _build_from_args(args.name, args, costs, memory)
        _check_wgrad(args, sched)
        res = simulate(sched, costs, memory)
        plot(res, path=args.output)
    print(f"wrote {args.output}: {sched.num_tasks} tasks on {sched.num_ranks} ranks, "
          f"bubble rate {res.bubble_rate:.4f}, peak memory {max(res.peak_memory):.4g}")
    return 0


def _cmd_trace(args: argparse.Namespace) -> int:
    """``zbpp trace``: a Perfetto trace of the simulated step."""
    _check_output(args.output)
    from .viz.trace import write_trace

    costs, memory = _costs_memory(args)
    sched = _build_from_args(args.name, args, costs, memory)
    _check_wgrad(args, sched)
    res = simulate(sched, costs, memory)
    write_trace(args.output, simulated=res, comm=costs.comm)
    print(f"wrote {args.output}: {sched.num_tasks} tasks on {sched.num_ranks} ranks "
          "(open it at https://ui.perfetto.dev or chrome://tracing; 1 cost unit = 1 ms)")
    return 0


def _names(flag: str, text: str | None, known: Collection[str]) -> list[str] | None:
    """A comma-separated list of names, each one of `known`; None where the flag was not given. One
    naming nothing ('' or ',') is refused: it read as not given (every name) or ended in a message
    about layers; an unknown name is refused naming the flag (the planner's error names none)."""
    if text is None:
        return None
    names = [x.strip() for x in text.split(",") if x.strip()]
    if not names:
        raise ValueError(f"{flag} {text!r} names nothing: give comma-separated names, or drop {flag} for all")
    unknown = [x for x in names if x not in known]
    if unknown:
        raise ValueError(f"{flag} {text!r}: {', '.join(map(repr, unknown))} not known; the choices are "
                         f"{', '.join(known)}")
    return names


def _cmd_plan(args: argparse.Namespace) -> int:
    """``zbpp plan``: each stage's layers and the schedule, chosen together within a memory budget."""
    from .schedules.planner import SCHEDULES, search
    from .schedules.profile import POLICIES, Profile

    try:
        profile = Profile.load(args.profile)
    except OSError as exc:
        raise ValueError(f"--profile {args.profile}: cannot read it ({exc.strerror})") from None
    schedules = _names("--schedules", args.schedules, SCHEDULES)
    budget = None if args.budget_gb is None else args.budget_gb * 1e9
    policies = _names("--policies", args.policies, POLICIES)
    host_memory = None if args.host_memory_gb is None else args.host_memory_gb * 1e9
    host_flags = _given(args, "--ranks-per-node", "--host-memory-gb")
    if host_flags:  # they size offload's host link and memory: refused where offload is never chosen
        if "offload" not in (policies if policies is not None else profile.offers()):
            raise ValueError(f"{', '.join(host_flags)} set the host side of offload, which "
                             f"{'--policies ' + args.policies if policies is not None else 'the profile'} "
                             "does not offer: add offload to --policies or drop them")
        if budget is None and "none" in (policies if policies is not None else profile.offers()):
            raise ValueError(f"{', '.join(host_flags)} set the host side of offload, but without --budget-gb no "
                             "stage needs a policy (the plan keeps every activation): give --budget-gb or drop them")
    # said before the search, which takes seconds on a large profile: the user sees what runs
    print(f"profile {profile.name or args.profile}: {len(profile)} layers; ranks={args.ranks} "
          f"microbatches={args.microbatches} budget={'none' if budget is None else f'{args.budget_gb:g} GB'} per rank",
          flush=True)
    plan = search(profile, args.ranks, args.microbatches, budget, schedules=schedules, max_splits=args.max_splits,
                  policies=policies, ranks_per_node=args.ranks_per_node, host_memory=host_memory)
    print(plan.explain(top=args.top))
    print("stages (layer index ranges):", ", ".join(f"{r.start}-{r.stop - 1}" for r in plan.stages))
    if plan.policies:
        print("policies (per stage):", ", ".join(plan.policies))
    return 0


def _cmd_measure(args: argparse.Namespace) -> int:
    """``zbpp measure``: a HF causal LM's per-layer profile, measured on one device, for ``zbpp plan``."""
    _check_output(args.output)
    import torch
    import transformers

    from .models import measure_causal_lm

    found = args.hf_config if os.path.isfile(args.hf_config) else os.path.join(args.hf_config, "config.json")
    if not os.path.isfile(found):  # else transformers takes the path for a Hub repo id: network retries, then a traceback
        raise ValueError(f"--hf-config {args.hf_config}: no such file, nor a folder holding config.json")
    try:
        config = transformers.AutoConfig.from_pretrained(args.hf_config)
    except OSError as exc:
        raise ValueError(f"--hf-config {args.hf_config}: cannot read a transformers config there ({exc})") from None
    dtype = getattr(torch, args.dtype, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"--dtype {args.dtype!r} is not a torch dtype (float32, bfloat16, float16, ...)")
    try:  # checked before the model is built: else a traceback from torch's first allocation there
        device = torch.device(args.device)
    except RuntimeError:
        raise ValueError(f"--device {args.device!r} is not a torch device (cpu, cuda, cuda:1, ...)") from None
    backend = getattr(torch, device.type, None) if device.type != "cpu" else None
    if backend is not None and callable(getattr(backend, "is_available", None)) and not backend.is_available():
        raise ValueError(f"--device {args.device}: this machine has no {device.type} device (torch.{device.type}."
                         "is_available() is False)")
    policies = [x.strip() for x in args.policies.split(",") if x.strip()]
    if args.host_gb_per_s is not None and "offload" not in policies:  # checked before the model is built
        raise ValueError(f"--host-gb-per-s is the host link of offload's copies, and --policies {args.policies} "
                         "does not measure offload: add offload to --policies or drop --host-gb-per-s")
    host = None if args.host_gb_per_s is None else args.host_gb_per_s * 1e9
    try:
        profile = measure_causal_lm(config, seq=args.seq, micro_batch=args.micro_batch,
                                    measured_blocks=args.measured_blocks, dtype=dtype, device=args.device,
                                    attn_implementation=args.attn, link_bytes_per_s=args.link_gb_per_s * 1e9,
                                    steps=args.steps, warmup=args.warmup, optimizer_bytes_per_param=args.optimizer_bytes,
                                    policies=policies, host_bytes_per_s=host)
    except ImportError as exc:  # a package the model needs is not installed (flash-attn for flash_attention_2)
        flag = f"--attn {args.attn}: " if args.attn is not None else ""
        raise ValueError(f"{flag}{str(exc).splitlines()[0] if str(exc) else type(exc).__name__}") from None
    profile.save(args.output)
    print(f"wrote {args.output}: {len(profile)} layers of {profile.name} measured on {profile.notes['measured_on']}")
    if profile.host_bytes_per_s:
        print(f"host link: {profile.host_bytes_per_s / 1e9:.2f} GB/s per direction ({profile.notes['host_link']})")
    print(f"{'layer':<28} {'policy':<10} {'F ms':>9} {'B ms':>9} {'W ms':>9} {'F->B MB':>9} {'B->W MB':>9} "
          f"{'copy MB':>9} {'copy ms':>9} {'static MB':>10}")
    for x in profile.layers:
        rows = [("none", x.b, x.activation, x.wgrad, 0.0)]
        rows += [(q, x.b + c.recompute, c.activation, c.wgrad, c.copy) for q, c in x.policies]
        for i, (q, b, act, wgrad, copy) in enumerate(rows):
            copy_ms = f"{copy / profile.host_bytes_per_s * 1e3:9.3f}" if copy else f"{'-':>9}"
            name, f, w, static = (x.name, f"{x.f * 1e3:9.3f}", f"{x.w * 1e3:9.3f}", f"{x.static / 1e6:10.2f}") if i == 0 \
                else ("", f"{'':>9}", f"{'':>9}", f"{'':>10}")
            print(f"{name:<28} {q:<10} {f} {b * 1e3:9.3f} {w} {act / 1e6:9.2f} {wgrad / 1e6:9.2f} "
                  f"{copy / 1e6 if copy else 0:9.2f} {copy_ms} {static}")
    for x in profile.shared:  # in each of its layers' static MB above, once on a rank holding several
        print(f"shared: {x.name} ({x.static / 1e6:.2f} MB static) by layers "
              f"{', '.join(profile.layers[i].name for i in x.layers)}: counted once per rank")
    return 0


def _cmd_demo(args: argparse.Namespace) -> int:
    from .demo import run_demo

    return run_demo(args)


def make_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="zbpp", description="Zero-bubble pipeline parallelism for PyTorch.")
    parser.add_argument("--version", action="version", version=f"zbpp {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    show = sub.add_parser("show", help="print a schedule as an ASCII timeline with its bubble rate and memory")
    _add_schedule_args(show)
    show.add_argument("--width", type=_integer(1), default=None, help="wrap at this many columns (default: terminal)")
    show.set_defaults(func=_cmd_show)

    compare = sub.add_parser("compare", help="bubble rate and peak memory of every schedule")
    _add_schedule_args(compare, with_name=False)
    compare.set_defaults(func=_cmd_compare)

    plot = sub.add_parser("plot", help="draw a schedule (or a measured run) to an SVG or PNG file")
    _add_schedule_args(plot)
    plot.add_argument("-o", "--output", required=True, help="FILE.svg or FILE.png")
    plot.add_argument("--measured", default=None,
                      help="a trace JSON written by Pipeline(record_task_times=True) to draw instead; NAME, -p and "
                           "-m must be the schedule it recorded; its times are drawn, so the cost flags are refused "
                           "but to build an automatic NAME to check a trace that records no name")
    plot.set_defaults(func=_cmd_plot)

    trace = sub.add_parser("trace", help="write a Perfetto/Chrome trace of the simulated schedule")
    _add_schedule_args(trace)
    trace.add_argument("-o", "--output", required=True, help="FILE.json")
    trace.set_defaults(func=_cmd_trace)

    plan = sub.add_parser("plan", help="choose each stage's layers and the schedule for a per-layer profile")
    plan.add_argument("--profile", required=True, help="a per-layer profile (JSON, as zbpp.schedules.profile.Profile.save writes)")
    plan.add_argument("-p", "--ranks", type=_integer(1), required=True, help="pipeline ranks")
    plan.add_argument("-m", "--microbatches", type=_integer(1), required=True, help="microbatches per step")
    plan.add_argument("--budget-gb", type=_gigabytes("GB"), default=None,
                      help="memory per rank in GB (1e9 bytes): static (parameters, gradients, optimizer) and activations")
    plan.add_argument("--schedules", default=None, help="comma-separated schedule families to try (default: all)")
    plan.add_argument("--top", type=_integer(1), default=12, help="candidates to list (default 12)")
    plan.add_argument("--max-splits", type=_integer(0), default=MAX_SPLITS,
                      help=f"try every split of a placement with at most this many (exact; default {MAX_SPLITS}); "
                           "beyond, heuristic splits, refined")
    plan.add_argument("--policies", default=None,
                      help="comma-separated activation policies a stage may use (none, full, selective, offload; "
                           "default: every one the profile's layers offer)")
    plan.add_argument("--ranks-per-node", action=_Given, type=_integer(1), default=1,
                      help="ranks of a node sharing its host link and host memory, all offloading at once: each gets "
                           "the profile's host bandwidth / this (default 1: a link of its own); only where offload "
                           "may be chosen (--budget-gb given, offload among the policies)")
    plan.add_argument("--host-memory-gb", action=_Given, type=_gigabytes("GB"), default=None,
                      help="pinned host memory per node for offloaded activations, GB (default: not limited); only "
                           "where offload may be chosen")
    plan.set_defaults(func=_cmd_plan)

    measure = sub.add_parser("measure", help="measure a Hugging Face causal LM's per-layer profile (for zbpp plan)")
    measure.add_argument("--hf-config", required=True, help="a transformers config.json (or a folder holding one)")
    measure.add_argument("--seq", type=_integer(1), required=True, help="tokens per sequence")
    measure.add_argument("--micro-batch", type=_integer(1), default=1, help="sequences per microbatch (default 1)")
    measure.add_argument("--measured-blocks", type=_integer(1), default=None,
                         help="build only this many blocks and repeat each kind (dense, MoE, sliding, ...) to the "
                              "config's count; every kind must be among the first N (default: all)")
    measure.add_argument("--dtype", default="float32", help="parameter dtype (default float32)")
    measure.add_argument("--device", default="cpu", help="where to measure (default cpu; cuda for a GPU)")
    measure.add_argument("--attn", default=None, help="attn_implementation: eager, sdpa, ... (default: the config's)")
    measure.add_argument("--steps", type=_integer(1), default=3, help="timed steps per layer, median kept (default 3)")
    measure.add_argument("--warmup", type=_integer(0), default=1, help="untimed steps first (default 1)")
    measure.add_argument("--optimizer-bytes", type=_number, default=None,
                         help="optimizer state per parameter in bytes (default: AdamW's for --dtype: 8 for float32 "
                              "and 16 for float64, its two moments; 12 for bfloat16/float16, an fp32 master weight "
                              "and two fp32 moments)")
    measure.add_argument("--link-gb-per-s", type=_gigabytes("GB/s", positive=True), default=50.0,
                         help="bandwidth between ranks in GB/s, for the message time (default 50)")
    measure.add_argument("--policies", default="none,full,selective,offload",
                         help="activation policies to measure per block (B time, bytes kept F->B and B->W, bytes "
                              "copied; default all: none,full,selective,offload; 'none' for none)")
    measure.add_argument("--host-gb-per-s", type=_gigabytes("GB/s", positive=True), default=None,
                         help="host link bandwidth per direction for offload (default: measured once, pinned copies); "
                              "only with offload among --policies")
    measure.add_argument("-o", "--output", required=True, help="the profile, FILE.json")
    measure.set_defaults(func=_cmd_measure)

    demo = sub.add_parser("demo", help="train a small model with a zero-bubble schedule on CPU ranks")
    demo.add_argument("--schedule", default="zb-v", help="schedule name (default zb-v)")
    demo.add_argument("--ranks", type=_integer(1, MAX_DEMO_RANKS), default=4,
                      help=f"pipeline ranks to spawn, one CPU process each (default 4, at most {MAX_DEMO_RANKS})")
    demo.add_argument("--microbatches", type=_integer(1, MAX_DEMO_MICROBATCHES), default=8,
                      help=f"microbatches per step (default 8, at most {MAX_DEMO_MICROBATCHES})")
    demo.add_argument("--steps", type=_integer(1), default=5, help="training steps (default 5)")
    demo.add_argument("--seed", type=_integer(0, 2**32 - 1), default=0, help="random seed (default 0)")
    demo.set_defaults(func=_cmd_demo)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = make_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # --help, --version, or a bad argument (one line already printed)
        return exc.code if isinstance(exc.code, int) else 2
    try:
        return int(args.func(args) or 0)
    except ValueError as exc:  # bad input: say what is wrong, no traceback
        print(f"zbpp {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:  # a file that cannot be written or read
        print(f"zbpp {args.command}: error: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
