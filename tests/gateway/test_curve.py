"""A broker that authenticates (CURVE): the gateway holds one client key; without an allowed key it is not ready and
answers 503."""

from __future__ import annotations

import json
import urllib.request
from pathlib import Path

from broker.common import keys
from client.stack import LocalStack

from .conftest import Gateways, http_get


def test_the_gateway_reaches_a_curve_broker_with_its_client_key(tmp_path: Path) -> None:
    root = tmp_path / "keys"
    keys.keygen(root, "broker")
    keys.keygen(root / "workers", "w1")
    keys.keygen(root / "clients", "gateway")
    keys.keygen(tmp_path / "outsiders", "eve")
    with LocalStack(tmp_path, heartbeats=None) as stack:
        stack.start_broker(["--keys", str(root)])
        stack.start_worker("w1", model="random:tiny", device="cpu", max_sessions=2,
                           extra=["--broker-key", str(root / "broker.key"), "--key", str(root / "workers" / "w1.key_secret")])
        stack.wait_for_workers({"w1"}, timeout=120, broker_key=root / "broker.key",
                               key=root / "clients" / "gateway.key_secret")
        gateways = Gateways(stack, "")
        try:
            url = gateways.start(extra=["--broker-key", str(root / "broker.key"), "--key",
                                        str(root / "clients" / "gateway.key_secret")])
            body = json.dumps({"model": "random-tiny", "prompt": [1, 2, 3], "max_tokens": 2, "temperature": 0}).encode()
            request = urllib.request.Request(url + "/v1/completions", data=body, headers={"Content-Type": "application/json"})
            with urllib.request.urlopen(request, timeout=60) as r:
                assert json.loads(r.read())["usage"]["completion_tokens"] == 2
            outsider = gateways.start(ready=False, extra=["--broker-key", str(root / "broker.key"), "--key",
                                                         str(tmp_path / "outsiders" / "eve.key_secret")])
            status, why = http_get(outsider + "/readyz")
            assert status == 503 and "does not answer" in why
            status, answer = http_get(outsider + "/v1/models")
            assert status == 503 and json.loads(answer)["error"]["code"] == "no_worker"
        finally:
            gateways.close()
