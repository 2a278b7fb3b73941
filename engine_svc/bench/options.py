"""Command-line pieces the bench's in-process modes (steps, kernels) share: the `--isa` cap
and the checks that name the option they refuse."""

from __future__ import annotations

import argparse

from engine_svc.bench import machine


def add_isa_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--isa",
        choices=sorted(machine.ISA_CAPS),
        help="hold torch, MKL, oneDNN and our kernels to this vector level (as offline mode)",
    )


def require_positive(
    parser: argparse.ArgumentParser, args: argparse.Namespace, names: list[str]
) -> None:
    """Exits through `parser` naming the first of `names` (attribute names) below 1."""
    for name in names:
        if getattr(args, name) < 1:
            parser.error(f"{_flag(name)} must be at least 1")


def require_ordered(
    parser: argparse.ArgumentParser, args: argparse.Namespace, low: str, high: str
) -> None:
    """Exits through `parser` when option `high` is below option `low` (attribute names)."""
    if getattr(args, high) < getattr(args, low):
        parser.error(f"{_flag(high)} must be at least {_flag(low)}")


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def rerun_capped(args: argparse.Namespace, mode: str) -> None:
    """This mode again in a process held to `args.isa`, unless it already is (or no cap)."""
    machine.apply_isa_cap(args.isa, ["-m", "engine_svc.bench", mode, *args.argv])
