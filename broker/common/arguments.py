"""Command-line argument types and environment-variable defaults shared by the daemons and the tools."""

from __future__ import annotations

import argparse
import os
import re
from collections.abc import Callable


def env(name: str, default: str | None) -> str | None:
    """The variable's value; unset or empty: `default`."""
    value = os.environ.get(name)
    return default if value is None or value == "" else value


def from_env(name: str, default: object) -> str | None:
    """A flag's default: the variable's value (unset or empty: `default`), as a string, so that argparse checks it
    with the flag's type as it checks a value given on the command line (None stays None: the flag is off)."""
    return env(name, None if default is None else str(default))


C_INT_MAX = 2**31 - 1  # what a socket option or a C library's int takes


def positive_int(value: str) -> int:
    n = int(value)
    if not 1 <= n <= C_INT_MAX:
        raise argparse.ArgumentTypeError(f"must be >= 1 and <= {C_INT_MAX}, got {n}")
    return n


def one_of(*choices: str) -> Callable[[str], str]:
    """Argument type: one of `choices` (argparse checks `choices` for given values only, not for a default from an
    environment variable)."""
    def check(value: str) -> str:
        if value not in choices:
            raise argparse.ArgumentTypeError(f"expected one of {', '.join(choices)}, got {value!r}")
        return value
    return check


def non_negative_int(value: str) -> int:
    n = int(value)
    if not 0 <= n <= C_INT_MAX:
        raise argparse.ArgumentTypeError(f"must be >= 0 and <= {C_INT_MAX}, got {n}")
    return n


def positive_float(value: str) -> float:
    """> 0; infinity allowed (no limit)."""
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
