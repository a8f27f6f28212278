"""A broker stand-in on a real ROUTER socket, scripted per test: it records requests and answers as told."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from types import TracebackType
from typing import TypeVar

import zmq

from broker.common import protocol as p

Reply = Callable[[p.Message], None]
Script = Callable[[p.Message, Reply], None]  # (request, reply) -> None
M = TypeVar("M", bound=p.Message)


class FakeBroker:
    def __init__(self, script: Script) -> None:
        self.script = script
        self.received: list[p.Message] = []
        self._context = zmq.Context()
        self._socket: zmq.Socket[bytes] = self._context.socket(zmq.ROUTER)
        self._socket.setsockopt(zmq.LINGER, 0)
        port = self._socket.bind_to_random_port("tcp://127.0.0.1")
        self.address = f"tcp://127.0.0.1:{port}"
        self._stop = threading.Event()
        self._later: list[tuple[float, Callable[[], None]]] = []  # (when, what): run by the socket's own thread
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> FakeBroker:
        self._thread.start()
        return self

    def __exit__(self, t: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self._socket.close()
        self._context.term()

    def of(self, kind: type[M]) -> list[M]:
        return [m for m in self.received if isinstance(m, kind)]

    def later(self, seconds: float, action: Callable[[], None]) -> None:
        """Run `action` (a reply, say) in `seconds`, on the thread that owns the socket: a ZeroMQ socket used from two
        threads at once aborts the process (a reply sent from a timer's thread did, in the suite)."""
        self._later.append((time.monotonic() + seconds, action))

    def _run(self) -> None:
        while not self._stop.is_set():
            now = time.monotonic()
            due = [entry for entry in self._later if entry[0] <= now]
            for entry in due:
                self._later.remove(entry)
                entry[1]()
            if not self._socket.poll(20):
                continue
            identity, *frames = self._socket.recv_multipart()
            message = p.decode(frames)
            self.received.append(message)

            def reply(answer: p.Message, identity: bytes = identity) -> None:
                self._socket.send_multipart([identity, *p.encode(answer)])

            self.script(message, reply)
