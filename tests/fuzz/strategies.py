"""What the fuzzer sends: hypothesis strategies for values, valid messages of every command, their mutations (header
fields, header bytes, frames), and the cases each target fires."""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import msgpack
from hypothesis import strategies as st

from broker.common import protocol as p
from broker.common.fields import field_names

T = TypeVar("T")
Frames = list[bytes]

REQUEST_ID_POOL = tuple(f"f{i}" for i in range(8))  # a small pool, so that request ids collide on purpose

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
        st.builds(p.Sessions, request_id=rid, route=route),
    )


def answers(known: Known) -> st.SearchStrategy[p.Message]:
    """Valid worker answers (REPLY of every kind, CHUNKS, ERROR) addressed to real clients' routes."""
    rid = request_ids()
    sid = session_ids(known)
    route = routes(known)
    text = st.text(max_size=24)
    ids = st.lists(token_ids(known), max_size=8).map(tuple)
    # no log-probabilities (valid ones need one per token)
    chunk = st.builds(p.StreamChunk, rid, ids, text, st.integers(0, p.MAX_TOKENS), st.just(()))
    worker_status = st.builds(p.WorkerStatus, names(known), names(known), counts(), counts(), counts(), st.booleans(), text)
    session_entry = st.builds(p.SessionEntry, sid, names(known), owners_, st.none() | counts(), counts(),
                              st.sampled_from(sorted(p.CLIENT_STATES)), counts())
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
        st.builds(p.SessionList, request_id=rid, sessions=st.lists(session_entry, max_size=2).map(tuple),
                  total=counts(), route=route),
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
        st.builds(p.Drop, sessions=st.lists(session_ids(known), max_size=3).map(tuple)),
        st.builds(p.Lease, broker_id=request_ids()),
    )


# -- mutations -----------------------------------------------------------------------------------------------

FIELD_NAMES = sorted(
    {"kind"}
    | {
        name
        for cls in (*p.REQUEST_TYPES, *p.REPLY_KINDS.values(), p.Chunks, p.Fanout, p.Error, p.Ready, p.Welcome,
                    p.Heartbeat, p.Reconnect, p.Disconnect, p.Drop, p.Lease, p.Sampling, p.WorkerStatus,
                    p.SessionEntry)
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


# -- hostile peers on the broker's worker socket --------------------------------------------------------------


def bad_parts(known: Known) -> st.SearchStrategy[bytes]:
    """FANOUT parts that are no CHUNKS header: not msgpack, not a map, a map without a list of chunks, nothing."""
    return st.one_of(
        st.sampled_from([b"\xc1", b"", b"\x91\x01", b"\xa5hello", pack([1, 2]), pack({"chunks": "x"}),
                         pack({"chunks": []}), pack({"route": b"x"}), pack({"chunks": [{"request_id": 5}]})]),
        st.binary(max_size=32), msgpack_values.map(pack),
    )


def good_parts(known: Known) -> st.SearchStrategy[bytes]:
    chunk = st.builds(p.StreamChunk, request_ids(), st.lists(token_ids(known), max_size=4).map(tuple), st.text(max_size=8),
                      st.integers(0, 4096), st.just(()))
    return st.lists(chunk, min_size=1, max_size=3).map(p.chunks_part)


@st.composite
def fanouts(draw: st.DrawFn, known: Known) -> Frames:
    """A FANOUT of 1-4 parts, good or bad, for real clients' routes and routes nobody has."""
    n = draw(st.integers(1, 4))
    routes = [draw(routes_or_strangers(known)) for _ in range(n)]
    parts = [draw(good_parts(known) | bad_parts(known)) for _ in range(n)]
    return [p.VERSION, p.Command.FANOUT.value, pack({"routes": routes, "parts": parts})]


def routes_or_strangers(known: Known) -> st.SearchStrategy[bytes]:
    return pick(known.routes) | st.binary(min_size=1, max_size=p.MAX_ROUTE_BYTES) | st.sampled_from([b"nobody", b"\x00lease"])


def oversized_readies(max_sessions: int) -> list[Frames]:
    """READYs a broker taking at most `max_sessions` sessions per worker refuses, each answered with an ERROR: longer
    than that many sessions take (50k session ids, 1.7 MB; a name of 1.5M characters), more slots than it takes,
    more sessions than slots, a session twice. Built once (they are big): hypothesis picks among them. (The issue's
    200k ids, 6.8 MB, are sent by tests/integration/test_hostile_peers.py, with the broker's default heartbeats:
    ZeroMQ counts a message toward a connection's liveness once it has all arrived.)"""
    def ready(**fields: Any) -> Frames:
        header = {"name": "huge", "model": "random-tiny", "capacity": 1, "free_slots": 1, "max_context": 64, **fields}
        return [p.VERSION, p.Command.READY.value, pack(header)]

    sids = [f"{i:032x}" for i in range(50_000)]
    return [
        ready(capacity=50_000, sessions=sids),
        ready(name="n" * 1_500_000),
        ready(capacity=max_sessions + 1),
        ready(capacity=2, sessions=sids[:3]),
        ready(capacity=4, sessions=[sids[0], sids[0]]),
    ]


def hostile_cases(known: Known, peers: int, oversized: list[Frames]) -> st.SearchStrategy[Case]:
    """For the broker's worker socket from hostile peers: peer 0 is registered and sends FANOUTs of every kind and
    answers; the others never register and send answers, FANOUTs, oversized READYs, heartbeats and garbage."""
    registered = st.one_of(fanouts(known), fanouts(known), (answers(known)).map(p.encode), mutated(answers(known), known))
    strangers = st.one_of(
        fanouts(known), answers(known).map(p.encode), mutated(answers(known), known), st.sampled_from(oversized),
        st.sampled_from(oversized), controls(known).map(p.encode), random_frames(),
    )
    return st.one_of(
        st.builds(Case, frames=registered, times=st.sampled_from([1, 1, 2]), peer=st.just(0)),
        st.builds(Case, frames=strangers, times=st.sampled_from([1, 1, 2]), peer=st.integers(1, peers - 1)),
    )
