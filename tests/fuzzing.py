"""Protocol fuzzing: hypothesis strategies for frames that are almost right, and the harness that fires them at
real daemons. tests/integration/test_fuzz.py runs a small sample in CI; tests/fuzz_stack.py runs long ones.

Three targets, each a real process on 127.0.0.1:

- `ClientSocket`: a DEALER on the broker's client socket sends random frames and mutated valid requests of
  every command (bytes flipped in the msgpack header, fields replaced by values of other types, huge numbers,
  unicode, nesting, frames dropped or repeated, wrong version, payload frames, live sessions of another client).
- `WorkerSocket`: DEALERs posing as workers send mutated control messages (READY, HEARTBEAT, DISCONNECT...)
  and answers (REPLY, CHUNKS, CHUNK, ERROR) addressed to real clients.
- `WorkerLink`: a ROUTER posing as the broker drives a real `worker start` with mutated routed requests and
  control messages, answering its READY and heartbeating like a broker.

What is checked, case by case and at every checkpoint (a batch of cases):
- a message the protocol module rejects is answered with that error code and request id wherever an answer
  is possible (the client socket: always; a worker: when the header names a valid route and request id);
- an answer a worker sends to a real client's route arrives at that client untouched; every valid READY is
  welcomed; everything a daemon sends decodes;
- a good session, made before fuzzing on the real worker, generates exactly the same greedy tokens as it did
  before (the model is deterministic), all the while (`GoodSession`, a thread) or between batches;
- every process is alive, the worker heartbeats, and the broker's accounting returns to baseline.
A failed check raises `FuzzFailure` naming the check, the frames of the batch and the daemons' tracebacks.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import msgpack
import zmq
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import seed as hypothesis_seed
from hypothesis import strategies as st

from broker.common import protocol as p
from broker.common.fields import field_names
from client import Client, ClientError, Session

from .integration.cluster import Cluster, Daemon, free_port

T = TypeVar("T")
TargetT = TypeVar("TargetT", bound="Target")
Frames = list[bytes]

GOOD_PROMPT = (1, 2, 3, 4, 5)
GOOD_TOKENS = 16  # greedy, ignore_eos: always this many, always the same ones
VICTIMS = 3  # live sessions of another client that the fuzzer addresses
SPARE_SESSIONS = 16  # sessions the fuzz cases may make before they are closed, mid-batch if need be
REQUEST_ID_POOL = tuple(f"f{i}" for i in range(8))  # a small pool, so that request ids collide on purpose
ANSWER_WAIT_S = 15.0  # how long a checkpoint waits for the answers it expects
HEARTBEAT_MS = 100

# -- values --------------------------------------------------------------------------------------------------

EDGE_INTS = (
    0, 1, -1, 127, 128, 255, 256, 65535, 65536, 2**31 - 1, 2**31, 2**32 - 1, 2**32, 2**53 + 1, 2**62, 2**62 + 1,
    2**63 - 1, 2**64 - 1, -(2**31), -(2**32), -(2**63),
)
EDGE_FLOATS = (
    0.0, -0.0, 5e-324, 1e-45, 1e-300, 1e-38, 1e-7, 0.5, 1.0, 1.0000001, 100.0, 100.00001, 1e308,
    float("inf"), float("-inf"), float("nan"),
)
EDGE_TEXTS = (
    "", " ", "\x00", "\n", "é", "\U0001d54f", "\u202e", "\ufeff", "\uffff", "a" * 65, "0" * 32, "A" * 32, "0" * 33,
    "user", "system", "created", "forked", "closed", "generated", "SSP1", "CREATE", "{{ x }}", "{% for %}",
)
MSGPACK_TYPE_BYTES = (0xC0, 0xC1, 0xC2, 0xC3, 0xC4, 0xCA, 0xCB, 0xCF, 0xD3, 0xD9, 0xDB, 0xDC, 0xDD, 0xDE, 0xDF, 0xD4, 0xC7)

integers = st.integers(-(2**63), 2**64 - 1) | st.sampled_from(EDGE_INTS)
floats = st.floats() | st.sampled_from(EDGE_FLOATS)
texts = st.text(max_size=24) | st.sampled_from(EDGE_TEXTS)
extension_types = st.builds(msgpack.ExtType, st.integers(0, 127), st.binary(max_size=16)) | st.builds(
    msgpack.Timestamp, st.integers(0, 2**34), st.integers(0, 999_999_999)
)
scalars = st.none() | st.booleans() | integers | floats | texts | st.binary(max_size=24) | extension_types
map_keys = texts | st.binary(max_size=8) | st.integers(-5, 5)  # only string keys are valid (bytes and ints are not)
msgpack_values: st.SearchStrategy[Any] = st.recursive(
    scalars, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(map_keys, inner, max_size=4), max_leaves=16
)
# Values big enough to hit a limit, built once (hypothesis draws which one, not its bytes). Immutable: tuples
# pack as arrays, and a later mutation of the header cannot reach into a shared constant.
BIG_VALUES: tuple[Any, ...] = (
    "x" * 100_000, "\U0001d54f" * 20_000, tuple(range(70_000)), (0,) * 17, ("s",) * 17, ((((((((((),),),),),),),),),),
    b"\x00" * 300, 2**64 - 1, -(2**63), "a" * (p.MAX_NAME_CHARS + 1), "0" * 64 + "/", "b" * 65,
    # at the limits: the longest valid error message or reason, name, request id
    "r" * 4096, "r" * 4097, "n" * p.MAX_NAME_CHARS, "i" * 64,
)


def pick(pool: Sequence[T]) -> st.SearchStrategy[T]:
    """A member of a pool that may change while fuzzing runs (read when the case is drawn). Never empty."""
    return st.integers(0, 1 << 16).map(lambda i: pool[i % len(pool)])


def pack(header: Any) -> bytes:
    try:
        return msgpack.packb(header, use_bin_type=True)
    except (TypeError, ValueError, OverflowError):  # not packable: a header of garbage is a case too
        return b"\xc1"


# -- what the fuzzer knows about the live system ------------------------------------------------------------


@dataclass
class Known:
    """Live values that make a mutated message land somewhere interesting. Lists are changed in place."""

    model: str
    vocab: int
    sessions: list[str]  # live sessions the fuzzer may address (another client's)
    stale: list[str] = field(default_factory=lambda: [uuid.uuid4().hex])  # sessions that were closed
    routes: list[bytes] = field(default_factory=lambda: [b"c" + uuid.uuid4().bytes])  # real clients' routes
    names: list[str] = field(default_factory=lambda: ["w1"])


def request_ids() -> st.SearchStrategy[str]:
    return st.sampled_from(REQUEST_ID_POOL) | st.from_regex(p.ID_PATTERN, fullmatch=True)


def session_ids(known: Known) -> st.SearchStrategy[str]:
    return pick(known.sessions) | pick(known.stale) | st.from_regex(p.SESSION_PATTERN, fullmatch=True)


def routes(known: Known) -> st.SearchStrategy[bytes]:
    return pick(known.routes) | st.binary(min_size=1, max_size=p.MAX_ROUTE_BYTES)


def names(known: Known) -> st.SearchStrategy[str]:
    return pick(known.names) | st.just(known.model) | st.text(min_size=1, max_size=24)


def token_ids(known: Known) -> st.SearchStrategy[int]:
    return st.integers(0, known.vocab - 1) | st.integers(0, 2**31 - 1)


def counts() -> st.SearchStrategy[int]:
    return st.integers(0, 64) | st.integers(0, 2**62)


# -- valid messages ------------------------------------------------------------------------------------------


def samplings(known: Known) -> st.SearchStrategy[p.Sampling]:
    return st.builds(
        p.Sampling,
        max_tokens=st.integers(1, 32) | st.sampled_from([1, p.MAX_TOKENS]),
        temperature=st.just(0.0) | st.floats(0.0, 100.0) | st.sampled_from([5e-324, 1e-300, 1e-45, 1e-7, 100.0]),
        top_p=st.floats(0.0, 1.0, exclude_min=True) | st.sampled_from([5e-324, 1e-300, 1e-45, 1e-7, 1.0]),
        top_k=st.integers(0, 8) | st.integers(0, 2**31 - 1),
        seed=st.none() | st.integers(0, 2**63 - 1),
        stop=st.lists(st.text(min_size=1, max_size=8), max_size=3).map(tuple),
        stop_token_ids=st.lists(token_ids(known), max_size=3).map(tuple),
        ignore_eos=st.booleans(),
    )


def requests(known: Known, routed: bool) -> st.SearchStrategy[p.Message]:
    """Valid requests of every command; `routed`: as the broker sends them (route, broker-made session ids)."""
    rid = request_ids()
    sid = session_ids(known)
    route = routes(known) | st.just(b"") if routed else st.just(b"")
    new_sid = (st.from_regex(p.SESSION_PATTERN, fullmatch=True) | sid) if routed else st.none()
    model = st.none() | st.just(known.model) | st.just(known.model.upper()) | st.text(min_size=1, max_size=16)
    tokens = st.lists(token_ids(known), max_size=12).map(tuple)
    roles = st.sampled_from(["user", "system", "assistant", "tool"]) | st.from_regex(r"[a-z_]{1,64}", fullmatch=True)
    return st.one_of(
        st.builds(p.CreateSession, request_id=rid, model=model, session_id=new_sid, route=route,
                  owner=owners_ if routed else st.just("")),
        st.builds(p.Append, request_id=rid, session_id=sid, token_ids=tokens, route=route),
        st.builds(p.Append, request_id=rid, session_id=sid, text=st.text(max_size=48), route=route),
        st.builds(p.Chat, request_id=rid, session_id=sid, content=st.text(max_size=48), role=roles, route=route),
        st.builds(p.Generate, request_id=rid, session_id=sid, params=samplings(known), stream=st.booleans(), route=route),
        st.builds(p.Fork, request_id=rid, session_id=sid, child_id=new_sid, route=route),
        st.builds(p.Close, request_id=rid, session_id=sid, route=route),
        st.builds(p.Info, request_id=rid, session_id=sid, route=route),
        st.builds(p.Cancel, request_id=rid, session_id=sid, target=rid, route=route),
        st.builds(p.Status, request_id=rid, route=route),
    )


def answers(known: Known) -> st.SearchStrategy[p.Message]:
    """Valid worker answers (REPLY of every kind, CHUNK, CHUNKS, ERROR) addressed to real clients' routes."""
    rid = request_ids()
    sid = session_ids(known)
    route = routes(known)
    text = st.text(max_size=24)
    ids = st.lists(token_ids(known), max_size=8).map(tuple)
    chunk = st.builds(p.StreamChunk, rid, ids, text)
    worker_status = st.builds(p.WorkerStatus, names(known), names(known), counts(), counts(), counts(), st.booleans(), text)
    return st.one_of(
        st.builds(p.Created, request_id=rid, session_id=sid, model=names(known), worker=names(known),
                  max_context=counts(), route=route),
        st.builds(p.Appended, request_id=rid, session_id=sid, length=counts(), route=route),
        st.builds(p.Generated, request_id=rid, session_id=sid, token_ids=ids, text=text,
                  finish_reason=st.sampled_from(sorted(p.FINISH_REASONS)), length=counts(), route=route),
        st.builds(p.Forked, request_id=rid, session_id=sid, child_id=sid, length=counts(), worker=names(known), route=route),
        st.builds(p.Closed, request_id=rid, session_id=sid, route=route),
        st.builds(p.SessionInfo, request_id=rid, session_id=sid, length=counts(), model=names(known),
                  worker=names(known), max_context=counts(), busy=st.booleans(), route=route),
        st.builds(p.StatusReport, request_id=rid, broker_id=rid, workers=st.lists(worker_status, max_size=2).map(tuple),
                  route=route),
        st.builds(p.Chunk, request_id=rid, session_id=sid, token_ids=ids, text=text, route=route),
        st.builds(p.Chunks, chunks=st.lists(chunk, min_size=1, max_size=4).map(tuple), route=route),
        st.builds(p.Error, request_id=st.none() | rid, code=st.sampled_from(list(p.ErrorCode)), message=text, route=route),
    )


