"""The broker's I/O loop: two ROUTER sockets, a poll with the next timer as timeout, the router's output sent.

Majordomo's shape: poll, dispatch on the socket a message came from, then run the timers (dead workers,
heartbeats, leases). Every send is NOBLOCK: a peer that is gone (EHOSTUNREACH, thanks to ROUTER_MANDATORY) or
full (EAGAIN at its high-water mark) never blocks the loop; the router decides what that means. Whatever the
handling of one message raises is logged and counted, and the loop goes on (`_failed`).

With keys (`--keys DIR`) both sockets are CURVE servers and pyzmq's ThreadAuthenticator, held for the
broker's whole life, checks every handshake against the socket's own allow-list (ZAP domain "workers" or
"clients"). A client's messages then carry its public key (ZeroMQ's "User-Id" property), which the router
uses as the owner of the sessions it creates.
"""

from __future__ import annotations

import ipaddress
import logging
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import structlog
import zmq
from zmq.auth.thread import ThreadAuthenticator

from broker.admission import DEFAULT_MAX_WORKER_SESSIONS
from broker.common import heap
from broker.common import protocol as p
from broker.common.keys import CLIENTS_DOMAIN, HANDSHAKE_FAILED, WORKERS_DOMAIN, BrokerKeys, KeyFileError, drain_events
from broker.common.metrics_http import Pulse
from broker.common.receive import ROUTED_ENVELOPE, receive
from broker.moves import DEFAULT_MOVES_PER_SOURCE
from broker.router import Failure, Peer, Router, Send, Settings

log = structlog.get_logger()

# Messages read from one socket before looking at the other and at the timers: keeps both fair.
RECV_BATCH = 256
MAX_POLL_S = 0.25  # a stop request is noticed within this
AUTH_FAILURE_LOG_S = 10.0  # refused handshakes are logged at most this often per socket (peers retry fast)
LOOP_ERROR_LOG_S = 10.0  # a message whose handling raised is logged with its traceback at most this often
# A message header this large (a READY listing many sessions, or a hostile one refused by its length) leaves megabytes
# that glibc keeps once freed: 20 refused 6.8 MB READYs left the broker 57-104 MB larger. The free heap is given back
# (malloc_trim) at most every TRIM_EVERY_S after one.
TRIM_AFTER_HEADER_BYTES = 1 << 20
TRIM_EVERY_S = 1.0
# Plain ints: pyzmq's send_multipart combines enum flags per frame, which costs ~10% of the broker's time.
_MORE = int(zmq.SNDMORE | zmq.NOBLOCK)
_LAST = int(zmq.NOBLOCK)


# A restarted broker waits at least this long for workers to re-register (more with slow heartbeats): a worker's
# reconnect backoff tops out at its --reconnect-max-ms (default 500), and a loaded host adds its own delays.
MIN_RECOVERY_MS = 2000


@dataclass(frozen=True)
class BrokerConfig:
    clients: str = "tcp://127.0.0.1:5555"
    workers: str = "tcp://127.0.0.1:5556"
    heartbeat_ms: int = 1000
    liveness: int = 3
    recovery_ms: int | None = None  # None: (liveness + 2) heartbeats, at least MIN_RECOVERY_MS
    hwm: int = 100_000  # messages queued per peer before sends to it fail with EAGAIN
    max_message_bytes: int = p.MAX_MESSAGE_BYTES
    keys: Path | None = None  # CURVE on: see broker/common/keys.py for the layout
    max_sessions_per_client: int = 1024  # 0: no cap
    request_timeout_ms: int = 60_000  # 0: no deadline
    worker_silence_ms: int = 30_000  # a connected worker that sends nothing this long is gone
    max_worker_sessions: int = DEFAULT_MAX_WORKER_SESSIONS  # session slots one worker may offer
    session_grace_ms: int = 60_000  # a gone client's sessions are closed after this; 0: never
    client_grace_ms: int = 5_000  # a client that cannot be reached has this long to come back before its generations stop
    io_threads: int = 1  # ZeroMQ's I/O threads (TCP reads and writes, off the broker's loop)
    moves_per_worker: int = DEFAULT_MOVES_PER_SOURCE  # session moves running at once from one worker

    def recovery(self) -> int:
        if self.recovery_ms is not None:
            return self.recovery_ms
        return max((self.liveness + 2) * self.heartbeat_ms, MIN_RECOVERY_MS)

    def settings(self) -> Settings:
        return Settings(
            heartbeat_s=self.heartbeat_ms / 1000, liveness=self.liveness, recovery_s=self.recovery() / 1000,
            authenticated=self.keys is not None, max_sessions_per_client=self.max_sessions_per_client,
            request_timeout_s=self.request_timeout_ms / 1000, silence_s=self.worker_silence_ms / 1000,
            max_worker_sessions=self.max_worker_sessions, session_grace_s=self.session_grace_ms / 1000,
            moves_per_source=self.moves_per_worker, client_grace_s=self.client_grace_ms / 1000,
        )


