"""CurveZMQ keys: generate them, load them, and put them on sockets.

Layout of the broker's key directory (`broker start --keys DIR`):

    DIR/broker.key_secret   the broker's key pair (its public half, DIR/broker.key, goes to every peer)
    DIR/workers/*.key       public keys allowed to register as workers
    DIR/clients/*.key       public keys allowed to connect as clients
    DIR/admins/*.key        (optional) client keys that may list and close any session (`broker sessions`,
                            `broker close-session`); each must be in clients/ too

A worker or a client takes the broker's public key file (`--broker-key`) and its own key pair
(`--key NAME.key_secret`). Files are ZeroMQ's certificate format (`zmq.auth`), made by `broker keygen`:
the secret file is created with mode 0600 under a temporary name and renamed into place, so it is never
readable by others, not even for a moment. The broker refuses to start with a secret others can read.
The two allow-lists are separate ZAP domains, so a client key cannot register as a worker.
"""

from __future__ import annotations

import datetime
import os
import secrets
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import structlog
import zmq
import zmq.auth

log = structlog.get_logger()

BROKER_KEY_NAME = "broker"
WORKERS_DIR = "workers"
CLIENTS_DIR = "clients"
ADMINS_DIR = "admins"
WORKERS_DOMAIN = "workers"
CLIENTS_DOMAIN = "clients"
# Socket-monitor events of a refused handshake: an unknown key, a wrong server key, or one side without CURVE.
HANDSHAKE_FAILED = zmq.EVENT_HANDSHAKE_FAILED_AUTH | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
# What a client is told when the broker refused its handshake (ZeroMQ retries it silently: the wait times out).
HANDSHAKE_REFUSED = (
    "the broker refused this client's handshake: its key is not in the broker's clients/, --broker-key is not "
    "the broker's public key, or the broker requires keys and none were given"
)


class KeyFileError(ValueError):
    """A key file is missing or malformed."""


@dataclass(frozen=True)
class CurveClient:
    """What a connecting peer needs: the broker's public key and its own pair (all Z85, 40 bytes)."""

    server_public: bytes
    public: bytes
    secret: bytes

    @property
    def user(self) -> str:
        """The identity the broker sees: this peer's public key."""
        return self.public.decode()

    @classmethod
    def load(cls, broker_key: str | os.PathLike[str], key: str | os.PathLike[str]) -> CurveClient:
        server_public, _ = _load(broker_key, need_secret=False)
        public, secret = _load(key, need_secret=True)
        assert secret is not None
        return cls(server_public, public, secret)

    @classmethod
    def from_files(cls, broker_key: str | os.PathLike[str] | None, key: str | os.PathLike[str] | None) -> CurveClient | None:
        """Both files or neither (None: no CURVE). ValueError for one alone, KeyFileError for a bad file."""
        if broker_key is None and key is None:
            return None
        if broker_key is None or key is None:
            raise ValueError("give both broker_key (the broker's public key file) and key (this peer's .key_secret), "
                             "or neither")
        return cls.load(broker_key, key)

    def apply(self, sock: zmq.Socket[Any]) -> None:
        """Before connect."""
        sock.curve_serverkey = self.server_public
        sock.curve_publickey = self.public
        sock.curve_secretkey = self.secret


@dataclass(frozen=True)
class BrokerKeys:
    """The broker's pair and the directories of allowed public keys."""

    public: bytes
    secret: bytes
    workers: Path
    clients: Path

    admins: Path | None = None  # DIR/admins, when it exists

    @classmethod
    def load(cls, directory: str | os.PathLike[str]) -> BrokerKeys:
        root = Path(directory)
        secret_file = root / f"{BROKER_KEY_NAME}.key_secret"
        check_private(secret_file)
        public, secret = _load(secret_file, need_secret=True)
        assert secret is not None
        workers, clients, admins = root / WORKERS_DIR, root / CLIENTS_DIR, root / ADMINS_DIR
        for d in (workers, clients):
            if not d.is_dir():
                raise KeyFileError(f"{d} is missing: it holds the allowed public keys (*.key)")
        return cls(public, secret, workers, clients, admins if admins.is_dir() else None)

    def allowed(self, domain: str) -> int:
        """How many public keys a domain allows (for the log)."""
        return len(_certificates(self.workers if domain == WORKERS_DOMAIN else self.clients))

    def admin_keys(self) -> frozenset[str]:
        """The Z85 public keys in admins/ (none without it), read now: an operator may add one and send SIGHUP."""
        if self.admins is None or not self.admins.is_dir():
            return frozenset()
        return frozenset(key.decode() for key in _certificates(self.admins))

    def check(self) -> None:
        """KeyFileError naming the first public key file of workers/, clients/ or admins/ that is not one (before the
        allow-lists are replaced: a typo must not cost the ones in force)."""
        for directory in (self.workers, self.clients, self.admins):
            if directory is not None and directory.is_dir():
                _certificates(directory)

    def apply(self, sock: zmq.Socket[Any], domain: str) -> None:
        """Before bind: CURVE server with the given ZAP domain (its allow-list)."""
        sock.zap_domain = domain.encode()
        sock.curve_secretkey = self.secret
        sock.curve_publickey = self.public
        sock.curve_server = True


