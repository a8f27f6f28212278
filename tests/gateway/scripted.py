"""A broker stand-in for a gateway process: it opens and forks sessions and answers every GENERATE with the next of
its scripted answers, streamed a piece a chunk, 20 ms apart (each its own delta), or whole; it keeps what it was
sent (FakeBroker.received)."""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

from broker.common import protocol as p
from client.stack import LocalStack

from ..client.fake_broker import FakeBroker, Reply
from .conftest import Gateways


class Scripted:
    """Answers every GENERATE with the next answer's pieces (streamed as chunks, a token each, or whole); opens and
    forks sessions (a question asked again is a fork of the session that answered it)."""

    def __init__(self, answers: list[tuple[list[str], str]]) -> None:
        self.answers = itertools.cycle(answers)  # (pieces, finish reason)
        self.lengths: dict[str, int] = {}
        self.ids = itertools.count(1)
        self.fake: FakeBroker  # set once the broker stand-in exists (its `later` sends the chunks apart)
        self.tools = True  # its worker renders tools, calls and reasoning (False: as an older one)

    def _new(self, length: int) -> str:
        sid = f"{next(self.ids):032x}"
        self.lengths[sid] = length
        return sid

    def __call__(self, request: p.Message, reply: Reply) -> None:
        if isinstance(request, p.Status):
            reply(p.StatusReport(request_id=request.request_id, broker_id="b",
                                 workers=(p.WorkerStatus("w", "m", 8, 8, 0, max_context=4096, tools=self.tools),)))
        elif isinstance(request, p.CreateSession):
            reply(p.Created(request_id=request.request_id, session_id=self._new(0), model="m", worker="w",
                            max_context=4096, from_start=True))
        elif isinstance(request, p.Fork):
            length = self.lengths[request.session_id]
            reply(p.Forked(request_id=request.request_id, session_id=request.session_id, child_id=self._new(length),
                           length=length, worker="w", from_start=True))
        elif isinstance(request, p.Generate):
            pieces, finish = next(self.answers)
            sid, held = request.session_id, self.lengths[request.session_id]
            rewound = max(held - 1, 0) if request.from_start else 0  # it keeps one token the whole prompt starts with
            self.lengths[sid] = held - rewound + 20 + len(pieces)
            if request.stream:  # a CHUNKS message a piece, 20 ms apart: each its own delta
                for i, piece in enumerate(pieces):
                    chunk = p.Chunks(chunks=(p.StreamChunk(request.request_id, (100 + i,), piece, i),))
                    self.fake.later(0.02 * i, lambda chunk=chunk: reply(chunk))  # type: ignore[misc]
            done = p.Generated(request_id=request.request_id, session_id=sid, token_ids=tuple(range(100, 100 + len(pieces))),
                              text="".join(pieces), finish_reason=finish, length=self.lengths[sid], appended=20,
                              rewound=rewound, cached=0)
            self.fake.later(0.02 * len(pieces) if request.stream else 0.0, lambda: reply(done))
        elif isinstance(request, p.Close):
            reply(p.Closed(request_id=request.request_id, session_id=request.session_id))


@contextmanager
def gateway_before(script: Scripted, log_dir: Path, extra: Sequence[str]) -> Iterator[tuple[FakeBroker, str]]:
    """A gateway process (with `extra` arguments) in front of `script` as its broker: the broker and the gateway's URL."""
    with FakeBroker(script) as fake:
        script.fake = fake
        gateways = Gateways(LocalStack(log_dir), "")
        try:
            yield fake, gateways.start(broker=fake.address, extra=extra)
        finally:
            gateways.close()
