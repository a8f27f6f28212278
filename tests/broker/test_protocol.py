"""The wire format: every message round-trips, every bad field is a typed ProtocolError, garbage never crashes."""

from __future__ import annotations

from typing import Any

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from broker.common import protocol as p

SID = "0123456789abcdef0123456789abcdef"
SID2 = "fedcba9876543210fedcba9876543210"

EXAMPLES: list[p.Message] = [
    p.CreateSession(request_id="r1"),
    p.CreateSession(request_id="r1", model="m", session_id=SID, route=b"c1"),
    p.Append(request_id="r2", session_id=SID, token_ids=(1, 2, 3)),
    p.Append(request_id="r2", session_id=SID, text="héllo"),
    p.Append(request_id="r2", session_id=SID, text="héllo", boundary_check=True),
    p.Chat(request_id="r3", session_id=SID, content="hi", role="system"),
    p.Generate(request_id="r4", session_id=SID, params=p.Sampling(max_tokens=9, temperature=0.7, top_p=0.9, top_k=5,
                                                                   seed=7, stop=("\n",), stop_token_ids=(2,)),
               stream=True, route=b"c1"),
    p.Generate(request_id="r4", session_id=SID, prompt_ids=(1, 2, 3)),
    p.Generate(request_id="r4", session_id=SID, tools='[{"type":"function","function":{"name":"f"}}]', messages=(
        p.ChatMessage("user", "q"), p.ChatMessage("assistant", "", (p.ToolCall("call_1", "f", '{"x": 1}'),)),
        p.ChatMessage("tool", "42", tool_call_id="call_1")), from_start=True),
    p.Generate(request_id="r4", session_id=SID, params=p.Sampling(
        logit_bias=(p.LogitBias(5, -100.0), p.LogitBias(9, 2.5)), repetition_penalty=1.2, frequency_penalty=-0.5,
        presence_penalty=2.0)),
    p.Generate(request_id="r4", session_id=SID, prompt="héllo", stream=True),
    p.Generate(request_id="r4", session_id=SID, prompt="héllo", boundary_check=True),
    p.Generate(request_id="r4", session_id=SID, messages=(p.ChatMessage(role="system", content="héllo"),), stream=True,
               resume=12),
    p.Generate(request_id="r4", session_id=SID, messages=(p.ChatMessage(role="user", content="hi"),), boundary_check=True,
               template_args=(p.TemplateArg("enable_thinking", False), p.TemplateArg("n", 2), p.TemplateArg("s", "x"),
                              p.TemplateArg("f", 0.5), p.TemplateArg("none", None))),
    p.Fork(request_id="r5", session_id=SID, child_id=SID2),
    p.Close(request_id="r6", session_id=SID),
    p.Info(request_id="r7", session_id=SID),
    p.Cancel(request_id="r8", session_id=SID, target="r4"),
    p.Status(request_id="r9"),
    p.Created(request_id="r1", session_id=SID, model="m", worker="w", max_context=2048, route=b"c1"),
    p.Appended(request_id="r2", session_id=SID, length=3),
    p.Generated(request_id="r4", session_id=SID, token_ids=(4, 5), text="ab", finish_reason="stop", length=5),
    p.Generated(request_id="r4", session_id=SID, token_ids=(4, 5), text="ab", finish_reason="length", length=10, appended=3),
    p.Forked(request_id="r5", session_id=SID, child_id=SID2, length=5, worker="w"),
    p.Closed(request_id="r6", session_id=SID),
    p.SessionInfo(request_id="r7", session_id=SID, length=5, model="m", worker="w", max_context=64, busy=True),
    p.StatusReport(request_id="r9", broker_id="b1", workers=(p.WorkerStatus("w", "m", 4, 3, 1, True, "cpu"),)),
    p.StatusReport(request_id="r9", broker_id="b1", workers=(p.WorkerStatus(
        "w", "m", 4, 3, 1, sampling_defaults=p.SamplingDefaults(temperature=0.6, top_k=20, max_tokens=512)),)),
    p.Chunks(chunks=(p.StreamChunk("r4", (4,), "a", 7), p.StreamChunk("r5", (), "é"), p.StreamChunk("r6", (1, 2), "")),
             route=b"c1"),
    p.Chunks(chunks=(p.StreamChunk("r4", (4,), "a"),)),
    p.Fanout(routes=(b"c1", b"c2"), parts=(p.chunks_part((p.StreamChunk("r4", (4,), "a"),)), b"\x80")),
    p.Error(request_id="r4", code=p.ErrorCode.SESSION_LOST, message="gone"),
    p.Error(request_id="r2", code=p.ErrorCode.PROMPT_BOUNDARY, message="merges"),
    p.Error(request_id=None, code=p.ErrorCode.VERSION_MISMATCH),
    p.Ready(name="w", model="m", capacity=4, free_slots=3, max_context=64, sessions=(SID,), draining=False, device="cpu"),
    p.Ready(name="w", model="m", capacity=4, free_slots=4, max_context=64, sampling_defaults=p.SamplingDefaults(
        temperature=0.7, top_p=0.8, top_k=20, min_p=0.05, repetition_penalty=1.05, max_tokens=2048)),
    p.Welcome(broker_id="b1", heartbeat_ms=100, liveness=3),
    p.Heartbeat(broker_id="b1"),
    p.Heartbeat(free_slots=3, sessions=1, draining=True),
    p.Reconnect(broker_id="b1"),
    p.Disconnect(reason="drained"),
]


