"""argparse pieces shared by the ``hf-rocketkv`` command line and the benchmark scripts it launches.

Both the CLI (``cli/``) and the benchmarks (``bench/``, whose parsers ``hf-rocketkv bench`` hands its arguments to)
parse command lines that must fail the same way: two lines, the error and where to read the options, exit status 2.
They live here, below both, because the CLI imports the benchmarks: a benchmark importing the CLI would point an
arrow up. Standard library only.
"""

from __future__ import annotations

import argparse
import math


class ShortErrorParser(argparse.ArgumentParser):
    """An ArgumentParser whose errors are two lines and exit status 2 (argparse's default prints the usage too)."""

    def error(self, message: str):  # noqa: D401 - argparse's hook
        self.exit(2, f"{self.prog}: error: {message}\nSee '{self.prog} --help' for the options.\n")


def int_at_least(low: int):
    """argparse type: an integer >= ``low``, with an error that says so."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer >= {low}, got {text!r}") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"must be an integer >= {low}, got {value}")
        return value

    parse.__name__ = f"integer >= {low}"
    return parse


def fraction(text: str) -> float:
    """argparse type: a number in [0, 1] (needle depths)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number in [0, 1], got {text!r}") from None
    if not 0.0 <= value <= 1.0:
        raise argparse.ArgumentTypeError(f"must be a number in [0, 1], got {value}")
    return value


def number_in(low: float, high: float | None, low_open: bool = False):
    """argparse type: a number in ``[low, high]`` (``(low, high]`` with ``low_open``; no upper bound when ``high`` is
    None), with an error that names the range."""
    bounds = f"{'(' if low_open else '['}{low:g}, {'inf)' if high is None else f'{high:g}]'}"

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number in {bounds}, got {text!r}") from None
        outside = value < low or (low_open and value == low) or (high is not None and value > high)
        if not math.isfinite(value) or outside:
            raise argparse.ArgumentTypeError(f"must be a number in {bounds}, got {text}")
        return value

    parse.__name__ = f"number in {bounds}"
    return parse
