"""The ``zbpp plot`` and ``zbpp trace`` subcommands (parsers are in `zbpp.cli`)."""

from __future__ import annotations

import argparse

from ..schedules import simulate

__all__ = ["plot_command", "trace_command"]


def plot_command(args: argparse.Namespace) -> int:
    """``zbpp plot NAME -p P -m M [costs] -o FILE.svg|png [--measured TRACE.json]``.

    With ``--measured``, draws the run recorded in a trace written by `zbpp.viz.trace.write_trace`
    (NAME, -p and -m must match it; the memory options set the memory model).
    """
    from ..cli import _build_from_args, _costs_memory
    from .figure import plot
    from .trace import measured_result, read_trace

    costs, memory = _costs_memory(args)
    if args.measured:
        records, sched = read_trace(args.measured)
        res = measured_result(records, sched, memory)
        sched = res.schedule
        if (sched.num_ranks, sched.num_microbatches) != (args.ranks, args.microbatches):
            raise ValueError(
                f"--measured {args.measured} holds p={sched.num_ranks}, m={sched.num_microbatches} "
                f"but the command line says -p {args.ranks} -m {args.microbatches}"
            )
        plot(res, path=args.output, title=f"measured {sched.name or args.name}: p={sched.num_ranks}, "
             f"m={sched.num_microbatches}, stages={sched.num_stages}", time_unit="s")
    else:
        sched = _build_from_args(args.name, args, costs, memory)
        res = simulate(sched, costs, memory)
        plot(res, path=args.output)
    print(f"wrote {args.output}: {sched.num_tasks} tasks on {sched.num_ranks} ranks, "
          f"bubble rate {res.bubble_rate:.4f}, peak memory {max(res.peak_memory):.4g}")
    return 0


def trace_command(args: argparse.Namespace) -> int:
    """``zbpp trace NAME -p P -m M [costs] -o FILE.json``: a Perfetto trace of the simulated plan."""
    from ..cli import _build_from_args, _costs_memory
    from .trace import write_trace

    costs, memory = _costs_memory(args)
    sched = _build_from_args(args.name, args, costs, memory)
    res = simulate(sched, costs, memory)
    write_trace(args.output, plan=res, comm=costs.comm)
    print(f"wrote {args.output}: {sched.num_tasks} tasks on {sched.num_ranks} ranks "
          "(open it at https://ui.perfetto.dev or chrome://tracing; 1 cost unit = 1 ms)")
    return 0