@pytest.mark.parametrize("message", EXAMPLES, ids=lambda m: type(m).__name__)
def test_every_message_round_trips(message: p.Message) -> None:
    frames = p.encode(message)
    assert frames[0] == p.VERSION and frames[1] == message.COMMAND.value and len(frames) == 3
    assert p.decode(frames) == message


def test_the_error_codes_are_the_designed_ones() -> None:
    assert {c.value for c in p.ErrorCode} == {
        "bad_request", "capacity_exhausted", "session_not_found", "session_lost", "model_not_found", "timeout",
        "worker_draining", "unauthorized", "version_mismatch", "internal", "session_expired", "prompt_boundary",
        "overloaded",
    }


def frames(command: bytes, header: Any) -> list[bytes]:
    return [p.VERSION, command, msgpack.packb(header)]


@pytest.mark.parametrize(
    ("command", "header", "complaint"),
    [
        (b"CREATE", {}, "missing field request_id"),
        (b"CREATE", {"request_id": ""}, "request_id is malformed"),
        (b"CREATE", {"request_id": "a b"}, "request_id is malformed"),
        (b"CREATE", {"request_id": "r", "model": 3}, "model must be a string"),
        (b"APPEND", {"request_id": "r", "session_id": "abc", "text": "x"}, "session_id is malformed"),
        (b"APPEND", {"request_id": "r", "session_id": SID}, "exactly one of token_ids or text"),
        (b"APPEND", {"request_id": "r", "session_id": SID, "token_ids": [1], "text": "x"}, "exactly one"),
        (b"APPEND", {"request_id": "r", "session_id": SID, "token_ids": [1, -2]}, "token_ids must hold integers"),
        (b"APPEND", {"request_id": "r", "session_id": SID, "token_ids": [1.5]}, "token_ids must hold integers"),
        (b"APPEND", {"request_id": "r", "session_id": SID, "token_ids": [*range(300), True]}, "got True"),
        (b"APPEND", {"request_id": "r", "session_id": SID, "token_ids": [*range(300), 2**31]}, "got 2147483648"),
        (b"GENERATE", {"request_id": "r", "session_id": SID, "prompt_ids": [5, -1, 7]}, "prompt_ids must hold integers"),
        (b"APPEND", {"request_id": "r", "session_id": SID, "token_ids": "123"}, "token_ids must be a list"),
        (b"GENERATE", {"request_id": "r", "session_id": SID, "params": {"max_tokens": -1}}, "max_tokens must be in"),
        (b"GENERATE", {"request_id": "r", "session_id": SID, "params": {"max_tokens": True}}, "must be an integer"),
        (b"GENERATE", {"request_id": "r", "session_id": SID, "params": {"temperature": -1}}, "temperature must be"),
        (b"GENERATE", {"request_id": "r", "session_id": SID, "params": {"top_p": 0}}, "top_p must be in (0, 1]"),
        (b"GENERATE", {"request_id": "r", "session_id": SID, "params": {"seed": 2**63}}, "seed must be in"),
        (b"GENERATE", {"request_id": "r", "session_id": SID, "params": {"stop": [""]}}, "stop is malformed"),
        (b"GENERATE", {"request_id": "r", "session_id": SID, "params": {"stop": ["a"] * 17}}, "more than 16"),
        (b"GENERATE", {"request_id": "r", "session_id": SID, "params": []}, "params must be a map"),
        (b"GENERATE", {"request_id": "r", "session_id": SID, "stream": 1}, "stream must be a boolean"),
        (b"GENERATE", {"request_id": "r", "session_id": SID, "prompt_ids": [1], "prompt": "a"}, "at most one of prompt_ids"),
        (b"GENERATE", {"request_id": "r", "session_id": SID, "prompt_ids": [-1]}, "prompt_ids must hold"),
        (b"GENERATE", {"request_id": "r", "session_id": SID, "prompt": 5}, "prompt must be"),
        (b"GENERATE", {"request_id": "r", "session_id": SID, "prompt": "a",
                       "template_args": [{"name": "x", "value": 1}]}, "template_args go with messages"),
        (b"GENERATE", {"request_id": "r", "session_id": SID, "messages": [{"role": "user", "content": "a"}],
                       "template_args": [{"name": "x", "value": {"a": 1}}]}, "must be null, a boolean, a number"),
        (b"GENERATE", {"request_id": "r", "session_id": SID, "messages": [{"role": "user", "content": "a"}],
                       "template_args": [{"name": "x-y", "value": 1}]}, "name is malformed"),
        (b"GENERATE", {"request_id": "r", "session_id": SID, "messages": [{"role": "user", "content": "a"}],
                       "template_args": [{"name": "x", "value": 1}, {"name": "x", "value": 2}]}, "names a variable twice"),
        (b"GENERATE", {"request_id": "r", "session_id": SID, "messages": [{"role": "user", "content": "a"}],
                       "template_args": [{"name": "x", "value": float("nan")}]}, "must be finite"),
        (b"CANCEL", {"request_id": "r", "session_id": SID}, "missing field target"),
        (b"REPLY", {"request_id": "r"}, "unknown reply kind None"),
        (b"REPLY", {"kind": "generated", "request_id": "r", "session_id": SID, "token_ids": [], "text": "",
                    "finish_reason": "bored", "length": 0}, "finish_reason must be one of"),
        (b"REPLY", {"kind": "generated", "request_id": "r", "session_id": SID, "token_ids": [], "text": "",
                    "finish_reason": ["stop"], "length": 0}, "finish_reason must be one of"),  # unhashable
        (b"CHAT", {"request_id": "r", "session_id": SID, "content": "x", "role": "User!"}, "role is malformed"),
        (b"CHUNKS", {}, "missing field chunks"),
        (b"CHUNKS", {"chunks": "abc"}, "chunks must be a list"),
        (b"CHUNKS", {"chunks": {"request_id": "r"}}, "chunks must be a list"),
        (b"CHUNKS", {"chunks": []}, "chunks must hold 1 to"),
        (b"CHUNKS", {"chunks": [["r", [1], "a"]]}, "chunks must hold maps"),
        (b"CHUNKS", {"chunks": [{"token_ids": [1], "text": "a"}]}, "chunks.request_id is missing or malformed"),
        (b"CHUNKS", {"chunks": [{"request_id": "a b", "token_ids": [1], "text": "a"}]}, "request_id is missing or"),
        (b"CHUNKS", {"chunks": [{"request_id": "r", "text": "a"}]}, "chunks.token_ids must be a list"),
        (b"CHUNKS", {"chunks": [{"request_id": "r", "token_ids": "12", "text": "a"}]}, "chunks.token_ids must be a"),
        (b"CHUNKS", {"chunks": [{"request_id": "r", "token_ids": [1, -2], "text": "a"}]}, "token_ids must hold"),
        (b"CHUNKS", {"chunks": [{"request_id": "r", "token_ids": [True], "text": "a"}]}, "token_ids must hold"),
        (b"CHUNKS", {"chunks": [{"request_id": "r", "token_ids": [2**31], "text": "a"}]}, "token_ids must hold"),
        (b"CHUNKS", {"chunks": [{"request_id": "r", "token_ids": [1]}]}, "chunks.text must be a string"),
        (b"CHUNKS", {"chunks": [{"request_id": "r", "token_ids": [1], "text": b"a"}]}, "chunks.text must be"),
        (b"CHUNKS", {"chunks": [{"request_id": "r", "token_ids": [], "text": "", "offset": 0}, 7]}, "chunks must hold maps"),
        (b"CHUNKS", {"chunks": [{"request_id": "r", "token_ids": [], "text": "", "offset": 0}], "route": "c1"},
         "route must be"),
        (b"CHUNKS", {"chunks": [{"request_id": "r", "token_ids": [1], "text": ""}]},
         "chunks.offset must be an integer in [0, 1048576], got 'None' (a worker older than this client sends none"),
        (b"CHUNKS", {"chunks": [{"request_id": "r", "token_ids": [1], "text": "", "offset": -1}]}, "chunks.offset must be"),
        (b"CHUNKS", {"chunks": [{"request_id": "r", "token_ids": [1], "text": "", "offset": True}]}, "got 'True'"),
        (b"CHUNKS", {"chunks": [{"request_id": "r", "token_ids": [1], "text": "", "offset": 2**20 + 1}]}, "offset must"),
        (b"GENERATE", {"request_id": "r", "session_id": SID, "resume": -1}, "resume must be"),
        (b"GENERATE", {"request_id": "r", "session_id": SID, "messages": [{"role": "user", "content": "hi"}], "prompt": "x"},
         "at most one of prompt_ids, prompt or messages"),
        (b"GENERATE", {"request_id": "r", "session_id": SID, "messages": [{"role": "User!", "content": "hi"}]},
         "role is malformed"),
        (b"FANOUT", {"routes": [b"c1"]}, "missing field parts"),
        (b"FANOUT", {"routes": [b"c1", b"c2"], "parts": [b""]}, "one part per route and at least one: 2 routes, 1 parts"),
        (b"FANOUT", {"routes": [], "parts": []}, "at least one: 0 routes"),
        (b"FANOUT", {"routes": [b""], "parts": [b""]}, "a FANOUT route is empty"),
        (b"FANOUT", {"routes": [b"c" * 256], "parts": [b""]}, "routes must hold byte strings of at most 255 bytes"),
        (b"FANOUT", {"routes": ["c1"], "parts": [b""]}, "routes must hold byte strings of at most 255 bytes, got str"),
        (b"FANOUT", {"routes": b"c1", "parts": [b""]}, "routes must be a list of byte strings"),
        (b"FANOUT", {"routes": [b"c1"], "parts": [{"chunks": []}]}, "parts must hold byte strings"),
    ],
)
def test_bad_fields_are_bad_requests_naming_the_field(command: bytes, header: Any, complaint: str) -> None:
    with pytest.raises(p.ProtocolError) as e:
        p.decode(frames(command, header))
    assert e.value.code is p.ErrorCode.BAD_REQUEST
    assert complaint in e.value.message