class BrokerServer:
    def __init__(self, config: BrokerConfig) -> None:
        self.config = config
        self.router = Router(config.settings(), time.monotonic())
        self.pulse = Pulse()  # /healthz: the loop below beats it every turn
        self._context = zmq.Context(io_threads=config.io_threads)
        self._keys = BrokerKeys.load(config.keys) if config.keys is not None else None  # KeyFileError: bad keys
        self.auth: ThreadAuthenticator | None = None
        self._monitors: list[tuple[zmq.Socket[Any], str]] = []
        self._auth_failures = {CLIENTS_DOMAIN: 0, WORKERS_DOMAIN: 0}
        self._auth_logged_at = 0.0
        self._error_logged_at = -LOOP_ERROR_LOG_S
        self._trim_due = False  # a large header came since the free heap was last given back
        self._trimmed_at = -TRIM_EVERY_S
        try:
            if self._keys is not None:
                # Held in self.auth for the broker's life: a collected authenticator silently lets everyone in.
                self.auth = ThreadAuthenticator(self._context, log=logging.getLogger("broker.auth"))
                self.auth.start()
                self.reload_keys()
            self.clients = self._router_socket(config.clients, CLIENTS_DOMAIN)
            try:
                self.workers = self._router_socket(config.workers, WORKERS_DOMAIN)
            except OSError:
                self.clients.close(linger=0)
                raise
        except (OSError, KeyFileError):
            self._stop_auth()
            self._context.term()
            raise

    def reload_keys(self) -> None:
        """(Re)read the allow-lists, e.g. after an operator added a key (SIGHUP)."""
        if self.auth is None or self._keys is None:
            return
        self._keys.check()  # KeyFileError before anything changes
        self.auth.configure_curve(domain=WORKERS_DOMAIN, location=str(self._keys.workers))
        self.auth.configure_curve(domain=CLIENTS_DOMAIN, location=str(self._keys.clients))
        self.router.admins = self._keys.admin_keys()
        log.info("keys_loaded", workers=self._keys.allowed(WORKERS_DOMAIN), clients=self._keys.allowed(CLIENTS_DOMAIN),
                 admins=len(self.router.admins))

    def _router_socket(self, address: str, domain: str) -> zmq.Socket[bytes]:
        sock: zmq.Socket[bytes] = self._context.socket(zmq.ROUTER)
        if self._keys is not None:
            self._keys.apply(sock, domain)
            monitor = sock.get_monitor_socket(HANDSHAKE_FAILED)
            self._monitors.append((monitor, domain))
        # All options before bind: they apply to connections accepted from then on.
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)  # unknown peer -> EHOSTUNREACH, not a silent drop
        sock.setsockopt(zmq.ROUTER_HANDOVER, 1)  # a peer that reconnects with its id takes it over
        # ZMTP heartbeats, sent and answered by libzmq's I/O threads (no Python, no GIL), close the connection of a
        # peer that answers nothing for `liveness` heartbeats (a stopped process, a pulled cable): the next send to it
        # fails, which is how a worker is declared gone (broker.liveness). A pinged peer whose Python is busy still
        # answers. Pings go every half heartbeat, so that the window starts soon after the peer fell silent.
        sock.setsockopt(zmq.HEARTBEAT_IVL, max(1, self.config.heartbeat_ms // 2))
        sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, self.config.heartbeat_ms * self.config.liveness)
        sock.setsockopt(zmq.SNDHWM, self.config.hwm)
        sock.setsockopt(zmq.RCVHWM, self.config.hwm)
        sock.setsockopt(zmq.MAXMSGSIZE, self.config.max_message_bytes)  # bigger: ZeroMQ drops the peer
        sock.setsockopt(zmq.LINGER, 0)
        try:
            sock.bind(address)
        except zmq.ZMQError as e:
            sock.close()
            raise OSError(f"cannot bind {address}: {e}") from e
        return sock

    def serve(self, should_stop: Callable[[], bool]) -> None:
        log.info(
            "broker_started", broker_id=self.router.broker_id, clients=self.config.clients,
            workers=self.config.workers, heartbeat_ms=self.config.heartbeat_ms, liveness=self.config.liveness,
            auth="curve" if self._keys is not None else "off",
        )
        if self._keys is None:
            exposed = [a for a in (self.config.clients, self.config.workers) if not _is_loopback(a)]
            log.warning("auth_disabled", exposed=exposed or None,
                        detail="no --keys: peers are not authenticated"
                        + (f"; listening beyond loopback on {', '.join(exposed)}" if exposed else "; loopback only"))
        poller = zmq.Poller()
        poller.register(self.clients, zmq.POLLIN)
        poller.register(self.workers, zmq.POLLIN)
        for monitor, _ in self._monitors:
            poller.register(monitor, zmq.POLLIN)
        stall_s = self.config.heartbeat_ms * self.config.liveness / 2000  # half a heartbeat window
        turned = time.monotonic()  # when the last turn ended: every moment of the loop is measured, between turns too
        while not should_stop():
            self.pulse.beat()
            now = time.monotonic()
            if now - turned > stall_s:  # stopped between two turns (a SIGSTOP there went unnoticed)
                self.router.stalled(now, now - turned)
            timeout_s = min(max(self.router.next_tick() - now, 0.0), MAX_POLL_S)
            ready = dict(poller.poll(round(timeout_s * 1000)))
            woke = time.monotonic()
            overslept = woke - now - timeout_s  # a process that was not running wakes late
            if overslept > stall_s:
                self.router.stalled(woke, overslept)
            if self.workers in ready:
                self._drain(self.workers, self.router.worker_message, "worker")
            if self.clients in ready:
                if self._keys is not None:
                    self._drain_authenticated_clients()
                else:
                    self._drain(self.clients, self.router.client_message, "client")
            if self._monitors:
                self._handshake_failures(ready)
            now = turned = time.monotonic()
            if now - woke > stall_s:  # the turn took long: the process was not running, or was starved
                self.router.stalled(now, now - woke)
            if now >= self.router.next_tick():
                try:
                    self._send_all(self.router.tick(now))
                except Exception as e:
                    self._failed("timers", e)
            if self._trim_due and now - self._trimmed_at >= TRIM_EVERY_S:
                self._trim_due = False
                self._trimmed_at = now
                heap.release_free_memory()
        log.info("broker_stopping", workers=len(self.router.registry.workers), inflight=len(self.router.inflight))

    def _failed(self, what: str, error: Exception) -> None:
        """The handling of one message (or the timers) raised: logged (with its traceback at most every
        LOOP_ERROR_LOG_S), counted in `sessionserve:broker_loop_errors_total`, and the loop goes on. The protocol
        module turns every bad message into a typed error, so this is for bugs, not for peers."""
        self.router.discard_output()
        self.router.counters.loop_errors += 1
        now = time.monotonic()
        if now - self._error_logged_at >= LOOP_ERROR_LOG_S:
            self._error_logged_at = now
            log.error("broker_loop_error", handling=what, errors=self.router.counters.loop_errors, exc_info=error)
        else:
            log.error("broker_loop_error", handling=what, error=f"{type(error).__name__}: {error}"[:256],
                      errors=self.router.counters.loop_errors)

    def close(self) -> None:
        for monitor, _ in self._monitors:
            monitor.close(linger=0)
        self.clients.close(linger=0)
        self.workers.close(linger=0)
        self._stop_auth()
        self._context.term()

    def _stop_auth(self) -> None:
        if self.auth is not None:
            self.auth.stop()
            self.auth = None

    def _drain(self, sock: zmq.Socket[bytes], handle: Callable[[bytes, Sequence[p.Frame], float], list[Send]],
               what: str) -> None:
        for _ in range(RECV_BATCH):
            try:
                frames = receive(sock, ROUTED_ENVELOPE)  # payload frames (moves' state) stay uncopied
            except zmq.Again:
                return
            if len(frames) < 2:  # a ROUTER always prepends the peer's id; nothing to answer to
                continue
            self._note_header(frames)
            try:
                self._send_all(handle(bytes(frames[0]), frames[1:], time.monotonic()))  # an id: bytes already
            except Exception as e:
                self._failed(f"{what} message", e)

    def _note_header(self, frames: Sequence[p.Frame]) -> None:
        """A message of [id, version, command, header, ...] whose header is large makes the free heap due back."""
        if len(frames) > 3 and len(frames[3]) >= TRIM_AFTER_HEADER_BYTES:
            self._trim_due = True

    def _drain_authenticated_clients(self) -> None:
        """Like _drain, plus each message's sender key (the ZAP handler's user id: the Z85 public key)."""
        for _ in range(RECV_BATCH):
            try:
                parts = self.clients.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            if len(parts) < 2:
                continue
            user = str(parts[1].get("User-Id") or "")
            frames = [part.bytes for part in parts]
            self._note_header(frames)
            try:
                self._send_all(self.router.client_message(frames[0], frames[1:], time.monotonic(), user=user))
            except Exception as e:
                self._failed("client message", e)

    def _handshake_failures(self, ready: dict[Any, int]) -> None:
        """Count refused handshakes (wrong or unknown keys, no CURVE) and log them, rate-limited."""
        for monitor, domain in self._monitors:
            if monitor in ready:
                self._auth_failures[domain] += drain_events(monitor)
        now = time.monotonic()
        if any(self._auth_failures.values()) and now - self._auth_logged_at >= AUTH_FAILURE_LOG_S:
            log.warning("handshakes_refused", **{f"{d}_socket": n for d, n in self._auth_failures.items()})
            self._auth_logged_at = now
            self._auth_failures = dict.fromkeys(self._auth_failures, 0)

    def _send_all(self, sends: list[Send]) -> None:
        queue = deque(sends)
        while queue:
            send = queue.popleft()
            failure = self._send(send)
            if failure is not None:
                queue.extend(self.router.undeliverable(send, failure, time.monotonic()))

    def _send(self, send: Send) -> Failure | None:
        sock = self.clients if send.peer is Peer.CLIENT else self.workers
        try:
            # The first frame decides (EHOSTUNREACH, EAGAIN); once it is taken the rest of the message is too.
            sock.send(send.identity, _MORE)
            last = len(send.frames) - 1
            for i, frame in enumerate(send.frames):
                # A received payload frame (a relayed MOVE_CHUNK) goes on as it came, without a copy.
                sock.send(frame, _MORE if i < last else _LAST, copy=type(frame) is bytes)
        except zmq.ZMQError as e:
            if e.errno == zmq.EHOSTUNREACH:
                return Failure.UNREACHABLE
            if e.errno == zmq.EAGAIN:
                return Failure.FULL
            log.error("send_failed", peer=send.peer.value, error=str(e))
            return Failure.UNREACHABLE
        return None


def _is_loopback(address: str) -> bool:
    """tcp://127.0.0.1:5555 and the like (ipc:// and inproc:// are local too)."""
    if not address.startswith("tcp://"):
        return True
    host = address[len("tcp://"):].rsplit(":", 1)[0].strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # *, an interface name or a host name: reachable from outside
