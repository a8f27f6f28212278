"""Command-line argument types and environment-variable defaults shared by the daemons and the tools."""

from __future__ import annotations

import argparse
import os
import re
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


_TCP_ADDRESS = re.compile(r"tcp://(\[[0-9A-Fa-f:.]+\]|[^\s:/\[\]]+):(\d{1,5})")
_HOST_PORT = re.compile(r"[^\s:/\[\]]+:\d{1,5}")


def address_problem(value: str) -> str | None:
    """What is wrong with a ZeroMQ address (None: nothing): tcp://HOST:PORT, HOST a name, an IPv4 or [IPv6] address
    (or, to bind, * or an interface name), or ipc://PATH."""
    if value.startswith("ipc://") and len(value) > len("ipc://"):
        return None
    match = _TCP_ADDRESS.fullmatch(value)
    if match is not None and 1 <= int(match[2]) <= 65535:
        return None
    hint = f" (did you mean tcp://{value}?)" if _HOST_PORT.fullmatch(value) else ""
    return f"expected tcp://HOST:PORT (PORT 1-65535) or ipc://PATH, got {value!r}{hint}"


def zmq_address(value: str) -> str:
    """Argument type: a ZeroMQ address, checked before anything starts (see address_problem)."""
    problem = address_problem(value)
    if problem is not None:
        raise argparse.ArgumentTypeError(problem)
    return value
