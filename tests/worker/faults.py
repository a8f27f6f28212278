"""Faults injected into the engine's tests: a function of a module that fails once, where a step would fail."""

from __future__ import annotations

from types import ModuleType
from typing import Any

import pytest


def fail_once(monkeypatch: pytest.MonkeyPatch, module: ModuleType, name: str) -> None:
    """`module.name` raises RuntimeError("injected") at its next call, then is itself again."""
    real = getattr(module, name)
    calls = 0

    def flaky(*args: Any, **kwargs: Any) -> Any:
        nonlocal calls
        calls += 1
        if calls == 1:
            raise RuntimeError("injected")
        return real(*args, **kwargs)

    monkeypatch.setattr(module, name, flaky)
