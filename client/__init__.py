"""Client library: open sessions on the broker, append, generate (streamed or not), fork, close.

    from client import Client, SessionLost
    with Client("tcp://127.0.0.1:5555") as client, client.session() as s:
        print(s.chat("What is the capital of France?").text)

Errors are typed (ClientError and its subclasses, each with a stable `.code`).
"""

from client.aio import AsyncClient, AsyncSession, AsyncStream, SessionOpening
from client.errors import (
    BadRequest,
    BrokerUnreachable,
    CapacityExhausted,
    ClientError,
    InternalError,
    ModelNotFound,
    Overloaded,
    PromptBoundary,
    SessionExpired,
    SessionLost,
    SessionNotFound,
    StreamCancelled,
    Timeout,
    Unauthorized,
    VersionMismatch,
    WorkerDraining,
)
from client.results import Chunk, Generation, SessionInfo, WorkerInfo
from client.sync import Client, PendingClose, Session, Stream

__all__ = [
    "AsyncClient",
    "AsyncSession",
    "AsyncStream",
    "BadRequest",
    "BrokerUnreachable",
    "CapacityExhausted",
    "Chunk",
    "Client",
    "ClientError",
    "Generation",
    "InternalError",
    "ModelNotFound",
    "Overloaded",
    "PendingClose",
    "PromptBoundary",
    "Session",
    "SessionExpired",
    "SessionInfo",
    "SessionLost",
    "SessionNotFound",
    "SessionOpening",
    "Stream",
    "StreamCancelled",
    "Timeout",
    "Unauthorized",
    "VersionMismatch",
    "WorkerDraining",
    "WorkerInfo",
]