def test_an_error_keeps_the_request_id_and_route_when_they_are_valid() -> None:
    with pytest.raises(p.ProtocolError) as e:
        p.decode(frames(b"GENERATE", {"request_id": "r42", "session_id": "nope", "route": b"c9"}))
    assert (e.value.request_id, e.value.route) == ("r42", b"c9")
    error = p.error_for(e.value)
    assert (error.request_id, error.code, error.route) == ("r42", p.ErrorCode.BAD_REQUEST, b"c9")


@pytest.mark.parametrize(
    ("raw", "code"),
    [
        ([], p.ErrorCode.BAD_REQUEST),
        ([b"junk"], p.ErrorCode.VERSION_MISMATCH),
        ([b"SSP0", b"CREATE", msgpack.packb({"request_id": "r"})], p.ErrorCode.VERSION_MISMATCH),
        ([p.VERSION, b"create", msgpack.packb({"request_id": "r"})], p.ErrorCode.BAD_REQUEST),
        ([p.VERSION, b"CREATE", b"\xc1"], p.ErrorCode.BAD_REQUEST),
        ([p.VERSION, b"CREATE", msgpack.packb(["r"])], p.ErrorCode.BAD_REQUEST),
        ([p.VERSION, b"CREATE", msgpack.packb({1: "r"})], p.ErrorCode.BAD_REQUEST),
        ([p.VERSION, b"CREATE", msgpack.packb({"request_id": "r"}), b"x"], p.ErrorCode.BAD_REQUEST),
        ([p.VERSION, b"CREATE", b"\x91" * 10_000], p.ErrorCode.BAD_REQUEST),
        ([p.VERSION, b"CREATE", b" " * (p.MAX_HEADER_BYTES + 1)], p.ErrorCode.BAD_REQUEST),
    ],
)
def test_malformed_frames(raw: list[bytes], code: p.ErrorCode) -> None:
    with pytest.raises(p.ProtocolError) as e:
        p.decode(raw)
    assert e.value.code is code


