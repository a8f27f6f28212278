"""Where hibernated sessions' state goes: pinned host memory, bounded, then checksummed files on disk.

A hibernated session has no slot: its state (the fixed state and its computed positions, one contiguous byte range
in the layout of cuda_state.spec) was copied out and its pages released. The engine (worker.engine.core) decides
when; this module keeps the bytes:

- **Host memory**: up to `host_limit_bytes` of copies (pinned when a GPU is present, so a restore is one DMA),
  least recently hibernated first out. A copy that does not fit goes to disk when there is a store, and the host
  refuses it otherwise (the session stays resident).
- **Disk** (`store_dir`): one file per session, `<session id>.session`, written to a temporary name, flushed and
  renamed (a crash leaves the old file or none, never half of one):

      b"SSESSION" | u64 header length | header (JSON) | state bytes | BLAKE2b-256 of everything before

  The header holds the session's id, owner, tokens, computed count, the model's name and the state's layout
  (`StateSpec.fingerprint`, which leaves out the context length). A file is read back only into the same model and
  layout, by an engine whose context holds its tokens, and only if its digest
  matches; otherwise the session is lost (`SessionLost`), and nothing else is touched. A file is deleted when its
  session is restored or closed, so the store holds exactly the sessions that are on disk.

On a clean stop with a store the worker writes every session here (`persist`); a worker started with the same
store lists the files (`index`: headers only, the digest is checked when a session is restored) and serves them.

A store belongs to one worker process at a time (a lock on `.lock` inside it, held while the process lives): a second
worker would list the first one's sessions as its own, the broker would drop them there as claimed twice, and that
drop would delete the files the first one still restores from.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import json
import os
import re
import struct
import time
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import structlog
import torch

from worker.errors import EngineError

log = structlog.get_logger(__name__)

MAGIC = b"SSESSION"
VERSION = 1
DIGEST_BYTES = 32
SUFFIX = ".session"
_LENGTH = struct.Struct("<Q")
_SESSION_ID = re.compile(r"^[A-Za-z0-9_.-]{1,128}$")  # what may name a file in the store
MAX_HEADER_BYTES = 64 << 20
LOCK_FILE = ".lock"


class SessionLost(EngineError):
    """A hibernated session's stored state is missing, corrupt or of another model: the session is gone."""

    code = "session_lost"


class StoreInUse(EngineError):
    """Another worker process serves from this session store: a worker refuses to start on it."""


@dataclass
class Stored:
    """A hibernated session: what the engine needs to bring it back. `state` is its bytes while in host memory."""

    session_id: str
    owner: str
    tokens: list[int]
    computed: int
    nbytes: int
    state: torch.Tensor | None = None  # None: on disk
    at: float = 0.0  # monotonic() when it was hibernated


def storable_id(session_id: str) -> bool:
    return bool(_SESSION_ID.match(session_id)) and session_id not in (".", "..")


