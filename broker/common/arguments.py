"""Command-line argument types and environment-variable defaults shared by the daemons and the tools."""

from __future__ import annotations

import argparse
import os
from typing import TypeVar

D = TypeVar("D", int, None)


def env(name: str, default: str | None) -> str | None:
    """The variable's value; unset or empty: `default`."""
    value = os.environ.get(name)
    return default if value is None or value == "" else value


def env_int(prog: str, name: str, default: D) -> int | D:
    """The variable as an integer (unset or empty: `default`); not an integer: exit naming `prog` and the variable."""
    value = env(name, None)
    if value is None:
        return default
    try:
        return int(value)
    except ValueError:
        raise SystemExit(f"{prog}: {name}={value!r} is not an integer") from None


def positive_int(value: str) -> int:
    n = int(value)
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {n}")
    return n


def non_negative_int(value: str) -> int:
    n = int(value)
    if n < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {n}")
    return n


def positive_float(value: str) -> float:
    x = float(value)
    if not x > 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {value}")
    return x


def non_negative_float(value: str) -> float:
    """Finite and >= 0."""
    x = float(value)
    if not x >= 0 or x == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0, got {value}")
    return x


def port(value: str) -> int:
    n = int(value)
    if not 0 <= n <= 65535:
        raise argparse.ArgumentTypeError(f"must be a port number (0-65535), got {n}")
    return n