def test_unknown_fields_are_ignored_and_unknown_error_codes_still_end_a_request() -> None:
    assert p.decode(frames(b"CLOSE", {"request_id": "r", "session_id": SID, "extra": [1]})) == p.Close(
        request_id="r", session_id=SID
    )
    error = p.decode(frames(b"ERROR", {"request_id": "r", "code": "from_the_future", "message": "?"}))
    assert isinstance(error, p.Error) and error.code is p.ErrorCode.INTERNAL


def test_chunks_ignores_unknown_fields_and_a_broken_one_keeps_no_request_id() -> None:
    header = {"chunks": [{"request_id": "r1", "token_ids": [1], "text": "a", "offset": 3, "a_newer_field": [0.5]}],
              "route": b"c", "x": 1}
    assert p.decode(frames(b"CHUNKS", header)) == p.Chunks(chunks=(p.StreamChunk("r1", (1,), "a", 3),), route=b"c")
    with pytest.raises(p.ProtocolError) as e:
        p.decode(frames(b"CHUNKS", {"chunks": [{"request_id": "r1", "token_ids": [-1], "text": "", "offset": 0}],
                                    "route": b"c9"}))
    assert (e.value.code, e.value.request_id, e.value.route) == (p.ErrorCode.BAD_REQUEST, None, b"c9")
    with pytest.raises(p.ProtocolError, match="takes no payload"):
        p.decode([*p.encode(p.Chunks(chunks=(p.StreamChunk("r1", (1,), "a"),))), b"extra"])
    assert p.chunk_request_ids({"chunks": [{"request_id": "r1"}, {"request_id": "no good"}, 5, {"x": 1}]}) == ["r1"]
    assert p.chunk_request_ids({"chunks": "r1"}) == []