def drain_events(monitor: zmq.Socket[Any]) -> int:
    """Read every event queued on a monitor socket, without blocking; returns how many there were."""
    count = 0
    while True:
        try:
            monitor.recv_multipart(zmq.NOBLOCK)
        except zmq.Again:
            return count
        count += 1


def keygen(directory: str | os.PathLike[str], name: str) -> tuple[Path, Path]:
    """Write DIR/NAME.key (public) and DIR/NAME.key_secret (the pair, mode 0600 from its creation on: written under a
    temporary name opened 0600 and renamed into place, so no other user can read it at any moment)."""
    if not name or "/" in name or name.startswith("."):
        raise KeyFileError(f"bad key name {name!r}")
    root = Path(directory)
    root.mkdir(parents=True, exist_ok=True)
    public, secret = root / f"{name}.key", root / f"{name}.key_secret"
    if public.exists() or secret.exists():
        raise KeyFileError(f"{public} or {secret} exists already: not overwriting a key")
    public_key, secret_key = zmq.curve_keypair()
    now = datetime.datetime.now()
    _write_new(secret, _certificate(SECRET_BANNER.format(now), public_key, secret_key), 0o600)
    _write_new(public, _certificate(PUBLIC_BANNER.format(now), public_key), 0o644)
    return public, secret


def check_private(path: Path) -> None:
    """Refuse a secret key file that users other than its owner's group may read or write (KeyFileError); warn about
    one its group may read (a Kubernetes Secret mounted 0440 with an fsGroup is that)."""
    try:
        mode = stat.S_IMODE(path.stat().st_mode)
    except OSError as e:
        raise KeyFileError(f"cannot read key file {path}: {e}") from e
    if mode & 0o007:
        raise KeyFileError(f"{path} has mode {mode:04o}: other users may read it. It holds a secret key: "
                           f"chmod 600 {path} (and make a new key pair if others did read it)")
    if mode & 0o070:
        log.warning("secret_key_group_readable", path=str(path), mode=f"{mode:04o}")


# zmq.auth's certificate format, as zmq.auth.create_certificates writes it (zmq.auth.load_certificate reads it back).
SECRET_BANNER = """#   ****  Generated on {0} by sessionserve (broker keygen)  ****
#   ZeroMQ CURVE **Secret** Certificate
#   DO NOT PROVIDE THIS FILE TO OTHER USERS nor change its permissions.

"""
PUBLIC_BANNER = """#   ****  Generated on {0} by sessionserve (broker keygen)  ****
#   ZeroMQ CURVE Public Certificate
#   Exchange securely, or use a secure mechanism to verify the contents
#   of this file after exchange.

"""


def _certificate(banner: str, public: bytes, secret: bytes | None = None) -> bytes:
    text = f'{banner}metadata\ncurve\n    public-key = "{public.decode()}"\n'
    if secret is not None:
        text += f'    secret-key = "{secret.decode()}"\n'
    return text.encode()


def _write_new(path: Path, data: bytes, mode: int) -> None:
    """Write `path`, which must not exist, with `mode` from the first byte on: a temporary file opened with that mode
    (O_EXCL, the umask can only take bits away) then renamed, so a reader sees the whole file or none."""
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(4)}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, mode)  # a umask wider than the mode's complement is not the point: exactly this mode
        os.link(tmp, path)  # fails if `path` appeared meanwhile: never overwrites a key
    finally:
        os.unlink(tmp)


def _load(path: str | os.PathLike[str], need_secret: bool) -> tuple[bytes, bytes | None]:
    try:
        public, secret = zmq.auth.load_certificate(path)
    except (OSError, ValueError) as e:
        raise KeyFileError(f"cannot read key file {path}: {e}") from e
    if len(public) != 40:
        raise KeyFileError(f"{path}: the public key is not 40 Z85 characters")
    if need_secret and (secret is None or len(secret) != 40):
        raise KeyFileError(f"{path} holds no secret key: pass the NAME.key_secret file")
    return public, secret


def _certificates(directory: Path) -> dict[bytes, bool]:
    """The public keys of directory/*.key; KeyFileError (not pyzmq's ValueError) for a file that is not one."""
    try:
        return zmq.auth.load_certificates(directory)
    except ValueError as e:
        raise KeyFileError(f"{directory}: {e}") from None