@st.composite
def readies(draw: st.DrawFn, known: Known) -> p.Ready:
    """A READY listing sessions (live ones of the real worker among them) and, or not, an owner for each."""
    sessions = tuple(draw(st.lists(session_ids(known), max_size=4)))
    owners = draw(st.just(()) | st.lists(owners_, min_size=len(sessions), max_size=len(sessions)).map(tuple))
    return p.Ready(name=draw(names(known)), model=draw(names(known)), capacity=draw(counts()),
                   free_slots=draw(counts()), max_context=draw(counts()), sessions=sessions, draining=draw(st.booleans()),
                   device=draw(st.text(max_size=8)), bytes_per_session=draw(counts()), owners=owners)


owners_ = st.just("") | st.from_regex(p.OWNER_PATTERN, fullmatch=True).filter(lambda o: len(o) <= 40)


def controls(known: Known) -> st.SearchStrategy[p.Message]:
    """Valid worker <-> broker control messages, both directions."""
    return st.one_of(
        readies(known),
        st.builds(p.Heartbeat, broker_id=st.none() | request_ids(), free_slots=st.none() | counts(),
                  sessions=st.none() | counts(), draining=st.booleans(), steps=st.none() | counts(),
                  expired=st.lists(session_ids(known), max_size=3).map(tuple)),
        st.builds(p.Disconnect, reason=st.text(max_size=24) | st.sampled_from(["r" * 4096, "\U0001d54f" * 4096])),
        st.builds(p.Welcome, broker_id=request_ids(), heartbeat_ms=st.integers(1, 3_600_000), liveness=st.integers(1, 1000)),
        st.builds(p.Reconnect, broker_id=request_ids()),
    )


# -- mutations -----------------------------------------------------------------------------------------------

FIELD_NAMES = sorted(
    {"kind"}
    | {
        name
        for cls in (*p.REQUEST_TYPES, *p.REPLY_KINDS.values(), p.Chunk, p.Chunks, p.Error, p.Ready, p.Welcome,
                    p.Heartbeat, p.Reconnect, p.Disconnect, p.Sampling, p.WorkerStatus)
        for name in field_names(cls)
    }
)
NEAR_VERSIONS = (b"SSP0", b"SSP2", b"ssp1", b"SSP1\x00", b"SSP", b"", b"\x00SSP1", b"SSP1" * 2)
NEAR_COMMANDS = (*(c.value for c in p.Command), *(c.value.lower() for c in p.Command), b"", b"CREATE\x00", b"\xff")