def test_unchecked_chunks_are_the_same_message_as_checked_ones() -> None:
    chunks = (p.StreamChunk("r1", (1, 2), "ab"), p.StreamChunk("r2", (3,), "c"))
    fast = p.Chunks.unchecked(chunks=chunks, route=b"c1")
    assert fast == p.Chunks(chunks=chunks, route=b"c1")
    assert p.decode(p.encode(fast)) == fast
    with pytest.raises(p.ProtocolError, match="token_ids must hold"):
        p.Chunks(chunks=(p.StreamChunk("r1", (-1,), ""),))  # built from Python the normal way: checked


def test_a_fanout_part_is_the_header_of_the_chunks_message_its_client_gets() -> None:
    chunks = (p.StreamChunk("r1", (1, 2), "ab"), p.StreamChunk("r2", (), "é"))
    fanout = p.Fanout.unchecked(routes=(b"c1",), parts=(p.chunks_part(chunks),))
    assert fanout == p.Fanout(routes=(b"c1",), parts=(p.chunks_part(chunks),))
    [(route, sent)] = fanout.sends()
    assert route == b"c1" and sent[:2] == [p.VERSION, b"CHUNKS"]
    assert p.decode(sent) == p.Chunks(chunks=chunks)  # no route: the broker sends it to c1 as it is
    assert msgpack.unpackb(sent[2]) == msgpack.unpackb(p.encode(p.Chunks(chunks=chunks))[2])


