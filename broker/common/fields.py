"""Field checks for typed wire messages: the validation behind broker.common.protocol's `Annotated` fields.

A check takes (field name, value) and returns the normalised value (lists become tuples, ints in a
float field become floats) or raises FieldError naming the field. `validate` runs every check of a
dataclass instance; `build` makes one from a decoded map. Generic: nothing here knows the protocol.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import MISSING, fields
from enum import Enum
from typing import Any, TypeVar, get_type_hints


class FieldError(ValueError):
    """A field is missing or holds a value of the wrong type or range; the message names the field."""


Check = Callable[[str, Any], Any]
_INTS = frozenset({int})  # exact type: bool (an int subclass) and int subclasses take the slow path
_SCALARS = frozenset({int, float, str, bytes, bool, type(None)})  # msgpack takes these as they are


def text(max_chars: int = 256, pattern: str | None = None, optional: bool = False) -> Check:
    compiled = re.compile(pattern) if pattern else None

    def check(name: str, value: Any) -> Any:
        if value is None and optional:
            return None
        if not isinstance(value, str):
            raise FieldError(f"{name} must be a string, got {type(value).__name__}")
        if len(value) > max_chars:
            raise FieldError(f"{name} is longer than {max_chars} characters")
        if compiled is not None and not compiled.fullmatch(value):
            raise FieldError(f"{name} is malformed: {value[:80]!r}")
        return value

    return check


def clipped_text(max_chars: int) -> Check:
    """A string cut to `max_chars` rather than refused: for human-readable messages that quote bad input."""

    def check(name: str, value: Any) -> Any:
        if not isinstance(value, str):
            raise FieldError(f"{name} must be a string, got {type(value).__name__}")
        return value[:max_chars]

    return check


def integer(lo: int, hi: int, optional: bool = False) -> Check:
    def check(name: str, value: Any) -> Any:
        if value is None and optional:
            return None
        if isinstance(value, bool) or not isinstance(value, int):
            raise FieldError(f"{name} must be an integer, got {type(value).__name__}")
        if not lo <= value <= hi:
            raise FieldError(f"{name} must be in [{lo}, {hi}], got {value}")
        return value

    return check


def number(lo: float, hi: float, optional: bool = False) -> Check:
    def check(name: str, value: Any) -> Any:
        if value is None and optional:
            return None
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise FieldError(f"{name} must be a number, got {type(value).__name__}")
        if not math.isfinite(value) or not lo <= value <= hi:
            raise FieldError(f"{name} must be in [{lo}, {hi}], got {value}")
        return float(value)

    return check


def scalar(max_chars: int) -> Check:
    """None, a boolean, a finite number or a string of at most `max_chars` characters."""
    def check(name: str, value: Any) -> Any:
        if value is None or isinstance(value, bool):
            return value
        if isinstance(value, (int, float)):
            if isinstance(value, float) and not math.isfinite(value):
                raise FieldError(f"{name} must be finite, got {value}")
            if isinstance(value, int) and not -(2**63) <= value < 2**63:
                raise FieldError(f"{name} is out of range")
            return value
        if isinstance(value, str):
            if len(value) > max_chars:
                raise FieldError(f"{name} is longer than {max_chars} characters")
            return value
        raise FieldError(f"{name} must be null, a boolean, a number or a string, got {type(value).__name__}")

    return check


def boolean(name: str, value: Any) -> Any:
    if not isinstance(value, bool):
        raise FieldError(f"{name} must be a boolean, got {type(value).__name__}")
    return value


def blob(max_bytes: int) -> Check:
    def check(name: str, value: Any) -> Any:
        if not isinstance(value, bytes):
            raise FieldError(f"{name} must be bytes, got {type(value).__name__}")
        if len(value) > max_bytes:
            raise FieldError(f"{name} is longer than {max_bytes} bytes")
        return value

    return check


def payload(max_bytes: int) -> Check:
    """Bytes, or a memoryview of a received frame (a payload frame taken without a copy)."""
    def check(name: str, value: Any) -> Any:
        if not isinstance(value, (bytes, memoryview)):
            raise FieldError(f"{name} must be bytes, got {type(value).__name__}")
        size = value.nbytes if isinstance(value, memoryview) else len(value)
        if size > max_bytes:
            raise FieldError(f"{name} is longer than {max_bytes} bytes")
        return value

    return check


def _sequence(name: str, value: Any, max_items: int, of: str = "") -> Sequence[Any]:
    """The checks every list field starts with: a sequence (not a string), of at most `max_items` items."""
    if isinstance(value, (str, bytes)) or not isinstance(value, Sequence):
        raise FieldError(f"{name} must be a list{f' of {of}' if of else ''}, got {type(value).__name__}")
    if len(value) > max_items:
        raise FieldError(f"{name} has more than {max_items} items")
    return value


def blob_list(max_items: int, max_bytes: int) -> Check:
    def check(name: str, value: Any) -> Any:
        for v in _sequence(name, value, max_items, "byte strings"):
            if type(v) is not bytes or len(v) > max_bytes:
                raise FieldError(f"{name} must hold byte strings of at most {max_bytes} bytes, got {type(v).__name__}")
        return tuple(value)

    return check


def int_list(max_items: int, lo: int = 0, hi: int = 2**31 - 1, optional: bool = False) -> Check:
    def check(name: str, value: Any) -> Any:
        if value is None and optional:
            return None
        _sequence(name, value, max_items, "integers")
        # Prompts and outputs are hundreds of ids: check types and range at C speed; loop only to name the bad one.
        if not value or (_INTS.issuperset(map(type, value)) and lo <= min(value) and max(value) <= hi):
            return tuple(value)
        for v in value:
            if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
                raise FieldError(f"{name} must hold integers in [{lo}, {hi}], got {repr(v)[:80]}")
        return tuple(value)

    return check


def str_list(max_items: int, item: Check) -> Check:
    def check(name: str, value: Any) -> Any:
        return tuple(item(name, v) for v in _sequence(name, value, max_items, "strings"))

    return check


def one_of(values: frozenset[str]) -> Check:
    def check(name: str, value: Any) -> Any:
        if not isinstance(value, str) or value not in values:
            raise FieldError(f"{name} must be one of {sorted(values)}, got {repr(value)[:80]}")
        return value

    return check


def nested(cls: type[Any], optional: bool = False) -> Check:
    def check(name: str, value: Any) -> Any:
        if value is None and optional:
            return None
        if isinstance(value, cls):
            return value
        if not isinstance(value, Mapping):
            raise FieldError(f"{name} must be a map, got {type(value).__name__}")
        return build(cls, value, where=f"{name}.")

    return check


def nested_list(cls: type[Any], max_items: int, optional: bool = False) -> Check:
    one = nested(cls)

    def check(name: str, value: Any) -> Any:
        if value is None and optional:
            return None
        return tuple(one(name, v) for v in _sequence(name, value, max_items))

    return check


T = TypeVar("T")
_SCHEMAS: dict[type[Any], tuple[list[tuple[str, Check]], list[str], list[str]]] = {}


def _schema(cls: type[Any]) -> tuple[list[tuple[str, Check]], list[str], list[str]]:
    """(field checks, all field names, required field names) of a message type, computed once."""
    schema = _SCHEMAS.get(cls)
    if schema is None:
        hints = get_type_hints(cls, include_extras=True)
        checks = []
        for f in fields(cls):
            meta = getattr(hints[f.name], "__metadata__", ())
            if meta:
                checks.append((f.name, meta[0]))
        names = [f.name for f in fields(cls)]
        required = [f.name for f in fields(cls) if f.default is MISSING and f.default_factory is MISSING]
        schema = _SCHEMAS[cls] = (checks, names, required)
    return schema


def field_names(cls: type[Any]) -> list[str]:
    return _schema(cls)[1]


def validate(value: Any) -> None:
    """Run every field check of a dataclass instance (called from __post_init__)."""
    for name, check in _schema(type(value))[0]:
        object.__setattr__(value, name, check(name, getattr(value, name)))


def build(cls: type[T], header: Mapping[str, Any], where: str = "") -> T:
    """A typed value from a decoded map: known keys only, required ones present, every field checked."""
    _, names, required = _schema(cls)
    for name in required:
        if name not in header:
            raise FieldError(f"missing field {where}{name}")
    return cls(**{n: header[n] for n in names if n in header})


def plain(value: Any) -> Any:
    """A value as msgpack takes it: enums by value, tuples as lists, dataclasses as maps."""
    if isinstance(value, Enum):
        return value.value
    if isinstance(value, tuple):
        if _SCALARS.issuperset(map(type, value)):
            return list(value)  # token ids, session ids: no per-item call
        return [plain(v) for v in value]
    if hasattr(value, "__dataclass_fields__"):
        return {f.name: plain(getattr(value, f.name)) for f in fields(value)}
    return value