Path_ = tuple[Any, ...]  # keys and indices from the header down to one value


def paths(value: Any, prefix: Path_ = (), depth: int = 3) -> list[Path_]:
    """Every place in a decoded header a mutation may hit (maps and lists, a few levels down)."""
    out: list[Path_] = []
    if depth == 0:
        return out
    items: list[tuple[Any, Any]] = list(value.items()) if isinstance(value, dict) else (
        list(enumerate(value))[:8] if isinstance(value, list) else []
    )
    for key, child in items:
        out.append((*prefix, key))
        out += paths(child, (*prefix, key), depth - 1)
    return out


def _parent(header: dict[str, Any], path: Path_) -> Any:
    node: Any = header
    for key in path[:-1]:
        node = node[key]
    return node


def confusions(known: Known) -> st.SearchStrategy[Any]:
    """Values of one field put in another: live ids where numbers go, bytes for strings, bools for ints..."""
    sid = session_ids(known)
    return st.one_of(
        sid, sid.map(str.upper), sid.map(str.encode), pick(known.routes), request_ids(), names(known),
        st.sampled_from([True, False, 1, 0, 1.0, "1", "true", None, "null", -1, 2**31]),
        st.builds(list), st.builds(dict), st.builds(lambda: {"a": {"b": {"c": {"d": {}}}}}),
        st.sampled_from(BIG_VALUES), st.sampled_from([c.value for c in p.ErrorCode]),
        st.sampled_from(sorted(p.REPLY_KINDS)), st.lists(sid, max_size=3),
    )


@st.composite
def header_mutations(draw: st.DrawFn, header: dict[str, Any], known: Known) -> dict[str, Any]:
    """Structural changes of a decoded header: replace, delete, wrap, add fields (nested ones too)."""
    for _ in range(draw(st.integers(0, 3))):
        where = paths(header)
        op = draw(st.sampled_from(["replace", "confuse", "big", "big", "delete", "wrap", "add"]))
        if op == "add" or not where:
            target: Any = header
            nested = draw(st.booleans())
            if where and nested:
                node = _parent(header, where[draw(st.integers(0, len(where) - 1))])
                target = node if isinstance(node, dict) else header
            target[draw(st.sampled_from(FIELD_NAMES) | texts)] = draw(msgpack_values | confusions(known))
            continue
        path = where[draw(st.integers(0, len(where) - 1))]
        parent = _parent(header, path)
        if op == "delete":
            del parent[path[-1]]
        elif op == "wrap":
            parent[path[-1]] = draw(st.sampled_from([[parent[path[-1]]], {"v": parent[path[-1]]}]))
        elif op == "big":
            parent[path[-1]] = draw(st.sampled_from(BIG_VALUES))
        else:
            parent[path[-1]] = draw(msgpack_values if op == "replace" else confusions(known))
    return header


@st.composite
def byte_mutations(draw: st.DrawFn, raw: bytes) -> bytes:
    """Changes of the packed header: bits flipped, bytes inserted, deleted or replaced by msgpack type bytes."""
    data = bytearray(raw)
    for _ in range(draw(st.integers(0, 2))):
        at = draw(st.integers(0, len(data)))
        op = draw(st.sampled_from(["flip", "insert", "delete", "truncate", "type"]))
        if op == "insert" or not data:
            data[at:at] = draw(st.binary(min_size=1, max_size=8))
        elif op == "truncate":
            del data[at:]
        else:
            at = min(at, len(data) - 1)
            if op == "flip":
                data[at] ^= 1 << draw(st.integers(0, 7))
            elif op == "delete":
                del data[at : at + draw(st.integers(1, 8))]
            else:
                data[at] = draw(st.sampled_from(MSGPACK_TYPE_BYTES))
    return bytes(data)


@st.composite
def frame_mutations(draw: st.DrawFn, frames: Frames) -> Frames:
    """Changes of the message's frames: version, command, frames dropped, duplicated, swapped, payload added."""
    frames = list(frames)
    for _ in range(draw(st.integers(0, 2))):
        op = draw(st.sampled_from(["version", "command", "drop", "duplicate", "swap", "payload", "replace"]))
        i = draw(st.integers(0, max(len(frames) - 1, 0)))
        if op == "version" and frames:
            frames[0] = draw(st.sampled_from(NEAR_VERSIONS) | st.binary(max_size=8))
        elif op == "command" and len(frames) > 1:
            frames[1] = draw(st.sampled_from(NEAR_COMMANDS) | st.binary(max_size=12))
        elif op == "drop" and frames:
            del frames[i]
        elif op == "duplicate" and frames:
            frames.insert(i, frames[i])
        elif op == "swap" and len(frames) > 1:
            j = draw(st.integers(0, len(frames) - 1))
            frames[i], frames[j] = frames[j], frames[i]
        elif op == "payload":
            frames += draw(st.lists(st.binary(max_size=16), min_size=1, max_size=3))
        elif frames:
            frames[i] = draw(st.binary(max_size=32))
    return frames or [b""]  # a message has at least one frame


@st.composite
def mutated(draw: st.DrawFn, messages: st.SearchStrategy[p.Message], known: Known) -> Frames:
    """A valid message, then 0..7 mutations at three levels: header fields, header bytes, frames.
    With none drawn the message stays valid, so valid traffic is part of every run."""
    message = draw(messages)
    header = draw(header_mutations(message.to_header(), known))
    raw = draw(byte_mutations(pack(header)))
    return draw(frame_mutations([p.VERSION, message.COMMAND.value, raw]))


def random_frames() -> st.SearchStrategy[Frames]:
    """Garbage from nothing: random frames, or the right version and a command with random bytes or values."""
    command = st.sampled_from(NEAR_COMMANDS)
    return st.one_of(
        st.lists(st.binary(max_size=48), min_size=1, max_size=6),
        st.tuples(st.just(p.VERSION), command, st.binary(max_size=64)).map(list),
        st.tuples(st.just(p.VERSION), command, msgpack_values.map(pack)).map(list),
        st.tuples(st.just(p.VERSION), command, st.dictionaries(st.sampled_from(FIELD_NAMES), msgpack_values).map(pack)).map(list),
    )


@dataclass(frozen=True)
class Case:
    """One fuzz case: a message, sent `times` times in a row (a resend), by peer number `peer`; then, maybe,
    another message right after it (another request under the same request id)."""

    frames: Frames
    times: int = 1
    peer: int = 0
    then: Frames | None = None


def cases(frames: st.SearchStrategy[Frames], peers: int = 1) -> st.SearchStrategy[Case]:
    return st.builds(Case, frames=frames, times=st.sampled_from([1, 1, 1, 2]), peer=st.integers(0, peers - 1))


@st.composite
def reused_ids(draw: st.DrawFn, messages: st.SearchStrategy[p.Message]) -> Case:
    """Two valid requests under one request id, back to back (the first may still be in flight)."""
    first, second = draw(messages), draw(messages)
    header = second.to_header()
    header["request_id"] = first.to_header()["request_id"]
    return Case(p.encode(first), then=[p.VERSION, second.COMMAND.value, pack(header)])


def client_cases(known: Known) -> st.SearchStrategy[Case]:
    """For the broker's client socket: mostly mutated requests, some garbage, some messages of other legs."""
    valid = requests(known, routed=False)
    return reused_ids(valid) | cases(st.one_of(
        random_frames(), valid.map(p.encode), mutated(valid, known), mutated(valid, known), mutated(valid, known),
        mutated(answers(known) | controls(known), known),
    ))


