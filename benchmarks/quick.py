"""``--quick``, the same in every benchmark: a smoke run's sizes fill in only what the command line
left out, so ``--quick --rounds 5`` runs 5 rounds of the tiny model (an option given explicitly always
wins, even when its value equals the option's default).

    args = ap.parse_args(argv)
    apply_quick(ap, args, argv, hidden=64, rounds=1)   # with args.quick: each not given -> this value
"""

from __future__ import annotations

import argparse
from typing import Any, Sequence

__all__ = ["apply_quick", "given"]

_UNSET = object()


def given(parser: argparse.ArgumentParser, argv: Sequence[str] | None) -> set[str]:
    """The destinations of the options that `argv` (None: ``sys.argv[1:]``, as argparse reads it) gives
    explicitly, whatever their values; `argv` must already parse (call after ``parser.parse_args``)."""
    # argparse fills in a default only where the namespace lacks the attribute: a sentinel that
    # survives the parse marks an option the command line did not give (a value == default does not).
    probe = argparse.Namespace(**{a.dest: _UNSET for a in parser._actions if a.dest != argparse.SUPPRESS})
    parser.parse_args(argv, probe)
    return {dest for dest, value in vars(probe).items() if value is not _UNSET}


def apply_quick(parser: argparse.ArgumentParser, args: argparse.Namespace, argv: Sequence[str] | None,
                **smoke: Any) -> set[str]:
    """With ``args.quick``, set each ``dest=value`` of `smoke` on `args` unless `argv` gave that option;
    return the destinations set. Without ``--quick``, change nothing. A `smoke` key that names no option of
    `parser` is a programming error (ValueError), so a renamed flag cannot silently escape --quick."""
    dests = {a.dest for a in parser._actions}
    unknown = sorted(set(smoke) - dests)
    if unknown:
        raise ValueError(f"apply_quick: {unknown} name no option of this parser")
    if not args.quick:
        return set()
    explicit = given(parser, argv)
    applied = set()
    for dest, value in smoke.items():
        if dest not in explicit:
            setattr(args, dest, value)
            applied.add(dest)
    return applied