class Hibernation:
    def __init__(self, model: str, fingerprint: str, host_limit_bytes: int, store_dir: str | Path | None,
                 pin: bool, max_context: int) -> None:
        self.model = model
        self.fingerprint = fingerprint
        self.max_context = max_context  # a stored session longer than this is left in the store, not served
        self.host_limit_bytes = max(0, host_limit_bytes)
        self.store = None if store_dir is None else Path(store_dir)
        self.pin = pin
        self.host: OrderedDict[str, Stored] = OrderedDict()  # oldest first
        self.disk: dict[str, Stored] = {}
        self.host_bytes = 0
        self._lock_fd: int | None = None  # held open while this process lives: closing it would release the lock
        if self.store is not None:
            self.store.mkdir(parents=True, exist_ok=True)
            self._lock_fd = _lock_store(self.store)

    @property
    def enabled(self) -> bool:
        return self.host_limit_bytes > 0 or self.store is not None

    def __contains__(self, session_id: str) -> bool:
        return session_id in self.host or session_id in self.disk

    def buffer(self, nbytes: int) -> torch.Tensor:
        """Host memory for a copy of `nbytes` (pinned when a GPU is present)."""
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=self.pin)

    def admits(self, nbytes: int, session_id: str) -> bool:
        """Whether a hibernation of `nbytes` can be kept now (in host memory, or on disk)."""
        return self.admissible([(session_id, nbytes)]) == 1

    def admissible(self, sessions: Iterable[tuple[str, int]]) -> int:
        """How many of these sessions (id, state bytes) could hibernate one after another, each kept where `put`
        keeps it: a session the store can name costs the host nothing for long (its copy spills to disk); another
        stays in host memory, within its limit."""
        host, count = self.host_bytes, 0
        for session_id, nbytes in sessions:
            cost = 0 if self.store is not None and storable_id(session_id) else nbytes
            if host + cost <= self.host_limit_bytes or cost == 0:
                count += 1
                host += cost
        return count

    def put(self, stored: Stored) -> None:
        """Keep a hibernated session (its `state` set): in host memory, the oldest copies spilling to disk while
        the host holds more than its limit; straight to disk when it cannot fit at all."""
        assert stored.state is not None
        stored.at = time.monotonic()
        if stored.nbytes > self.host_limit_bytes:
            self._write(stored)
            return
        self.host[stored.session_id] = stored
        self.host_bytes += stored.nbytes
        try:
            while self.host_bytes > self.host_limit_bytes:
                # The oldest copy that can go to disk (an id that is no file name stays in host memory).
                oldest = next((s for s in self.host.values() if storable_id(s.session_id)), stored)
                if oldest is stored or self.store is None:
                    raise SessionLost(f"session {stored.session_id}: host memory for hibernated sessions is full")
                self._spill(oldest)
        except BaseException:
            if self.host.pop(stored.session_id, None) is not None:  # not kept: the caller keeps it resident
                self.host_bytes -= stored.nbytes
            raise

    def take(self, session_id: str) -> Stored:
        """The session's stored state (read and checked from disk if it is there), without forgetting it: `drop`
        once it is restored. Raises SessionLost when the file is missing, corrupt or of another layout."""
        stored = self.host.get(session_id)
        if stored is not None:
            return stored
        stored = self.disk.get(session_id)
        if stored is None:
            raise SessionLost(f"session {session_id} has no stored state")
        stored.state = self._read(stored)
        return stored

    def drop(self, session_id: str) -> None:
        """Forget a session's stored state (restored or closed): its host copy, or its file."""
        stored = self.host.pop(session_id, None)
        if stored is not None:
            self.host_bytes -= stored.nbytes
            return
        stored = self.disk.pop(session_id, None)
        if stored is not None and self.store is not None:
            stored.state = None
            try:
                self._path(session_id).unlink(missing_ok=True)
            except OSError as e:
                log.warning("session_file_not_deleted", session=session_id, error=str(e))

    def forget(self, session_id: str) -> None:
        """A session whose stored state could not be read back: forgotten, its file (if any) set aside as `.corrupt`
        for a person to look at."""
        stored = self.host.pop(session_id, None)
        if stored is not None:
            self.host_bytes -= stored.nbytes
        if self.disk.pop(session_id, None) is not None and self.store is not None:
            path = self._path(session_id)
            if path.exists():
                _set_aside(path)

    def persist(self) -> int:
        """Write every host copy to disk (a clean stop): each that can be (one that cannot is logged, the others are
        still written). Returns how many were written."""
        written = 0
        for stored in list(self.host.values()):
            try:
                self._spill(stored)
            except (SessionLost, OSError) as e:
                log.warning("session_not_persisted", session=stored.session_id, error=str(e))
                continue
            written += 1
        return written

    def index(self) -> list[Stored]:
        """The sessions the store holds, from their files' headers (oldest first). A file that cannot be read is
        renamed `.corrupt` and left out."""
        if self.store is None:
            return []
        found: list[Stored] = []
        for path in sorted(self.store.glob("*" + SUFFIX), key=_mtime):
            try:
                stored = self._header(path)
            except (OSError, ValueError, struct.error) as e:
                log.warning("session_file_unreadable", path=str(path), error=str(e))
                _set_aside(path)
                continue
            if stored is None:
                continue
            self.disk[stored.session_id] = stored
            found.append(stored)
        for tmp in self.store.glob("*" + SUFFIX + ".tmp*"):  # a write a crash cut short
            tmp.unlink(missing_ok=True)
        return found

    # -- disk ---------------------------------------------------------------------------------------------------

    def _spill(self, stored: Stored) -> None:
        """Host -> disk (written first: a failed write leaves it in host memory)."""
        self._write(stored)
        del self.host[stored.session_id]
        self.host_bytes -= stored.nbytes

    def _path(self, session_id: str) -> Path:
        assert self.store is not None
        return self.store / (session_id + SUFFIX)

    def _write(self, stored: Stored) -> None:
        if self.store is None or not storable_id(stored.session_id) or stored.state is None:
            raise SessionLost(f"session {stored.session_id} cannot be written to the session store")
        header = json.dumps({
            "version": VERSION, "session_id": stored.session_id, "owner": stored.owner, "model": self.model,
            "layout": self.fingerprint, "computed": stored.computed, "nbytes": stored.nbytes, "tokens": stored.tokens,
        }, separators=(",", ":")).encode()
        path = self._path(stored.session_id)
        tmp = path.with_name(path.name + f".tmp{os.getpid()}")
        digest = hashlib.blake2b(digest_size=DIGEST_BYTES)
        payload = stored.state[: stored.nbytes].numpy().data
        try:
            with open(tmp, "wb") as f:
                for part in (MAGIC, _LENGTH.pack(len(header)), header, payload):
                    digest.update(part)
                    f.write(part)
                f.write(digest.digest())
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException:
            # A write cut short (a full disk, an I/O error): its part would hold the space a full disk lacks until the
            # next start, one more per session tried. The session stays where it was (the caller keeps it).
            with contextlib.suppress(OSError):  # (a store gone read-only: the write's own error is the one to tell)
                tmp.unlink(missing_ok=True)
            raise
        _fsync_dir(path.parent)
        stored.state = None
        self.disk[stored.session_id] = stored

    def _header(self, path: Path) -> Stored | None:
        """A file's session from its header (its size checked); None for a file of another model or layout."""
        size = path.stat().st_size
        with open(path, "rb") as f:
            if f.read(len(MAGIC)) != MAGIC:
                raise ValueError("not a session file")
            (length,) = _LENGTH.unpack(f.read(_LENGTH.size))
            if length > MAX_HEADER_BYTES:
                raise ValueError(f"header of {length} bytes")
            head = json.loads(f.read(length))
        stored = _stored(head)
        if stored.session_id + SUFFIX != path.name:
            raise ValueError(f"holds session {stored.session_id}")
        if size != len(MAGIC) + _LENGTH.size + length + stored.nbytes + DIGEST_BYTES:
            raise ValueError(f"{size} bytes, not what its header says")
        if head.get("model") != self.model or head.get("layout") != self.fingerprint:
            # Left in place, not served: a worker started again as before serves it again.
            log.warning("session_file_of_another_model", path=str(path), model=head.get("model"),
                        differs="model" if head.get("model") != self.model else
                        "layout (dtype, block size, the model's shapes or weights)")
            return None
        if len(stored.tokens) > self.max_context:  # left in place too, for a worker of a longer context
            log.warning("session_file_too_long", path=str(path), tokens=len(stored.tokens),
                        max_context=self.max_context)
            return None
        return stored

    def _read(self, stored: Stored) -> torch.Tensor:
        path = self._path(stored.session_id)
        try:
            data = path.read_bytes()
        except OSError as e:
            raise SessionLost(f"session {stored.session_id}: its stored state cannot be read ({e})") from e
        body, digest = data[:-DIGEST_BYTES], data[-DIGEST_BYTES:]
        if len(data) <= DIGEST_BYTES or hashlib.blake2b(body, digest_size=DIGEST_BYTES).digest() != digest:
            raise SessionLost(f"session {stored.session_id}: its stored state is corrupt (checksum mismatch)")
        try:
            (length,) = _LENGTH.unpack_from(body, len(MAGIC))
            head = json.loads(body[len(MAGIC) + _LENGTH.size : len(MAGIC) + _LENGTH.size + length])
            again = _stored(head)
        except (ValueError, struct.error) as e:
            raise SessionLost(f"session {stored.session_id}: its stored header is corrupt ({e})") from e
        if (again.session_id, again.tokens, again.computed, again.nbytes) != (
                stored.session_id, stored.tokens, stored.computed, stored.nbytes) or head.get("layout") != self.fingerprint:
            raise SessionLost(f"session {stored.session_id}: its stored state changed since the worker listed it")
        start = len(MAGIC) + _LENGTH.size + length
        state = self.buffer(stored.nbytes)
        if stored.nbytes:  # (a session of no fixed state and no computed token has none: torch reads no empty buffer)
            state.copy_(torch.frombuffer(bytearray(body[start : start + stored.nbytes]), dtype=torch.uint8))
        return state