def test_the_fanout_flag_of_an_older_broker_s_welcome_is_ignored() -> None:
    header = {"broker_id": "b1", "heartbeat_ms": 100, "liveness": 3, "fanout": True}
    assert p.decode(frames(b"WELCOME", header)) == p.Welcome(broker_id="b1", heartbeat_ms=100, liveness=3)


def test_unchecked_answers_equal_checked_ones_and_take_defaults() -> None:
    fields: dict[str, Any] = dict(request_id="r1", session_id="a" * 32, token_ids=(1, 2, 3), text="abc", finish_reason="length",
                  length=7)
    fast = p.Generated.unchecked(**fields)
    assert fast == p.Generated(**fields)
    assert (fast.appended, fast.route) == (0, b"")
    assert p.decode(p.encode(fast.routed(b"c1"))) == p.Generated(**fields, route=b"c1")
    with pytest.raises(TypeError, match="no fields"):
        p.Generated.unchecked(**fields, colour="red")
    with pytest.raises(TypeError, match="every field without a default"):
        p.Generated.unchecked(request_id="r1")
    bad = p.Generated.unchecked(**{**fields, "token_ids": (-1,)})  # not checked here...
    with pytest.raises(p.ProtocolError, match="token_ids"):
        p.decode(p.encode(bad))  # ...but by whoever decodes it


def test_messages_built_in_python_are_checked_too() -> None:
    with pytest.raises(p.ProtocolError, match="max_tokens"):
        p.Sampling(max_tokens=-1)
    for bad, named in (({"repetition_penalty": 0.0}, r"repetition_penalty must be in \[0.01, 10.0\]"),
                       ({"presence_penalty": 2.5}, r"presence_penalty must be in \[-2.0, 2.0\]"),
                       ({"logit_bias": (p.LogitBias(1, 1.0), p.LogitBias(1, 2.0))}, "logit_bias names a token twice"),
                       ({"logit_bias": tuple(p.LogitBias(i, 1.0) for i in range(301))}, "logit_bias")):
        with pytest.raises(p.ProtocolError, match=named):
            p.Sampling(**bad)
    with pytest.raises(p.ProtocolError, match="bias"):
        p.LogitBias(1, 101.0)
    with pytest.raises(p.ProtocolError, match="session_id"):
        p.Info(request_id="r", session_id="ABC")
    assert p.Generated(request_id="r", session_id=SID, token_ids=[1, 2], text="", finish_reason="stop",  # type: ignore[arg-type]
                       length=2).token_ids == (1, 2)


msgpack_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.floats() | st.text(max_size=20)
    | st.binary(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=12), inner, max_size=4),
    max_leaves=12,
)
field_names = st.sampled_from(
    ["request_id", "session_id", "model", "token_ids", "text", "params", "stream", "route", "kind", "code",
     "target", "child_id", "content", "role", "name", "capacity", "sessions", "broker_id", "max_tokens", "chunks"]
)
headers = st.dictionaries(field_names, msgpack_values, max_size=8)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.binary(max_size=40), max_size=5))
def test_random_frames_only_ever_raise_protocol_errors(raw: list[bytes]) -> None:
    try:
        p.decode(raw)
    except p.ProtocolError:
        pass


@settings(max_examples=500, deadline=None)
@given(st.sampled_from([c.value for c in p.Command]), headers)
def test_random_headers_only_ever_raise_protocol_errors(command: bytes, header: dict[str, Any]) -> None:
    try:
        message = p.decode([p.VERSION, command, msgpack.packb(header, use_bin_type=True)])
    except p.ProtocolError:
        return
    assert p.decode(p.encode(message)) == message


chunk_maps = st.fixed_dictionaries(
    {"request_id": st.from_regex(r"[A-Za-z0-9._:-]{1,64}", fullmatch=True) | msgpack_values,
     "token_ids": st.lists(st.integers(-2, 2**32), max_size=4) | msgpack_values,
     "text": st.text(max_size=8) | msgpack_values},
    optional={"extra": msgpack_values},
)


@settings(max_examples=300, deadline=None)
@given(st.lists(chunk_maps | msgpack_values, max_size=4), st.binary(max_size=8) | msgpack_values)
def test_random_chunks_only_ever_raise_protocol_errors(chunks: list[Any], route: Any) -> None:
    try:
        message = p.decode([p.VERSION, b"CHUNKS", msgpack.packb({"chunks": chunks, "route": route}, use_bin_type=True)])
    except p.ProtocolError as e:
        assert e.code is p.ErrorCode.BAD_REQUEST
        return
    assert isinstance(message, p.Chunks) and len(message.chunks) == len(chunks)
    assert p.decode(p.encode(message)) == message


