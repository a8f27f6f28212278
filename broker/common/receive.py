"""Receiving one message with its payload frames left in ZeroMQ's message (a MOVE_CHUNK's 4 MiB of state is relayed by
the broker and read by the target without a copy in Python).

A message is its envelope, [id (a ROUTER's peer), version, command, header], then payload frames. The envelope's
frames are taken as bytes, as recv_multipart takes them (the cheapest for small frames: the broker's and the worker's
hot path); payload frames as memoryviews of the received messages, which they keep alive.
"""

from __future__ import annotations

import zmq

from broker.common.protocol import Frame

_RCVMORE = int(zmq.RCVMORE)  # a plain int: the enum's operators cost more than the call
ENVELOPE = 3  # version, command, header
ROUTED_ENVELOPE = 4  # a ROUTER socket's peer id first


def receive(sock: zmq.Socket[bytes], envelope: int) -> list[Frame]:
    """One message (zmq.Again if none): its first `envelope` frames as bytes, the rest as memoryviews."""
    frames: list[Frame] = [sock.recv(zmq.NOBLOCK)]
    while len(frames) < envelope and sock.getsockopt(_RCVMORE):
        frames.append(sock.recv())
    while sock.getsockopt(_RCVMORE):
        frames.append(sock.recv(copy=False).buffer)
    return frames