def worker_socket_cases(known: Known, peers: int) -> st.SearchStrategy[Case]:
    """For the broker's worker socket, from `peers` fake workers: control messages and answers to real clients."""
    return cases(st.one_of(
        random_frames(), (controls(known) | answers(known)).map(p.encode), mutated(controls(known), known),
        mutated(answers(known), known), mutated(answers(known), known), mutated(requests(known, routed=True), known),
    ), peers)


def worker_link_cases(known: Known) -> st.SearchStrategy[Case]:
    """For a worker, from a fake broker: routed requests of every command and control messages."""
    routed = requests(known, routed=True)
    return reused_ids(routed) | cases(st.one_of(
        random_frames(), routed.map(p.encode), mutated(routed, known), mutated(routed, known), mutated(routed, known),
        mutated(controls(known) | answers(known), known),
    ))


# -- what the protocol says must happen -----------------------------------------------------------------------


ErrorKey = tuple[str, "str | None", str]  # (code, request id, the start of the message) of an ERROR
MESSAGE_KEY_CHARS = 256  # enough to tell the broker's refusals from a worker's; a long message may be cut


def strict(decode: Callable[[Frames], T], frames: Frames) -> T:
    """Run a protocol function that may only raise ProtocolError; anything else is a bug of the protocol module
    (every daemon and client trusts it to turn garbage into a typed error)."""
    try:
        return decode(frames)
    except p.ProtocolError:
        raise
    except Exception as e:
        raise FuzzFailure(f"broker.common.protocol raised {type(e).__name__} ({e}) instead of a ProtocolError on "
                          f"{show_frames(frames)}") from e


def client_error(frames: Frames) -> ErrorKey | None:
    """The error the broker must answer a client's message with; None when it is a valid request (answered by
    the broker or a worker, or one-way). The message text too: it tells the broker's refusals from a worker's."""
    try:
        envelope = strict(p.decode_envelope, frames)
        if envelope.command not in p.REQUEST_COMMANDS:
            message = f"{envelope.command.name} is not a client request"
            return p.ErrorCode.BAD_REQUEST.value, p.request_id_of(envelope.header), message
        strict(lambda _: p.parse(envelope), frames)
    except p.ProtocolError as e:
        return e.code.value, e.request_id, e.message[:MESSAGE_KEY_CHARS]
    return None


def forwarded_to(frames: Frames) -> bytes | None:
    """The client route the broker must forward a worker's message to, untouched; None when it drops it."""
    try:
        envelope = strict(p.decode_envelope, frames)
    except p.ProtocolError:
        return None
    if envelope.command not in (p.Command.REPLY, p.Command.CHUNKS, p.Command.CHUNK, p.Command.ERROR):
        return None
    if envelope.command is p.Command.CHUNKS:
        chunks = envelope.header.get("chunks")
        if not isinstance(chunks, list) or not chunks or envelope.payload:
            return None
    return p.route_of(envelope.header) or None


RoutedErrorKey = tuple[bytes, str, "str | None", str]  # an ErrorKey and the route it goes to


def worker_error(frames: Frames) -> RoutedErrorKey | None:
    """The error a worker must answer a broken request with: when its header names a valid route and request id."""
    try:
        strict(p.decode, frames)
    except p.ProtocolError as e:
        return (e.route, e.code.value, e.request_id, e.message[:MESSAGE_KEY_CHARS]) if e.route and e.request_id else None
    return None


def decodes(frames: Frames) -> p.Message | None:
    try:
        return strict(p.decode, frames)
    except p.ProtocolError:
        return None


def describe(message: p.Message | None, frames: Frames) -> str:
    """A counter key: ERROR:code, REPLY:kind, or the command."""
    if isinstance(message, p.Error):
        return f"ERROR:{message.code.value}"
    if message is None:
        return "undecodable"
    return f"REPLY:{message.KIND}" if message.KIND else message.COMMAND.name


# -- failures and reports ----------------------------------------------------------------------------------


class FuzzFailure(AssertionError):
    """A check failed: a process died, an answer is missing or malformed, or the good session was disturbed."""


@dataclass
class Report:
    """What one target's run did: cases sent, time taken, what came back, checks passed."""

    target: str
    cases: int = 0
    seconds: float = 0.0
    answers: Counter[str] = field(default_factory=Counter)
    checkpoints: int = 0
    good_rounds: int = 0
    notes: list[str] = field(default_factory=list)

    @property
    def rate(self) -> float:
        return self.cases / self.seconds if self.seconds > 0 else 0.0

    def errors_by_code(self) -> dict[str, int]:
        return {k.split(":", 1)[1]: v for k, v in sorted(self.answers.items()) if k.startswith("ERROR:")}


def show_frames(frames: Frames, limit: int = 160) -> str:
    return "[" + ", ".join(repr(f[:limit]) + (f"...({len(f)} bytes)" if len(f) > limit else "") for f in frames) + "]"


