"""What the HTTP gateway adds to a request, measured on one host: latency and the gateway's own CPU time.

    python -m client.bench.gateway_overhead [--model random:tiny] [--device cpu] [--turns 200] [--tokens 64]

Starts a broker, one worker and a gateway on loopback, then, one request at a time:
- turns of one conversation (a 1-token prompt appended, 1 token generated), through the native AsyncClient and
  through the gateway (POST /v1/completions, the conversation resent with its session_id, not streamed), one
  after the other: the median latency of each and the median of their differences, the gateway's overhead per
  request;
- streamed turns of `--tokens` tokens, `--sessions` conversations at once, through the gateway: the gateway
  process's CPU time per request and per streamed token (user and system time from /proc: other load on the host
  does not count, but loopback TCP is charged to the sender as system time); then the same through a native
  AsyncClient in this process, and its CPU per token: what the gateway spends beyond a plain client.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import resource
import statistics
import time
import urllib.request
from typing import Any

from client.aio import AsyncClient
from client.bench.loadtest.http import Connection
from client.stack import Daemon, LocalStack, free_port


def cpu_seconds(pid: int) -> tuple[float, float]:
    """(user, system) CPU seconds of a process, all its threads."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    tick = os.sysconf("SC_CLK_TCK")
    return int(fields[11]) / tick, int(fields[12]) / tick


class Conversation:
    """One conversation through the gateway: its session_id and the history it resends."""

    def __init__(self, url: str, model: str) -> None:
        self.conn = Connection(url, None, 60)
        self.model = model
        self.history: list[int] = [1, 2, 3]
        self.name = f"bench-{time.monotonic_ns()}"

    async def turn(self, new: int, tokens: int, stream: bool) -> float:
        body: dict[str, Any] = {"model": self.model, "prompt": [*self.history, new], "max_tokens": tokens,
                                "temperature": 0, "stream": stream, "session_id": self.name, "return_token_ids": True,
                                "ignore_eos": True}
        start = time.perf_counter()
        status, headers, reader = await self.conn.request("POST", "/v1/completions", body)
        raw = await self.conn.body(headers, reader)
        took = time.perf_counter() - start
        assert status == 200, raw[:300]
        if stream:
            ids = [t for e in raw.split(b"\n\n") if e.startswith(b"data: {")
                   for c in json.loads(e[6:]).get("choices", ()) for t in c.get("token_ids", ())]
        else:
            ids = json.loads(raw)["choices"][0]["token_ids"]
        self.history += [new, *ids]
        return took


async def interleaved(address: str, url: str, model: str, turns: int) -> tuple[list[float], list[float]]:
    """The same 1-token turns, native and through the gateway, one after the other (load drifts alike on both)."""
    async with AsyncClient(address, timeout=60) as client:
        session = await client.session(model)
        await session.generate(max_tokens=1, prompt_ids=[1, 2, 3], ignore_eos=True)
        conv = Conversation(url, model)
        await conv.turn(4, 1, False)
        native: list[float] = []
        through: list[float] = []
        for i in range(turns):
            start = time.perf_counter()
            await session.generate(max_tokens=1, prompt_ids=[10 + i % 200], ignore_eos=True)
            native.append(time.perf_counter() - start)
            through.append(await conv.turn(10 + i % 200, 1, False))
        await session.close()
        await conv.conn.close()
    return native, through


async def native_streamed(address: str, model: str, turns: int, tokens: int, sessions: int) -> None:
    async with AsyncClient(address, timeout=60) as client:
        async def one() -> None:
            session = await client.session(model)
            await session.generate(max_tokens=1, prompt_ids=[1, 2, 3], ignore_eos=True)
            for i in range(turns):
                stream = await session.generate(max_tokens=tokens, prompt_ids=[10 + i % 200], ignore_eos=True, stream=True)
                async for _ in stream:
                    pass
            await session.close()

        await asyncio.gather(*(one() for _ in range(sessions)))


async def streamed(url: str, model: str, turns: int, tokens: int, sessions: int) -> None:
    async def one() -> None:
        conv = Conversation(url, model)
        for i in range(turns):
            await conv.turn(10 + i % 200, tokens, True)
        await conv.conn.close()

    await asyncio.gather(*(one() for _ in range(sessions)))


def gateway_model(url: str, gateway: Daemon, timeout_s: float = 60.0) -> str:
    """The first model a just-started gateway lists (GET /v1/models), polled until it answers; RuntimeError with its
    log's end when it does not within `timeout_s` or exits."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with urllib.request.urlopen(url + "/v1/models", timeout=2) as r:
                return str(json.loads(r.read())["data"][0]["id"])
        except (OSError, IndexError):
            if time.monotonic() > deadline or not gateway.alive:
                raise RuntimeError(gateway.log_text()[-3000:]) from None
            time.sleep(0.1)


def start_gateway(stack: LocalStack) -> tuple[Daemon, str, str]:
    """A gateway on a free loopback port for the stack's broker, once it lists a model: (its daemon, its URL, the
    model)."""
    port = free_port()
    gateway = Daemon("client.gateway.cli", ["--broker", stack.clients, "--port", str(port), "--log-level", "warning"],
                     stack.log_dir / "gateway.log", env=stack.env)
    url = f"http://127.0.0.1:{port}"
    return gateway, url, gateway_model(url, gateway)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="random:tiny")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--turns", type=int, default=200)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--sessions", type=int, default=1, help="conversations streaming at once in the CPU measurement")
    args = ap.parse_args()
    with LocalStack(heartbeats=None) as stack:
        stack.start_broker()
        stack.start_worker("w1", model=args.model, device=args.device, max_sessions=max(8, args.sessions + 2),
                           max_context=4096)
        stack.wait_for_workers({"w1"}, timeout=300)
        gw, url, model = start_gateway(stack)
        direct, through = asyncio.run(interleaved(stack.clients, url, model, args.turns))
        user0, sys0 = cpu_seconds(gw.pid)
        n = max(1, min(args.turns // 4, 3000 // (args.tokens + 1)))  # within one session's 4096 tokens
        asyncio.run(streamed(url, model, n, args.tokens, args.sessions))
        user1, sys1 = cpu_seconds(gw.pid)
        own0 = resource.getrusage(resource.RUSAGE_SELF)
        asyncio.run(native_streamed(stack.clients, model, n, args.tokens, args.sessions))
        own1 = resource.getrusage(resource.RUSAGE_SELF)
        gw.stop()
    d, h = statistics.median(direct) * 1e3, statistics.median(through) * 1e3
    tokens = n * args.sessions * args.tokens
    print(json.dumps({
        "turns": args.turns, "native_turn_ms_p50": round(d, 3), "gateway_turn_ms_p50": round(h, 3),
        "gateway_added_ms_p50": round(statistics.median(b - a for a, b in zip(direct, through, strict=True)) * 1e3, 3),
        "streaming_sessions": args.sessions,
        "gateway_user_cpu_ms_per_streamed_request": round((user1 - user0) / (n * args.sessions) * 1e3, 3),
        "gateway_user_cpu_us_per_streamed_token": round((user1 - user0) / (n * args.sessions * args.tokens) * 1e6, 1),
        "gateway_system_cpu_us_per_streamed_token": round((sys1 - sys0) / (n * args.sessions * args.tokens) * 1e6, 1),
        "native_client_user_cpu_us_per_streamed_token": round((own1.ru_utime - own0.ru_utime) / tokens * 1e6, 1),
        "native_client_system_cpu_us_per_streamed_token": round((own1.ru_stime - own0.ru_stime) / tokens * 1e6, 1),
    }, indent=2))

if __name__ == "__main__":
    main()
