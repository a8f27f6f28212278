"""A client flooding a busy worker with big valid requests, through the real daemons: how many bytes does the worker
hold (worker.serve.link.MAX_INBOX_BYTES bounds the requests it has read and not taken), is every request answered,
does the worker stay registered and serve the others?

`broker start` and `worker start` (random:smollm2-135m on the CPU by default) run on 127.0.0.1. One client starts a
generation on a long prompt: on the CPU its prefill takes seconds, in steps of 256 tokens, and the worker's compute
loop takes at most one receive batch (16 MiB) of requests between two steps. Meanwhile another client sends `--count`
APPENDs of `--chars` characters of text each (3 MB on the wire, valid: the broker forwards them, it cannot tell
whether a text fits) without waiting for answers, then a third client a small INFO. Prints the worker's resident
memory before the flood and at its peak (VmHWM), the answers by code, and whether the others were served and the
worker stayed registered.

    python -m worker.bench.inbox_flood --count 1000 [--json FILE]

On a shared 2-core host: 1,000 x 3 MB (2.8 GiB) took the worker from 1,142 to 1,680 MiB (+539; the long prompt alone,
`--count 0`, +195): 34 APPENDs queued and answered, 966 answered overloaded, the others served. The rest of the growth
is what ZeroMQ received before the link read it (RCVHWM counts messages), which grows when the link thread gets less
CPU than the broker and the client.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import zmq

from broker.common import protocol as p
from client.stack import LocalStack

MIB = 1 << 20


@dataclass
class Result:
    count: int
    request_bytes: int  # one APPEND on the wire
    worker_rss_before_mib: float
    worker_peak_rss_mib: float  # VmHWM: the most the worker's process ever held resident
    broker_peak_rss_mib: float
    answers: dict[str, int]  # the flood's, by "code: first words of the message"
    unanswered: int
    flood_seconds: float
    other_client_answered: bool  # its INFO, sent after the flood
    generation_finished: bool  # the long prompt's
    worker_registered: bool  # with the broker, after the flood
    lost_workers: int  # worker_lost lines in the broker's log
    logs: str  # the daemons' logs

    @property
    def worker_peak_growth_mib(self) -> float:
        return round(self.worker_peak_rss_mib - self.worker_rss_before_mib, 1)


def memory_mib(pid: int) -> dict[str, float]:
    """VmRSS and VmHWM of a process, in MiB."""
    values: dict[str, float] = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            key, _, rest = line.partition(":")
            if key in ("VmRSS", "VmHWM"):
                values[key] = int(rest.split()[0]) / 1024
    return values


class RawClient:
    """A DEALER speaking the protocol to the broker's client address: it may send without waiting for answers."""

    def __init__(self, context: zmq.Context[zmq.Socket[bytes]], address: str) -> None:
        self.sock: zmq.Socket[bytes] = context.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(address)

    def recv(self, timeout_s: float) -> p.Message | None:
        """The next answer (a LEASE probe is skipped), None after timeout_s."""
        deadline = time.monotonic() + timeout_s
        while self.sock.poll(max(0, int((deadline - time.monotonic()) * 1000))):
            message = p.decode(self.sock.recv_multipart())
            if not isinstance(message, p.Lease):
                return message
        return None

    def ask(self, message: p.Message, timeout_s: float = 60.0) -> p.Message:
        self.sock.send_multipart(p.encode(message))
        answer = self.recv(timeout_s)
        assert answer is not None, f"no answer to {message}"
        return answer


def session(client: RawClient, request_id: str) -> str:
    created = client.ask(p.CreateSession(request_id=request_id))
    assert isinstance(created, p.Created), created
    return created.session_id


