"""Key files: `broker keygen` writes the secret with mode 0600 from its first byte, whatever the umask; the broker
refuses a secret key others can read; admins/ lists the client keys that may see and close any session."""

from __future__ import annotations

import os
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest
import zmq.auth

from broker.common import keys


@pytest.fixture
def open_umask() -> Iterator[None]:
    """The most permissive umask: whatever keygen gets, it gets because it asked for it."""
    before = os.umask(0)
    try:
        yield
    finally:
        os.umask(before)


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_keygen_creates_the_secret_0600_and_never_under_its_name_with_another_mode(
    tmp_path: Path, open_umask: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    created: list[tuple[str, int]] = []
    real_open = os.open

    def recording_open(path: str | os.PathLike[str], flags: int, mode: int = 0o777, *args: object) -> int:
        if flags & os.O_CREAT:
            created.append((os.path.basename(path), mode))
        return real_open(path, flags, mode)

    monkeypatch.setattr(os, "open", recording_open)
    public, secret = keys.keygen(tmp_path, "alice")
    assert (mode(secret), mode(public)) == (0o600, 0o644)
    assert [name.endswith(".tmp") and m for name, m in created] == [0o600, 0o644]  # made private, then renamed
    assert sorted(p.name for p in tmp_path.iterdir()) == ["alice.key", "alice.key_secret"]  # no temporary left
    public_key, secret_key = zmq.auth.load_certificate(secret)
    assert zmq.auth.load_certificate(public) == (public_key, None) and secret_key is not None
    assert zmq.curve_public(secret_key) == public_key
    with pytest.raises(keys.KeyFileError, match="not overwriting a key"):
        keys.keygen(tmp_path, "alice")
    assert mode(secret) == 0o600


@pytest.mark.parametrize(("file_mode", "refused"), [(0o600, False), (0o400, False), (0o640, False), (0o440, False),
                                                     (0o644, True), (0o604, True), (0o606, True), (0o666, True)])
def test_the_broker_refuses_a_secret_key_others_can_read(tmp_path: Path, file_mode: int, refused: bool) -> None:
    keys.keygen(tmp_path, "broker")
    for d in ("workers", "clients"):
        (tmp_path / d).mkdir()
    (tmp_path / "broker.key_secret").chmod(file_mode)
    if refused:
        with pytest.raises(keys.KeyFileError, match=f"has mode 0{file_mode:o}: other users may read it"):
            keys.BrokerKeys.load(tmp_path)
    else:
        assert keys.BrokerKeys.load(tmp_path).admins is None


def test_admin_keys_are_read_from_admins_when_it_exists(tmp_path: Path) -> None:
    keys.keygen(tmp_path, "broker")
    for d in ("workers", "clients"):
        (tmp_path / d).mkdir()
    assert keys.BrokerKeys.load(tmp_path).admin_keys() == frozenset()
    public, _ = keys.keygen(tmp_path / "admins", "ops")
    loaded = keys.BrokerKeys.load(tmp_path)
    assert loaded.admin_keys() == frozenset({zmq.auth.load_certificate(public)[0].decode()})