def tracebacks(daemon: Daemon, limit: int = 6000) -> str:
    """The tail of a daemon's log from its first traceback (or just the tail)."""
    text = daemon.log_text()
    at = text.find("Traceback")
    return text[at : at + limit] if at >= 0 else text[-limit // 3 :]


# -- the good session ----------------------------------------------------------------------------------------


class GoodSession:
    """A client of its own, in a thread: one session made before fuzzing, then forked and generated from, round
    after round, streamed and not, until stopped. Greedy decoding of a fixed model is deterministic, so every
    round's tokens must equal the ones before fuzzing began. Rounds need one free slot (the fork)."""

    def __init__(self, address: str, timeout_s: float = 30.0) -> None:
        self.address = address
        self.timeout_s = timeout_s
        self.route = b""
        self.session_id = ""
        self.expected: list[int] = []
        self.rounds = 0
        self.errors: list[str] = []
        self._ready = threading.Event()
        self._stop = threading.Event()
        self._pause = threading.Event()
        self._idle = threading.Event()
        self._progress = threading.Condition()
        self._thread = threading.Thread(target=self._run, name="good-session", daemon=True)

    def start(self) -> None:
        self._thread.start()
        if not self._ready.wait(self.timeout_s) or self.errors:
            raise FuzzFailure(f"the good session did not start: {self.errors}")

    def wait_rounds(self, more: int = 1) -> int:
        """Until `more` rounds have finished after this call (or a round failed); the rounds so far."""
        with self._progress:
            goal = self.rounds + more
            if not self._progress.wait_for(lambda: self.rounds >= goal or bool(self.errors), self.timeout_s):
                self.errors.append(f"no good round finished within {self.timeout_s} s")
        return self.rounds

    @contextmanager
    def paused(self) -> Iterator[None]:
        """Between rounds: the twin is closed and nothing of the good client is in flight."""
        self._pause.set()
        try:
            if self._thread.is_alive():
                self._idle.wait(self.timeout_s)
            yield
        finally:
            self._pause.clear()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.ident is not None:  # started
            self._thread.join(timeout=self.timeout_s)

    def _run(self) -> None:
        try:
            with Client(self.address, timeout=self.timeout_s) as client, client.session() as session:
                route = client._transport._socket.getsockopt(zmq.ROUTING_ID)
                assert isinstance(route, bytes)
                self.route = route
                self.session_id = session.id
                session.append(token_ids=list(GOOD_PROMPT))
                with session.fork() as first:
                    self.expected = first.generate(max_tokens=GOOD_TOKENS, ignore_eos=True).token_ids
                self._ready.set()
                while not self._stop.is_set():
                    if self._pause.is_set():
                        self._idle.set()
                        while self._pause.is_set() and not self._stop.is_set():
                            time.sleep(0.01)
                        self._idle.clear()
                        continue
                    self._round(session, stream=self.rounds % 2 == 1)
        except Exception as e:  # recorded, checked by the fuzzing loop
            self.errors.append(f"{type(e).__name__}: {e}")
        finally:
            self._ready.set()
            with self._progress:
                self._progress.notify_all()

    def _round(self, session: Session, stream: bool) -> None:
        with session.fork() as twin:
            if stream:
                got = [t for chunk in twin.generate(max_tokens=GOOD_TOKENS, ignore_eos=True, stream=True)
                       for t in chunk.token_ids]
            else:
                got = twin.generate(max_tokens=GOOD_TOKENS, ignore_eos=True).token_ids
        length = session.info().length
        if got != self.expected or length != len(GOOD_PROMPT):
            self.errors.append(f"round {self.rounds}: tokens {got} (expected {self.expected}), length {length}")
        with self._progress:
            self.rounds += 1
            self._progress.notify_all()


# -- targets -------------------------------------------------------------------------------------------------


class Target:
    """One thing under fuzz: `fire` sends a case, `checkpoint` checks everything (every `batch` cases), `finish`
    makes the final checks. A context manager: leaving it releases the target's sockets, pass or fail."""

    name = "target"

    def __init__(self, stack: FuzzStack, batch: int) -> None:
        self.stack = stack
        self.known = stack.known()
        self.batch = batch
        self.report = Report(self.name)
        self.failure: FuzzFailure | None = None
        self.created: set[str] = set()  # sessions the fuzz cases made (from the answers), closed before they pile up
        self._recent: list[Case] = []

    def strategy(self) -> st.SearchStrategy[Case]:
        raise NotImplementedError

    def fire(self, case: Case) -> None:
        if self.failure is not None:  # hypothesis replays a failing case: the live system has not healed since
            raise self.failure
        self._recent.append(case)
        for _ in range(case.times):
            self._send(case.frames, case.peer)
        if case.then is not None:
            self._send(case.then, case.peer)
        self.report.cases += 1
        self._pump(0)
        if len(self._recent) >= self.batch:
            self.checkpoint()
        elif len(self.created) >= SPARE_SESSIONS:  # keep a slot for the good session's fork
            self._close_created()

    def checkpoint(self) -> None:
        """Check everything, clean up what the cases left, start a new batch."""
        self._check()
        self._recent = []
        self.report.checkpoints += 1

    def finish(self) -> None:
        """A last checkpoint, then the target's final checks."""
        if self._recent:
            self.checkpoint()

    def release(self) -> None:
        """Close what the target opened, after `finish` or after a failure (on leaving the `with`)."""

    def __enter__(self: TargetT) -> TargetT:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    def _naming(self, answer: p.Error) -> str:
        """The cases of this batch whose frames name the answer's request id (the likely culprits)."""
        rid = (answer.request_id or "").encode()
        named = [c for c in self._recent if rid and any(rid in f for f in [*c.frames, *(c.then or [])])]
        return "".join(f"\n  sent as {show_frames(c.frames)}" + (f" then {show_frames(c.then)}" if c.then else "")
                       for c in named[-3:])

    def fail(self, what: str, daemons: Sequence[Daemon] = ()) -> FuzzFailure:
        """The failure to raise: the check, the batch's last cases, the daemons' tracebacks. Sticky (see fire)."""
        batch = "\n".join(f"  {show_frames(c.frames)} x{c.times} peer {c.peer}"
                          + (f" then {show_frames(c.then)}" if c.then else "") for c in self._recent[-40:])
        logs = "\n".join(f"--- {d.log.name} (alive: {d.alive}) ---\n{tracebacks(d)}" for d in daemons)
        self.failure = FuzzFailure(f"{self.name}: {what}\nlast cases of the batch:\n{batch}\n{logs}")
        return self.failure

    def _send(self, frames: Frames, peer: int) -> None:
        raise NotImplementedError

    def _pump(self, timeout_ms: int) -> None:
        raise NotImplementedError

    def _check(self) -> None:
        raise NotImplementedError

    def _close_created(self) -> None:
        """Close the sessions the fuzz cases made; remember a few as stale ids to address."""
        for sid in sorted(self.created):
            self._close_session(sid)
        self.known.stale[:] = sorted(self.created)[-8:] or self.known.stale
        self.created.clear()

    def _close_session(self, sid: str) -> None:
        raise NotImplementedError

    def _wait(self, done: Callable[[], bool], timeout_s: float = ANSWER_WAIT_S) -> bool:
        deadline = time.monotonic() + timeout_s
        while not done():
            if time.monotonic() > deadline:
                return False
            self._pump(20)
        return True


def _dealer(context: zmq.Context[zmq.Socket[bytes]], address: str, identity: bytes) -> zmq.Socket[bytes]:
    sock: zmq.Socket[bytes] = context.socket(zmq.DEALER)
    sock.setsockopt(zmq.ROUTING_ID, identity)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDHWM, 0)
    sock.setsockopt(zmq.RCVHWM, 0)
    sock.connect(address)
    return sock


def _recv_all(sock: zmq.Socket[bytes], timeout_ms: int) -> list[Frames]:
    out: list[Frames] = []
    if not sock.poll(timeout_ms, zmq.POLLIN):
        return out
    while True:
        try:
            out.append(sock.recv_multipart(zmq.NOBLOCK))
        except zmq.Again:
            return out