def _stored(head: object) -> Stored:
    """A header's session, every field checked (a file is input like any other)."""
    if not isinstance(head, dict) or head.get("version") != VERSION:
        raise ValueError("unknown header version")
    sid, owner, tokens = head.get("session_id"), head.get("owner"), head.get("tokens")
    computed, nbytes = head.get("computed"), head.get("nbytes")
    if not isinstance(sid, str) or not storable_id(sid) or not isinstance(owner, str):
        raise ValueError("bad session id or owner")
    if not isinstance(tokens, list) or not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in tokens):
        raise ValueError("bad tokens")
    if not isinstance(computed, int) or not 0 <= computed <= len(tokens):
        raise ValueError("bad computed count")
    if not isinstance(nbytes, int) or nbytes < 0:
        raise ValueError("bad state size")
    return Stored(sid, owner, tokens, computed, nbytes)


def _mtime(path: Path) -> float:
    try:
        return path.stat().st_mtime
    except OSError:
        return 0.0


def _set_aside(path: Path) -> None:
    try:
        path.rename(path.with_name(path.name + ".corrupt"))
    except OSError:
        pass


def _lock_store(store: Path) -> int:
    """Lock the store for this process, or StoreInUse naming the process that holds it. A POSIX record lock: it is the
    process's (an engine loaded again in the same process takes it again), and the kernel drops it when the process
    ends however it ends, so a worker killed -9 leaves no stale lock behind."""
    fd = os.open(store / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
        holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
        os.close(fd)
        if e.errno in (errno.EACCES, errno.EAGAIN):
            raise StoreInUse(f"session store {store} is in use by another worker (pid {holder}): "
                             "each worker needs a --session-store of its own") from e
        raise
    os.ftruncate(fd, 0)
    os.pwrite(fd, str(os.getpid()).encode(), 0)
    return fd


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