def test_a_move_chunk_received_as_a_memoryview_keeps_it_without_a_copy() -> None:
    state = bytearray(range(256)) * 1024
    frames = p.encode(p.MoveChunk(migration="m1", index=3, data=b"x"))[:3] + [memoryview(state)]
    chunk = p.decode(frames)
    assert isinstance(chunk, p.MoveChunk) and chunk.index == 3
    assert isinstance(chunk.data, memoryview) and chunk.data.obj is state and bytes(chunk.data) == bytes(state)


def test_a_payload_is_bytes_or_a_memoryview_within_its_limit() -> None:
    from broker.common.fields import FieldError, payload

    check = payload(4)
    assert check("data", b"abcd") == b"abcd" and bytes(check("data", memoryview(b"abcd"))) == b"abcd"
    with pytest.raises(FieldError, match="data must be bytes, got str"):
        check("data", "abcd")
    with pytest.raises(FieldError, match="data is longer than 4 bytes"):
        check("data", memoryview(b"abcde"))


@pytest.mark.parametrize(
    ("header", "address"),
    [
        (p.encode(p.Append(request_id="a1", session_id=SID, token_ids=tuple(range(70_000, 71_000)) * 100,
                           route=b"c9"))[2], ("a1", SID, b"c9")),
        (msgpack.packb({"route": b"c1", "x": [{"y": [1, 2]}], "session_id": SID, "request_id": "r2"}, use_bin_type=True),
         ("r2", SID, b"c1")),
        (msgpack.packb({"request_id": "bad id!", "session_id": "nope", "route": "not bytes"}, use_bin_type=True),
         (None, "", b"")),
        (msgpack.packb({"request_id": "r3"}, use_bin_type=True), ("r3", "", b"")),
        (msgpack.packb(["r", b"c"]), (None, "", b"")),
        (msgpack.packb({1: "r"}), (None, "", b"")),
        (b"\xc1", (None, "", b"")),
        (msgpack.packb({"request_id": "r4", "route": b"c"}, use_bin_type=True)[:-1], (None, "", b"")),  # cut short
        (b"", (None, "", b"")),
    ],
)
def test_the_address_of_a_raw_header_is_read_without_decoding_it(header: bytes, address: tuple[str | None, str, bytes]
                                                                 ) -> None:
    assert p.peek_address(header) == address


def test_sampling_defaults_are_checked_and_an_older_worker_s_ready_recommends_none() -> None:
    """A worker's recommended sampling (its model's generation_config.json) is checked as a GENERATE's would be; a
    READY from a worker that predates it (no field) recommends nothing."""
    ready = {"name": "w", "model": "m", "capacity": 1, "free_slots": 1, "max_context": 8}
    old = p.decode(frames(b"READY", ready))
    assert isinstance(old, p.Ready) and old.sampling_defaults == p.SamplingDefaults()
    assert p.SamplingDefaults().given() == {}
    assert p.SamplingDefaults(temperature=1, top_k=0).given() == {"temperature": 1.0, "top_k": 0}
    for bad, complaint in (({"temperature": "hot"}, "temperature must be a number, got str"),
                           ({"temperature": 101}, "temperature must be in [0.0, 100.0], got 101"),
                           ({"top_p": 0.0}, "top_p must be in (0, 1]"),
                           ({"top_k": 2.5}, "top_k must be an integer, got float"),
                           ({"repetition_penalty": 0}, "repetition_penalty must be in [0.01, 10.0]"),
                           ({"max_tokens": 0}, "max_tokens must be in [1, 1048576], got 0"),
                           ([0.6], "sampling_defaults must be a map, got list")):
        with pytest.raises(p.ProtocolError) as e:
            p.decode(frames(b"READY", {**ready, "sampling_defaults": bad}))
        assert e.value.code is p.ErrorCode.BAD_REQUEST
        assert complaint in e.value.message, e.value.message