class ClientSocket(Target):
    """The broker's client socket. Every message the protocol rejects must come back as its typed error; valid
    requests run on the real worker. The fuzzer's own sessions are closed at every checkpoint and the other
    client's sessions it addresses (victims) made again, so that capacity never runs out."""

    name = "broker client socket"

    def __init__(self, stack: FuzzStack, batch: int) -> None:
        super().__init__(stack, batch)
        self.context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        self.route = b"fz" + uuid.uuid4().bytes
        self.sock = _dealer(self.context, stack.cluster.clients, self.route)
        self.victim_client = stack.cluster.client()
        self.expected: Counter[ErrorKey] = Counter()
        self.errors: Counter[ErrorKey] = Counter()
        self.known.routes[:] = [self.route, stack.good.route]
        try:
            self._renew_victims()
        except BaseException:
            self.release()
            raise

    def strategy(self) -> st.SearchStrategy[Case]:
        return client_cases(self.known)

    def _send(self, frames: Frames, peer: int) -> None:
        self.sock.send_multipart(frames)
        expected = client_error(frames)
        if expected is not None:
            self.expected[expected] += 1

    def _pump(self, timeout_ms: int) -> None:
        for frames in _recv_all(self.sock, timeout_ms):
            message = decodes(frames)
            self.report.answers[describe(message, frames)] += 1
            if message is None:
                self.report.notes.append(f"undecodable answer from the broker: {show_frames(frames)}")
            elif isinstance(message, p.Error):
                self.errors[message.code.value, message.request_id, message.message[:MESSAGE_KEY_CHARS]] += 1
                if message.code is p.ErrorCode.INTERNAL:
                    self.report.notes.append(f"an internal error answers a fuzz case: {message}{self._naming(message)}")
            elif isinstance(message, p.Created):
                self.created.add(message.session_id)
            elif isinstance(message, p.Forked):
                self.created.add(message.child_id)

    def _check(self) -> None:
        if not self._wait(lambda: not (self.expected - self.errors)):
            missing = dict((self.expected - self.errors).most_common(8))
            raise self.fail(f"errors never answered (code, request id, message): {missing}", self.stack.daemons())
        self.errors.clear()  # the rest are a worker's refusals of valid requests
        self.expected.clear()
        if self.report.notes:
            raise self.fail(self.report.notes[0], self.stack.daemons())
        self.stack.check_alive(self)
        self.stack.check_good(self)
        self._cleanup()

    def _cleanup(self) -> None:
        self._close_created()
        self._renew_victims()

    def _renew_victims(self) -> None:
        for sid in list(self.known.sessions):
            self._close_session(sid)
        fresh = []
        for _ in range(VICTIMS):
            try:
                session = self.victim_client.session()
                session.append(token_ids=list(GOOD_PROMPT))
            except ClientError as e:
                raise self.fail(f"a victim session could not be made: {e.code}: {e}", self.stack.daemons()) from e
            fresh.append(session.id)
        self.known.sessions[:] = fresh

    def _close_session(self, sid: str) -> None:
        try:
            self.victim_client.attach(sid).close()
        except ClientError:
            pass  # already closed by a fuzz case

    def finish(self) -> None:
        """Close every session the fuzzer made or touched: then the broker must count the good session alone."""
        super().finish()
        self._wait(lambda: False, 0.3)  # late answers: creates that finished after the last checkpoint
        self._cleanup()
        for sid in self.known.sessions:
            self._close_session(sid)
        self.known.sessions[:] = [uuid.uuid4().hex]
        with self.stack.good.paused():
            self.stack.check_accounting(self)

    def release(self) -> None:
        self.victim_client.close()
        self.sock.close(linger=0)
        self.context.term()


class WorkerSocket(Target):
    """The broker's worker socket, from fake workers. A valid READY is welcomed; an answer routed to a real client
    (the bystander, a DEALER on the client socket) arrives there untouched; everything the broker sends decodes.
    A fake that registers is a legitimate peer (no auth) and may be chosen for a new session: during every batch
    the bystander has one CREATE in flight, and it must be answered (created on the real worker, or an error once
    the fake that got it leaves or falls silent). The good session lives on the real worker from before and must
    not notice."""

    name = "broker worker socket"
    PEERS = 3

    def __init__(self, stack: FuzzStack, batch: int) -> None:
        super().__init__(stack, batch)
        self.context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        self.fakes = [
            _dealer(self.context, stack.cluster.workers_address, f"fake{i}-{uuid.uuid4().hex[:8]}".encode())
            for i in range(self.PEERS)
        ]
        self.bystander_route = b"by" + uuid.uuid4().bytes
        self.bystander = _dealer(self.context, stack.cluster.clients, self.bystander_route)
        try:
            self._connect_bystander()
        except BaseException:
            self.release()
            raise
        self.known.routes[:] = [self.bystander_route, stack.good.route]
        self.known.sessions[:] = [stack.good.session_id]  # the good session is held by the real worker
        self.welcomes_expected = [0] * self.PEERS
        self.welcomes = [0] * self.PEERS
        self.forward_expected: Counter[tuple[bytes, ...]] = Counter()
        self.forwarded: Counter[tuple[bytes, ...]] = Counter()
        self.own: dict[str, p.Message | None] = {}  # the bystander's own requests -> their answers
        self.create_id = self._start_create()

    def strategy(self) -> st.SearchStrategy[Case]:
        return worker_socket_cases(self.known, self.PEERS)

    def _connect_bystander(self) -> None:
        """A ROUTER knows a peer only once it has sent something: a STATUS, and its answer."""
        self.bystander.send_multipart(p.encode(p.Status(request_id="hello")))
        if not self.bystander.poll(10_000, zmq.POLLIN):
            raise FuzzFailure("the broker does not answer STATUS")
        self.bystander.recv_multipart()

    def _send(self, frames: Frames, peer: int) -> None:
        self.fakes[peer].send_multipart(frames)
        message = decodes(frames)
        if isinstance(message, p.Ready):
            self.welcomes_expected[peer] += 1
        if forwarded_to(frames) == self.bystander_route:
            self.forward_expected[tuple(frames)] += 1

    def _pump(self, timeout_ms: int) -> None:
        for i, fake in enumerate(self.fakes):
            for frames in _recv_all(fake, timeout_ms if i == 0 else 0):
                message = decodes(frames)
                self.report.answers[describe(message, frames)] += 1
                if not isinstance(message, (p.Welcome, p.Reconnect, p.Heartbeat, *p.REQUEST_TYPES)):
                    self.report.notes.append(f"fake worker {i} got {show_frames(frames)}")
                if isinstance(message, p.Welcome):
                    self.welcomes[i] += 1
        for frames in _recv_all(self.bystander, 0):
            rid = getattr(decodes(frames), "request_id", None)
            if rid in self.own:
                self.own[rid] = decodes(frames)
            else:
                self.forwarded[tuple(frames)] += 1
                self.report.answers["forwarded"] += 1

    def _check(self) -> None:
        done = self._wait(lambda: self.welcomes == self.welcomes_expected and not (self.forward_expected - self.forwarded))
        if not done:
            missing = [show_frames(list(f)) for f in (self.forward_expected - self.forwarded)][:5]
            raise self.fail(f"welcomes {self.welcomes} (expected {self.welcomes_expected}); "
                            f"answers not forwarded to the bystander: {missing}", self.stack.daemons())
        self._pump(50)
        extra = self.forwarded - self.forward_expected
        if extra or self.welcomes != self.welcomes_expected:
            raise self.fail(f"unexpected: forwarded {[show_frames(list(f)) for f in extra][:5]}, "
                            f"welcomes {self.welcomes} (expected {self.welcomes_expected})", self.stack.daemons())
        self.forwarded.clear()
        self.forward_expected.clear()
        if self.report.notes:
            raise self.fail(self.report.notes[0], self.stack.daemons())
        self.stack.check_alive(self)
        self.stack.check_good(self)
        self._settle_create()
        self.create_id = self._start_create()

    def _start_create(self) -> str:
        """The bystander's CREATE for the next batch: placed on the real worker or on a fake, answered later."""
        request = p.CreateSession(request_id=uuid.uuid4().hex)
        self.own[request.request_id] = None
        self.bystander.send_multipart(p.encode(request))
        return request.request_id

    def _settle_create(self) -> None:
        created = self._answer_to(self.create_id, "CREATE")
        if isinstance(created, p.Created):
            close = p.Close(request_id=uuid.uuid4().hex, session_id=created.session_id)
            self.own[close.request_id] = None
            self.bystander.send_multipart(p.encode(close))
            self._answer_to(close.request_id, "CLOSE")

    def _answer_to(self, request_id: str, what: str) -> p.Message:
        """The final answer to a request of the bystander's own, whichever worker (real or fake) it went to."""
        if not self._wait(lambda: self.own[request_id] is not None):
            raise self.fail(f"the bystander's {what} {request_id} was never answered", self.stack.daemons())
        answer = self.own.pop(request_id)
        assert answer is not None
        self.report.answers[f"bystander {describe(answer, [])}"] += 1
        return answer

    def finish(self) -> None:
        """The fakes fall silent: the broker must forget them and list the real worker alone."""
        super().finish()
        self._settle_create()
        self.stack.check_workers(self, {self.stack.worker_name})

    def release(self) -> None:
        for sock in (*self.fakes, self.bystander):
            sock.close(linger=0)
        self.context.term()


