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

A session of a recurrent model keeps its latest checkpoint (worker.engine.checkpoints: its fixed-size state as it was
at `at` tokens) with it, in host memory beside its state (where the host is short of room for a session's state,
checkpoints are let go first, the oldest first, when no copy can go to disk) and in a file of its own on disk,
`<session id>.checkpoint`, written first, the same way (magic b"SCHECKPT"; the header holds `at`, the checkpoint's
size and a digest of the session's first `at` tokens). A checkpoint is only ever a shortcut: a companion file that is
missing, corrupt, of another layout or of other tokens is deleted and the session restored without one; one whose
session file is gone is deleted when the store is listed. Workers that predate checkpoints read the session files as
before and leave the companions alone.

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
from array import array
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import structlog
import torch

from worker.errors import EngineError

log = structlog.get_logger(__name__)

MAGIC = b"SSESSION"
CHECKPOINT_MAGIC = b"SCHECKPT"
VERSION = 1
DIGEST_BYTES = 32
SUFFIX = ".session"
CHECKPOINT_SUFFIX = ".checkpoint"
_LENGTH = struct.Struct("<Q")
_SESSION_ID = re.compile(r"^[A-Za-z0-9_.-]{1,128}$")  # what may name a file in the store
_TEMPORARY = re.compile(r"^.+\.(session|checkpoint)\.tmp\d+$")  # what _write_file writes before its rename
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
    checkpoint_at: int = 0  # the session's checkpoint kept with it (its tokens; 0: none)
    checkpoint_bytes: int = 0
    checkpoint: torch.Tensor | None = None  # its bytes while in host memory

    @property
    def held(self) -> int:
        """The host memory it takes while there: the session's state, and its checkpoint's."""
        return self.nbytes + self.checkpoint_bytes

    def without_checkpoint(self) -> None:
        self.checkpoint_at = self.checkpoint_bytes = 0
        self.checkpoint = None


def storable_id(session_id: str) -> bool:
    return bool(_SESSION_ID.match(session_id)) and session_id not in (".", "..")


class Hibernation:
    def __init__(self, model: str, fingerprint: str, host_limit_bytes: int, store_dir: str | Path | None,
                 pin: bool, max_context: int, checkpoint_bytes: int = 0) -> None:
        self.model = model
        self.checkpoint_bytes = checkpoint_bytes  # a checkpoint's size (the fixed-size state's); 0: the model has none
        self.fingerprint = fingerprint
        self.max_context = max_context  # a stored session longer than this is left in the store, not served
        self.host_limit_bytes = max(0, host_limit_bytes)
        self.store = None if store_dir is None else Path(store_dir)
        self.pin = pin
        self.host: OrderedDict[str, Stored] = OrderedDict()  # oldest first
        self.disk: dict[str, Stored] = {}
        self.host_bytes = 0
        self.host_checkpoint_bytes = 0  # of host_bytes: checkpoints', which make room for a session's state
        self.host_storable_bytes = 0  # of host_bytes: states a store can take (they spill to make room)
        self._lock_fd: int | None = None  # held open while this process lives: closing it would release the lock
        if self.store is not None:
            self.store.mkdir(parents=True, exist_ok=True)
            self._lock_fd = _lock_store(self.store)

    def close(self) -> None:
        """Let go of the store (its lock goes with the descriptor): the engine is being unloaded."""
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None

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
        stays in host memory, within its limit, which checkpoints and storable copies there give up for it."""
        host = self.host_bytes - self.host_checkpoint_bytes - (self.host_storable_bytes if self.store is not None else 0)
        count = 0
        for session_id, nbytes in sessions:
            cost = 0 if self.store is not None and storable_id(session_id) else nbytes
            if host + cost <= self.host_limit_bytes or cost == 0:
                count += 1
                host += cost
        return count

    def put(self, stored: Stored) -> None:
        """Keep a hibernated session (its `state` set): in host memory, the oldest copies spilling to disk while
        the host holds more than its limit (checkpoints let go, the oldest first, where none can); straight to disk
        when it cannot fit at all."""
        assert stored.state is not None
        stored.at = time.monotonic()
        if stored.held > self.host_limit_bytes:
            if not self._write(stored):
                stored.without_checkpoint()
            return
        self._host_add(stored)
        try:
            while self.host_bytes > self.host_limit_bytes:
                # The oldest copy that can go to disk (an id that is no file name stays in host memory), this one
                # last; where none can, the oldest checkpoint.
                oldest = next((s for s in self.host.values() if storable_id(s.session_id)), None)
                if oldest is not None and self.store is not None:
                    self._spill(oldest)
                    if oldest is stored:
                        break  # kept, on disk
                    continue
                with_checkpoint = next((s for s in self.host.values() if s.checkpoint_bytes), None)
                if with_checkpoint is None:
                    raise SessionLost(f"session {stored.session_id}: host memory for hibernated sessions is full")
                self._host_remove(with_checkpoint)
                with_checkpoint.without_checkpoint()
                self._host_add(with_checkpoint)
        except BaseException:
            if stored.session_id in self.host:  # not kept: the caller keeps it resident
                self._host_remove(stored)
                del self.host[stored.session_id]
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
        self._read_checkpoint(stored)
        return stored

    def drop(self, session_id: str) -> None:
        """Forget a session's stored state (restored or closed): its host copy, or its file."""
        stored = self.host.pop(session_id, None)
        if stored is not None:
            self._host_remove(stored)
            return
        stored = self.disk.pop(session_id, None)
        if stored is not None and self.store is not None:
            stored.state = None
            try:
                self._path(session_id).unlink(missing_ok=True)
                self._path(session_id, CHECKPOINT_SUFFIX).unlink(missing_ok=True)
            except OSError as e:
                log.warning("session_file_not_deleted", session=session_id, error=str(e))

    def forget(self, session_id: str) -> None:
        """A session whose stored state could not be read back: forgotten, its file (if any) set aside as `.corrupt`
        for a person to look at."""
        stored = self.host.pop(session_id, None)
        if stored is not None:
            self._host_remove(stored)
        if self.disk.pop(session_id, None) is not None and self.store is not None:
            path = self._path(session_id)
            if path.exists():
                _set_aside(path)
            _unlink(self._path(session_id, CHECKPOINT_SUFFIX))

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
        for path in self.store.glob("*" + CHECKPOINT_SUFFIX):  # a checkpoint whose session file is gone
            if not path.with_suffix(SUFFIX).exists():
                _unlink(path)
        for tmp in self.store.glob("*.tmp*"):  # a write a crash cut short (never a store file: those end in a suffix)
            if _TEMPORARY.match(tmp.name):
                _unlink(tmp)
        return found

    # -- disk ---------------------------------------------------------------------------------------------------

    def _spill(self, stored: Stored) -> None:
        """Host -> disk (written first: a failed write leaves it in host memory)."""
        with_checkpoint = self._write(stored)
        self._host_remove(stored)
        del self.host[stored.session_id]
        if not with_checkpoint:
            stored.without_checkpoint()

    def _host_add(self, stored: Stored) -> None:
        self.host[stored.session_id] = stored
        self.host_bytes += stored.held
        self.host_checkpoint_bytes += stored.checkpoint_bytes
        self.host_storable_bytes += stored.nbytes if storable_id(stored.session_id) else 0

    def _host_remove(self, stored: Stored) -> None:
        """Its bytes out of the host's count (the caller takes it out of `host`, or adds it back changed)."""
        self.host_bytes -= stored.held
        self.host_checkpoint_bytes -= stored.checkpoint_bytes
        self.host_storable_bytes -= stored.nbytes if storable_id(stored.session_id) else 0

    def _path(self, session_id: str, suffix: str = SUFFIX) -> Path:
        assert self.store is not None
        return self.store / (session_id + suffix)

    def _write(self, stored: Stored) -> bool:
        """The session's files; whether its checkpoint went too (the caller forgets one that did not, once its host
        memory is counted out: `stored` keeps the sizes it was counted with)."""
        if self.store is None or not storable_id(stored.session_id) or stored.state is None:
            raise SessionLost(f"session {stored.session_id} cannot be written to the session store")
        with_checkpoint = self._write_checkpoint(stored)
        header = {
            "version": VERSION, "session_id": stored.session_id, "owner": stored.owner, "model": self.model,
            "layout": self.fingerprint, "computed": stored.computed, "nbytes": stored.nbytes, "tokens": stored.tokens,
        }
        _write_file(self._path(stored.session_id), MAGIC, header, stored.state[: stored.nbytes])
        stored.state = stored.checkpoint = None
        self.disk[stored.session_id] = stored
        return with_checkpoint

    def _write_checkpoint(self, stored: Stored) -> bool:
        """The session's checkpoint into its own file, before the session's; whether it was written (a checkpoint is
        a shortcut: one that cannot be written is logged and left out; an earlier one of this id is deleted either
        way)."""
        path = self._path(stored.session_id, CHECKPOINT_SUFFIX)
        _unlink(path)
        if not stored.checkpoint_at or stored.checkpoint is None:
            return False
        header = {"version": VERSION, "session_id": stored.session_id, "model": self.model, "layout": self.fingerprint,
                  "at": stored.checkpoint_at, "nbytes": stored.checkpoint_bytes,
                  "tokens": _tokens_digest(stored.tokens[: stored.checkpoint_at])}
        try:
            _write_file(path, CHECKPOINT_MAGIC, header, stored.checkpoint)
        except OSError as e:
            log.warning("checkpoint_not_written", session=stored.session_id, error=str(e))
            return False
        return True

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
        """The session's state from its file."""
        path = self._path(stored.session_id)
        try:
            head, payload = _read_file(path, MAGIC)
        except OSError as e:
            raise SessionLost(f"session {stored.session_id}: its stored state cannot be read ({e})") from e
        except ValueError as e:
            raise SessionLost(f"session {stored.session_id}: its stored state is corrupt ({e})") from e
        try:
            again = _stored(head)
        except ValueError as e:
            raise SessionLost(f"session {stored.session_id}: its stored header is corrupt ({e})") from e
        if (again.session_id, again.tokens, again.computed, again.nbytes) != (
                stored.session_id, stored.tokens, stored.computed, stored.nbytes) or head.get("layout") != self.fingerprint \
                or len(payload) != stored.nbytes:
            raise SessionLost(f"session {stored.session_id}: its stored state changed since the worker listed it")
        state = self.buffer(stored.nbytes)
        if stored.nbytes:  # (a session of no fixed state and no computed token has none: torch reads no empty buffer)
            state.copy_(torch.frombuffer(bytearray(payload), dtype=torch.uint8))
        return state

    def _read_checkpoint(self, stored: Stored) -> None:
        """The session's checkpoint from its file, where there is one that holds this session's first tokens in this
        layout; any other is deleted (the session comes back without)."""
        stored.without_checkpoint()
        path = self._path(stored.session_id, CHECKPOINT_SUFFIX)
        if not self.checkpoint_bytes or not path.exists():
            return
        try:
            head, payload = _read_file(path, CHECKPOINT_MAGIC)
            at = head.get("at")
            if not (head.get("version") == VERSION and head.get("session_id") == stored.session_id
                    and head.get("model") == self.model and head.get("layout") == self.fingerprint
                    and isinstance(at, int) and not isinstance(at, bool) and 0 < at <= stored.computed
                    and head.get("nbytes") == self.checkpoint_bytes == len(payload)
                    and head.get("tokens") == _tokens_digest(stored.tokens[:at])):
                raise ValueError("not this session's checkpoint")
        except (OSError, ValueError) as e:
            log.warning("checkpoint_file_unreadable", session=stored.session_id, error=str(e))
            _unlink(path)
            return
        stored.checkpoint = self.buffer(len(payload))
        stored.checkpoint.copy_(torch.frombuffer(bytearray(payload), dtype=torch.uint8))
        stored.checkpoint_at, stored.checkpoint_bytes = at, len(payload)


def _write_file(path: Path, magic: bytes, header: dict[str, object], state: torch.Tensor) -> None:
    """`magic | u64 header length | header (JSON) | state | BLAKE2b-256 of everything before`, written to a temporary
    name, flushed and renamed (a crash leaves the old file or none, never half of one)."""
    head = json.dumps(header, separators=(",", ":")).encode()
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    digest = hashlib.blake2b(digest_size=DIGEST_BYTES)
    try:
        with open(tmp, "wb") as f:
            for part in (magic, _LENGTH.pack(len(head)), head, state.numpy().data):
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


def _read_file(path: Path, magic: bytes) -> tuple[dict[str, Any], memoryview]:
    """What _write_file wrote: its header and its state's bytes, the digest checked (ValueError otherwise)."""
    data = path.read_bytes()
    body, digest = memoryview(data)[:-DIGEST_BYTES], data[-DIGEST_BYTES:]
    if len(data) <= DIGEST_BYTES or hashlib.blake2b(body, digest_size=DIGEST_BYTES).digest() != digest:
        raise ValueError("checksum mismatch")
    if bytes(body[: len(magic)]) != magic:
        raise ValueError("not a file of this kind")
    try:
        (length,) = _LENGTH.unpack_from(body, len(magic))
        head = json.loads(bytes(body[len(magic) + _LENGTH.size : len(magic) + _LENGTH.size + length]))
    except (ValueError, struct.error) as e:
        raise ValueError(f"bad header ({e})") from e
    if not isinstance(head, dict):
        raise ValueError("bad header")
    return head, body[len(magic) + _LENGTH.size + length :]


def _tokens_digest(tokens: list[int]) -> str:
    """What a checkpoint file names its session's first tokens by."""
    return hashlib.blake2b(array("q", tokens).tobytes(), digest_size=16).hexdigest()


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


def _unlink(path: Path) -> None:
    with contextlib.suppress(OSError):
        path.unlink(missing_ok=True)


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