def flood(count: int = 1000, chars: int = 3_000_000, model: str = "random:smollm2-135m", prompt_tokens: int = 4000,
          max_context: int = 8192) -> Result:
    # The daemons' own heartbeats (1 s, 3 missed): the tests' 100 ms ones are too tight for a 2-core host moving GBs.
    stack = LocalStack(heartbeats=None, env={"OMP_NUM_THREADS": "1", "WORKER_THREADS": "1"}, log_level="warning")
    context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    try:
        stack.start_broker()
        worker = stack.start_worker("flooded", model=model, device="cpu", max_sessions=4, max_context=max_context)
        stack.wait_for_workers({"flooded"}, timeout=300)
        assert stack.broker is not None
        busy, flooder, other = (RawClient(context, stack.clients) for _ in range(3))
        busy_sid, flood_sid, other_sid = session(busy, "c1"), session(flooder, "c2"), session(other, "c3")
        assert isinstance(busy.ask(p.Append(request_id="a1", session_id=busy_sid,
                                            token_ids=tuple(i % 500 + 1 for i in range(prompt_tokens)))), p.Appended)
        before = memory_mib(worker.pid)["VmRSS"]
        busy.sock.send_multipart(p.encode(p.Generate(request_id="g1", session_id=busy_sid,
                                                     params=p.Sampling(max_tokens=1, ignore_eos=True))))
        time.sleep(1.0)  # its prefill is under way
        template = p.encode(p.Append(request_id="f000000", session_id=flood_sid, text="x" * chars))
        size = sum(map(len, template))
        started = time.monotonic()
        answers: Counter[str] = Counter()
        sent = 0
        info_sent = False
        while (sent < count or sum(answers.values()) < count) and time.monotonic() - started < 300:
            if sent < count:
                frames = [template[0], template[1], template[2].replace(b"f000000", f"f{sent:06d}".encode(), 1)]
                try:
                    flooder.sock.send_multipart(frames, zmq.NOBLOCK)
                    sent += 1
                except zmq.Again:
                    pass
            if sent == count and not info_sent:  # then another client's small request, behind the flood
                other.sock.send_multipart(p.encode(p.Info(request_id="i1", session_id=other_sid)))
                info_sent = True
            while (answer := flooder.recv(0 if sent < count else 0.05)) is not None:
                key = f"{answer.code.value}: {' '.join(answer.message.split()[:4])}" \
                    if isinstance(answer, p.Error) else type(answer).__name__
                answers[key] += 1
        flood_seconds = time.monotonic() - started
        if not info_sent:
            other.sock.send_multipart(p.encode(p.Info(request_id="i1", session_id=other_sid)))
        info = other.recv(120)
        generated = busy.recv(120)
        peak = memory_mib(worker.pid)["VmHWM"]
        with stack.client(timeout=10) as c:
            registered = [w.name for w in c.status()] == ["flooded"]
        return Result(count=count, request_bytes=size, worker_rss_before_mib=round(before, 1),
                      worker_peak_rss_mib=round(peak, 1),
                      broker_peak_rss_mib=round(memory_mib(stack.broker.pid)["VmHWM"], 1), answers=dict(answers),
                      unanswered=count - sum(answers.values()), flood_seconds=round(flood_seconds, 2),
                      other_client_answered=isinstance(info, p.SessionInfo),
                      generation_finished=isinstance(generated, p.Generated), worker_registered=registered,
                      lost_workers=stack.broker.log_text().count("worker_lost"), logs=str(stack.log_dir))
    finally:
        context.destroy(linger=0)
        stack.stop(timeout=10)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m worker.bench.inbox_flood", description=__doc__.split("\n\n")[0])
    parser.add_argument("--count", type=int, default=1000, help="APPENDs sent (default %(default)s)")
    parser.add_argument("--chars", type=int, default=3_000_000, help="characters of text in each (default %(default)s)")
    parser.add_argument("--model", default="random:smollm2-135m", help="the worker's (default %(default)s)")
    parser.add_argument("--prompt-tokens", type=int, default=4000,
                        help="the long prompt whose prefill keeps the worker busy (default %(default)s)")
    parser.add_argument("--json", type=Path, help="write the result here too")
    args = parser.parse_args(argv)
    r = flood(args.count, args.chars, args.model, args.prompt_tokens)
    print(f"{r.count} APPENDs of {r.request_bytes:,} bytes ({r.count * r.request_bytes / MIB:,.0f} MiB), all answered "
          f"in {r.flood_seconds} s" if not r.unanswered else f"{r.unanswered} of {r.count} APPENDs unanswered")
    print(f"worker resident memory: {r.worker_rss_before_mib} MiB before, peak {r.worker_peak_rss_mib} MiB "
          f"(+{r.worker_peak_growth_mib}); broker peak {r.broker_peak_rss_mib} MiB")
    for answer, n in sorted(r.answers.items()):
        print(f"  {n:6d}  {answer}")
    print(f"the other client answered: {r.other_client_answered}; the long prompt's generation finished: "
          f"{r.generation_finished}; worker still registered: {r.worker_registered} (workers lost: {r.lost_workers})")
    print(f"logs: {r.logs}")
    if args.json:
        args.json.write_text(json.dumps({**asdict(r), "worker_peak_growth_mib": r.worker_peak_growth_mib}, indent=2))
    ok = not r.unanswered and r.other_client_answered and r.generation_finished and r.worker_registered
    return 0 if ok and not r.lost_workers else 1


if __name__ == "__main__":
    sys.exit(main())
