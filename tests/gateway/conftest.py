"""A broker, one CPU worker with the bundled SmolLM2 and gateways in front of it, as processes on loopback, shared by
the module's tests; helpers to start more gateways and to read the worker's prefill counter."""

from __future__ import annotations

import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from client.stack import Daemon, LocalStack, free_port

MODEL = "SmolLM2-135M-Instruct"
SLOTS = 10
API_KEYS = {"alice": "alice-secret-key-0001", "bob": "bob-secret-key-000002"}


def http_get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=5) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()
    except OSError:
        return 0, ""


@dataclass
class Gateways:
    stack: LocalStack
    worker_metrics: str
    daemons: list[Daemon] = field(default_factory=list)

    def start(self, broker: str | None = None, extra: Sequence[str] = (), ready: bool = True) -> str:
        """A gateway process for `broker` (default: the stack's); its base URL once it answers /healthz (and /readyz)."""
        port = free_port()
        args = ["--broker", broker or self.stack.clients, "--port", str(port), "--timeout", "120", *extra]
        log = self.stack.log_dir / f"gateway-{port}.log"
        daemon = Daemon("client.gateway.cli", args, log, env=self.stack.env)
        self.daemons.append(daemon)
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 60
        while http_get(url + ("/readyz" if ready else "/healthz"))[0] != 200:
            assert daemon.alive, daemon.log_text()[-3000:]
            assert time.monotonic() < deadline, f"the gateway did not come up: {daemon.log_text()[-3000:]}"
            time.sleep(0.05)
        return url

    def prefilled(self) -> int:
        """The worker's sessionserve:prompt_tokens_total: prompt tokens it has computed so far."""
        status, text = http_get(self.worker_metrics)
        assert status == 200
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                if s.name == "sessionserve:prompt_tokens_total":
                    return int(s.value)
        raise AssertionError("no sessionserve:prompt_tokens_total")

    def close(self) -> None:
        for d in self.daemons:
            d.close()


@pytest.fixture(scope="package")
def gateways(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateways]:
    """The bundled SmolLM2 on the CPU (10 sessions of 1024 tokens, metrics on) behind a broker."""
    log_dir: Path = tmp_path_factory.mktemp("gateway")
    # The daemons' own heartbeats (1 s, 3 missed): a CPU worker computing SmolLM2 on a busy 2-core machine can
    # stay silent longer than the fast test setting allows.
    stack = LocalStack(log_dir, heartbeats=None)
    try:
        stack.start_broker()
        metrics_port = free_port()
        stack.start_worker("w1", device="cpu", max_sessions=SLOTS, max_context=1024,
                           extra=["--metrics-port", str(metrics_port)])
        stack.wait_for_workers({"w1"}, timeout=180)
        gw = Gateways(stack, f"http://127.0.0.1:{metrics_port}/metrics")
        yield gw
        gw.close()
    finally:
        stack.close()


@pytest.fixture(scope="package")
def gateway(gateways: Gateways) -> str:
    """A gateway without API keys on the shared stack (keeping at most 3 idle sessions): its base URL."""
    return gateways.start(extra=["--max-idle-sessions", "3"])


@pytest.fixture(scope="package")
def keyed_gateway(gateways: Gateways, tmp_path_factory: pytest.TempPathFactory) -> str:
    keys = tmp_path_factory.mktemp("keys") / "api-keys"
    keys.write_text("# name key\n" + "".join(f"{name} {key}\n" for name, key in API_KEYS.items()))
    return gateways.start(extra=["--api-keys", str(keys)])