class WorkerLink(Target):
    """A real worker process driven by a fake broker (a ROUTER the worker connects to). A broken request whose
    header names a route and a request id is answered with its error; everything the worker sends decodes; it keeps
    heartbeating and registering; between batches a good session on it generates the tokens it did before."""

    name = "worker link"
    BROKER_ID = "fuzzbroker"
    GOOD_ROUTE = b"good"
    JANITOR_ROUTE = b"janitor"

    def __init__(self, stack: FuzzStack, batch: int) -> None:
        super().__init__(stack, batch)
        self.daemon = stack.lone
        self.sock = stack.lone_router
        self.identity = b""
        self.last_beat = 0.0
        self._next_beat = 0.0
        self._seq = 0
        self._mail: dict[tuple[bytes, str], list[p.Message]] = {}
        self.expected: Counter[RoutedErrorKey] = Counter()
        self.errors: Counter[RoutedErrorKey] = Counter()
        self.known.routes[:] = [b"fz-a", b"fz-b", self.GOOD_ROUTE]
        self.known.names[:] = [stack.lone_name]
        if not self._wait(lambda: bool(self.identity), 60.0):
            raise self.fail("the worker never sent READY", [self.daemon])
        self.good_session = uuid.uuid4().hex
        self._call(p.CreateSession(request_id=self._rid(), session_id=self.good_session), p.Created)
        self._call(p.Append(request_id=self._rid(), session_id=self.good_session, token_ids=GOOD_PROMPT), p.Appended)
        self.expected_tokens, _ = self._good_round(stream=False)
        self.known.sessions[:] = self._victims()

    def strategy(self) -> st.SearchStrategy[Case]:
        return worker_link_cases(self.known)

    # -- the fake broker --

    def _rid(self) -> str:
        self._seq += 1
        return f"fuzzbroker-{self._seq}"

    def _to_worker(self, frames: Frames) -> None:
        try:
            self.sock.send_multipart([self.identity, *frames], zmq.NOBLOCK)
        except zmq.ZMQError as e:
            raise self.fail(f"the worker cannot be reached ({e})", [self.daemon]) from e

    def _send(self, frames: Frames, peer: int) -> None:
        self._to_worker(frames)
        expected = worker_error(frames)
        if expected is not None:
            self.expected[expected] += 1

    def _pump(self, timeout_ms: int) -> None:
        now = time.monotonic()
        if self.identity and now >= self._next_beat:
            self._to_worker(p.encode(p.Heartbeat(broker_id=self.BROKER_ID)))
            self._next_beat = now + HEARTBEAT_MS / 1000
        for identity, *frames in _recv_all(self.sock, timeout_ms):
            message = decodes(frames)
            self.report.answers[describe(message, frames)] += 1
            if message is None:
                self.report.notes.append(f"undecodable message from the worker: {show_frames(frames)}")
                continue
            if isinstance(message, p.Ready):
                self.identity = identity
                self._welcome()
            elif isinstance(message, p.Heartbeat):
                self.last_beat = time.monotonic()
            route: bytes = getattr(message, "route", b"")
            if isinstance(message, p.Error):
                self.errors[message.route, message.code.value, message.request_id, message.message[:MESSAGE_KEY_CHARS]] += 1
                if message.code is p.ErrorCode.INTERNAL:  # bad input gets a typed error, never "internal"
                    self.report.notes.append(f"an internal error answers a fuzz case: {message}{self._naming(message)}")
            ours = route in (self.GOOD_ROUTE, self.JANITOR_ROUTE)  # fuzz cases may use the good route too: no matter
            if isinstance(message, p.Created) and not ours:
                self.created.add(message.session_id)
            elif isinstance(message, p.Forked) and not ours:
                self.created.add(message.child_id)
            rid = getattr(message, "request_id", None)
            if isinstance(message, p.Chunks):
                for chunk in message.chunks:
                    self._deliver((route, chunk.request_id), message)
            elif rid is not None:
                self._deliver((route, rid), message)

    def _deliver(self, key: tuple[bytes, str], message: p.Message) -> None:
        """Into the mailbox of a call of ours (the good session's and the janitor's requests)."""
        box = self._mail.get(key)
        if box is not None:
            box.append(message)

    def _welcome(self) -> None:
        self._to_worker(p.encode(p.Welcome(broker_id=self.BROKER_ID, heartbeat_ms=HEARTBEAT_MS, liveness=3)))

    def _call(self, request: p.Message, kind: type[p.Message], route: bytes = GOOD_ROUTE) -> p.Message:
        """Send a request as the broker would and wait for its final answer."""
        rid: str = request.request_id  # type: ignore[attr-defined]  # every request has one
        self._mail[route, rid] = []
        self._to_worker(p.encode(request.routed(route)))
        box = self._mail[route, rid]

        def final() -> bool:
            return any(not isinstance(m, p.Chunks) for m in box)

        if not self._wait(final):
            raise self.fail(f"no answer to {request}", [self.daemon])
        answer = next(m for m in box if not isinstance(m, p.Chunks))
        if not any(isinstance(m, p.Chunks) for m in box):
            del self._mail[route, rid]
        if not isinstance(answer, kind):
            raise self.fail(f"{type(request).__name__} got {answer}, expected {kind.__name__}", [self.daemon])
        return answer

    def _good_round(self, stream: bool) -> tuple[list[int], list[int]]:
        """Fork the good session, generate from the fork, close it: (final tokens, streamed tokens)."""
        child = uuid.uuid4().hex
        self._call(p.Fork(request_id=self._rid(), session_id=self.good_session, child_id=child), p.Forked)
        rid = self._rid()
        params = p.Sampling(max_tokens=GOOD_TOKENS, ignore_eos=True)
        answer = self._call(p.Generate(request_id=rid, session_id=child, params=params, stream=stream), p.Generated)
        streamed = [t for m in self._mail.pop((self.GOOD_ROUTE, rid), []) if isinstance(m, p.Chunks)
                    for c in m.chunks if c.request_id == rid for t in c.token_ids]
        self._call(p.Close(request_id=self._rid(), session_id=child), p.Closed)
        assert isinstance(answer, p.Generated)
        return list(answer.token_ids), streamed

    def _victims(self) -> list[str]:
        fresh = [uuid.uuid4().hex for _ in range(VICTIMS)]
        for sid in fresh:
            self._call(p.CreateSession(request_id=self._rid(), session_id=sid), p.Created, self.JANITOR_ROUTE)
            self._call(p.Append(request_id=self._rid(), session_id=sid, token_ids=GOOD_PROMPT), p.Appended,
                       self.JANITOR_ROUTE)
        return fresh

    def _close_session(self, sid: str) -> None:
        self._call(p.Close(request_id=self._rid(), session_id=sid), p.Message, self.JANITOR_ROUTE)

    # -- checks --

    def _check(self) -> None:
        if not self._wait(lambda: not (self.expected - self.errors)):
            missing = dict((self.expected - self.errors).most_common(5))
            raise self.fail(f"errors never answered (route, code, request id, message): {missing}", [self.daemon])
        self.errors.clear()  # the rest are refusals of valid requests
        self.expected.clear()
        if self.report.notes:
            raise self.fail(self.report.notes[0], [self.daemon])
        if not self.daemon.alive:
            raise self.fail("the worker died", [self.daemon])
        restored = time.monotonic()
        self._welcome()  # a fuzzed WELCOME may have changed its heartbeat: set it back
        final, streamed = self._good_round(stream=self.report.checkpoints % 2 == 1)
        # The last step's token comes in the final answer only: the streamed ones are a prefix of it.
        if final != self.expected_tokens or streamed != final[: len(streamed)]:
            raise self.fail(f"good session: tokens {final}, streamed {streamed}, expected {self.expected_tokens}",
                            [self.daemon])
        self.report.good_rounds += 1
        if not self._wait(lambda: self.last_beat > restored, 5.0):
            raise self.fail("the worker stopped heartbeating", [self.daemon])
        self._cleanup()

    def _cleanup(self) -> None:
        self._wait(lambda: False, 0.05)
        self._close_created()
        for sid in self.known.sessions:
            self._close_session(sid)
        self.known.sessions[:] = self._victims()

    def finish(self) -> None:
        """The victims closed, the good session must hold its prompt alone, idle."""
        super().finish()
        for sid in self.known.sessions:
            self._close_session(sid)
        info = self._call(p.Info(request_id=self._rid(), session_id=self.good_session), p.SessionInfo)
        assert isinstance(info, p.SessionInfo)
        if info.length != len(GOOD_PROMPT) or info.busy:
            raise self.fail(f"the good session changed: {info}", [self.daemon])


