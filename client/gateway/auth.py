"""API keys: `Authorization: Bearer KEY`, checked against a key file. Each key owns its sessions.

The file holds one key a line, `NAME KEY` or just `KEY` (its name is then `key-` and the first 8 hex digits of
its SHA-256); blank lines and lines starting with # are skipped. A key is at least 16 characters of
[A-Za-z0-9._~+/=-]. Names are what logs and metrics show, never keys. Without a key file every request is
served, as owner "". SIGHUP reads the file again.
"""

from __future__ import annotations

import hashlib
import re
from pathlib import Path

from client.gateway.errors import unauthorized

KEY_PATTERN = re.compile(r"[A-Za-z0-9._~+/=-]{16,256}")
NAME_PATTERN = re.compile(r"[A-Za-z0-9._@-]{1,64}")


class KeyFileError(ValueError):
    """The key file cannot be read or holds a malformed line (the message says which)."""


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


class ApiKeys:
    """Key digests -> owner names. Looking a presented key up by its digest compares no secret byte by byte."""

    def __init__(self, owners: dict[bytes, str], path: Path | None = None) -> None:
        self._owners = owners
        self.path = path

    @classmethod
    def open(cls) -> ApiKeys:
        return cls({}, None)

    @classmethod
    def from_file(cls, path: Path) -> ApiKeys:
        try:
            lines = path.read_text().splitlines()
        except OSError as e:
            raise KeyFileError(f"cannot read the API key file {path}: {e.strerror or e}") from e
        owners: dict[bytes, str] = {}
        for number, raw in enumerate(lines, 1):
            line = raw.strip()
            if not line or line.startswith("#"):
                continue
            parts = line.split()
            if len(parts) > 2 or not KEY_PATTERN.fullmatch(parts[-1]) or (len(parts) == 2 and not NAME_PATTERN.fullmatch(parts[0])):
                raise KeyFileError(f"{path}:{number}: expected `NAME KEY` or `KEY` (a key is 16+ characters of "
                                   "letters, digits and ._~+/=-)")
            key = parts[-1]
            name = parts[0] if len(parts) == 2 else "key-" + hashlib.sha256(key.encode()).hexdigest()[:8]
            if _digest(key) in owners:
                raise KeyFileError(f"{path}:{number}: this key is listed twice")
            owners[_digest(key)] = name
        if not owners:
            raise KeyFileError(f"{path} holds no key: every request would be refused")
        return cls(owners, path)

    @property
    def enabled(self) -> bool:
        return self.path is not None

    def __len__(self) -> int:
        return len(self._owners)

    def owner(self, authorization: str | None) -> str:
        """The owner of the request's `Authorization` header; ApiError 401 when keys are on and it names none."""
        if not self.enabled:
            return ""
        if not authorization:
            raise unauthorized("You didn't provide an API key: send `Authorization: Bearer KEY`")
        scheme, _, key = authorization.partition(" ")
        if scheme.lower() != "bearer" or not key.strip():
            raise unauthorized("The Authorization header must be `Bearer KEY`")
        owner = self._owners.get(_digest(key.strip()))
        if owner is None:
            raise unauthorized("Incorrect API key provided")
        return owner