# -- the processes -------------------------------------------------------------------------------------------


class FuzzStack:
    """A broker and a random:tiny worker on the CPU (the client and worker socket targets), a good session on that
    worker, and a second worker connected to a ROUTER of ours (the worker link target). `close()` stops them all."""

    MODEL = "random:tiny"
    MODEL_NAME = "random-tiny"
    VOCAB = 512
    MAX_SESSIONS = 64
    MAX_CONTEXT = 256

    def __init__(self, tmp: Path) -> None:
        self.cluster = Cluster(tmp, heartbeat_ms=HEARTBEAT_MS)
        self.worker_name = "w1"
        self.lone_name = "lone"
        self.context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        self.lone_router: zmq.Socket[bytes] = self.context.socket(zmq.ROUTER)
        self.lone_router.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self.lone_router.setsockopt(zmq.ROUTER_HANDOVER, 1)
        self.lone_router.setsockopt(zmq.LINGER, 0)
        self.lone_port = free_port()
        self.lone_router.bind(f"tcp://127.0.0.1:{self.lone_port}")
        self.good = GoodSession(self.cluster.clients)
        self.lone: Daemon
        try:
            self.cluster.start_broker()
            self.cluster.start_worker(self.worker_name, model=self.MODEL, max_sessions=self.MAX_SESSIONS,
                                      max_context=self.MAX_CONTEXT)
            self.lone = Daemon(
                "worker.cli",
                ["--broker", f"tcp://127.0.0.1:{self.lone_port}", "--model", self.MODEL, "--device", "cpu",
                 "--name", self.lone_name, "--max-sessions", str(self.MAX_SESSIONS), "--max-context",
                 str(self.MAX_CONTEXT), "--reconnect-max-ms", "200"],
                tmp / "worker-lone.log",
            )
            self.cluster.wait_for_workers({self.worker_name})
            self.good.start()
        except BaseException:
            self.close()
            raise

    def known(self) -> Known:
        return Known(self.MODEL_NAME, self.VOCAB, [uuid.uuid4().hex], names=[self.worker_name])

    def daemons(self) -> list[Daemon]:
        assert self.cluster.broker is not None
        return [self.cluster.broker, *self.cluster.workers.values()]

    def check_alive(self, target: Target) -> None:
        dead = [d for d in self.daemons() if not d.alive]
        if dead:
            raise target.fail(f"a process died: {[d.log.name for d in dead]}", self.daemons())

    def check_good(self, target: Target) -> None:
        """The good session made at least one more round since the last check, every one of them right."""
        rounds = self.good.wait_rounds()
        target.report.good_rounds = rounds
        if self.good.errors:
            raise target.fail(f"the good session was disturbed: {self.good.errors[:3]}", self.daemons())

    def status(self) -> list[Any]:
        with self.cluster.client(timeout=5.0) as c:
            return c.status()

    def check_accounting(self, target: Target) -> None:
        """With nothing in flight, the broker counts exactly the sessions that exist: the good one alone."""
        deadline = time.monotonic() + ANSWER_WAIT_S
        while True:
            workers = self.status()
            mine = [w for w in workers if w.name == self.worker_name]
            if mine and mine[0].sessions == 1 and mine[0].free_slots == mine[0].capacity - 1:
                return
            if time.monotonic() > deadline:
                raise target.fail(f"the broker's accounting did not return to baseline (1 session, capacity - 1 free): "
                                  f"{workers}", self.daemons())
            time.sleep(0.05)

    def check_workers(self, target: Target, names: set[str]) -> None:
        try:
            self.cluster.wait_for_workers(names, timeout=ANSWER_WAIT_S)
        except (TimeoutError, RuntimeError) as e:
            raise target.fail(str(e), self.daemons()) from e

    def close(self) -> None:
        self.good.stop()
        self.cluster.close()
        if hasattr(self, "lone"):
            self.lone.close()
        self.lone_router.close(linger=0)
        self.context.term()


TARGETS: dict[str, type[Target]] = {"client": ClientSocket, "worker-socket": WorkerSocket, "worker-link": WorkerLink}


def fuzz_settings(cases: int) -> settings:
    """No shrinking (a case changes live daemons: replaying a smaller one proves nothing), no database, no deadline."""
    return settings(
        max_examples=cases, deadline=None, database=None, phases=[Phase.generate],
        suppress_health_check=list(HealthCheck),
    )


def drive(target: Target, cases: int, seed: int) -> Report:
    """Fire `cases` hypothesis-drawn cases at the target (checkpoint every batch), finish and release it."""
    started = time.monotonic()

    @fuzz_settings(cases)
    @given(target.strategy())
    def one(case: Case) -> None:
        target.fire(case)

    with target:
        hypothesis_seed(seed)(one)()
        target.finish()
    target.report.seconds = time.monotonic() - started
    return target.report


def run_all(tmp: Path, cases: int, seed: int, batch: int, names: Sequence[str] = tuple(TARGETS),
            progress: Callable[[Report], None] | None = None) -> Iterator[Report]:
    """One stack, each named target in turn; yields each target's report as it finishes."""
    stack = FuzzStack(tmp)
    try:
        for name in names:
            target = TARGETS[name](stack, batch)
            report = drive(target, cases, seed)
            if progress is not None:
                progress(report)
            yield report
        dead = [d.log.name for d in [*stack.daemons(), stack.lone] if not d.alive]
        if dead:
            raise FuzzFailure(f"processes died: {dead}")
    finally:
        stack.close()
