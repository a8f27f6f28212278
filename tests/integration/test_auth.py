"""CURVE security with real daemons: only allowed keys get in, each allow-list on its own socket, and a
session can be used only by the client key that created it (also after a broker restart)."""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TypedDict

import pytest

from client import Client, Unauthorized

from .cluster import ROOT, Cluster

PROMPT = [7, 8, 9, 10]


def keygen(directory: Path, name: str) -> None:
    """Through the real command, as an operator would."""
    out = subprocess.run([sys.executable, "-m", "broker.cli", "keygen", str(directory), name], cwd=ROOT,
                         capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.split() == [str(directory / f"{name}.key"), str(directory / f"{name}.key_secret")]


@pytest.fixture(scope="module")
def keys(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("keys")
    keygen(root, "broker")
    keygen(root / "workers", "w1")
    keygen(root / "clients", "alice")
    keygen(root / "clients", "bob")
    keygen(root / "clients", "ops")
    (root / "admins").mkdir()
    shutil.copy(root / "clients" / "ops.key", root / "admins" / "ops.key")  # a client key that may close any session
    keygen(root / "outsiders", "eve")  # a valid key pair the broker does not know
    return root


@pytest.fixture(scope="module")
def secured(tmp_path_factory: pytest.TempPathFactory, keys: Path) -> Iterator[Cluster]:
    cluster = Cluster(tmp_path_factory.mktemp("secured"), recovery_ms=3000)
    try:
        cluster.start_broker(["--keys", str(keys)])
        cluster.start_worker("w1", extra=worker_keys(keys, keys / "workers" / "w1.key_secret"))
        cluster.wait_for_workers({"w1"}, **as_client(keys, "alice"))
        yield cluster
    finally:
        cluster.close()


def worker_keys(keys: Path, secret: Path) -> list[str]:
    return ["--broker-key", str(keys / "broker.key"), "--key", str(secret)]


class Credentials(TypedDict, total=False):
    """A client's key files, as Client (and Cluster.client) takes them by name; none: a client without keys."""

    broker_key: Path
    key: Path


def as_client(keys: Path, name: str, where: str = "clients") -> Credentials:
    return {"broker_key": keys / "broker.key", "key": keys / where / f"{name}.key_secret"}


def test_keygen_refuses_to_overwrite_a_key(keys: Path) -> None:
    out = subprocess.run([sys.executable, "-m", "broker.cli", "keygen", str(keys), "broker"], cwd=ROOT,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 1 and "not overwriting a key" in out.stderr
    assert (keys / "broker.key_secret").stat().st_mode & 0o777 == 0o600


def test_a_session_belongs_to_the_key_that_created_it(secured: Cluster, keys: Path) -> None:
    with secured.client(**as_client(keys, "alice")) as alice, secured.client(**as_client(keys, "bob")) as bob:
        with alice.session() as mine:
            mine.append(token_ids=PROMPT)
            expected = mine.fork().generate(max_tokens=6, ignore_eos=True).token_ids  # the fork is alice's too
            theirs = bob.attach(mine.id)
            attempts: dict[str, Callable[[], object]] = {
                "info": theirs.info, "append": lambda: theirs.append(token_ids=[1]),
                "generate": lambda: theirs.generate(max_tokens=2), "fork": theirs.fork, "close": theirs.close,
            }
            for attempt in attempts.values():
                with pytest.raises(Unauthorized, match="belongs to another client"):
                    attempt()
            theirs.generate(max_tokens=2, stream=True).close()  # a cancel from bob is ignored, not an error
            assert mine.info().length == len(PROMPT)  # untouched by all of bob's attempts
            assert mine.generate(max_tokens=6, ignore_eos=True).token_ids == expected
            with bob.session() as own:  # bob has his own sessions, of course
                own.append(token_ids=PROMPT)
                assert own.generate(max_tokens=6, ignore_eos=True).token_ids == expected


@pytest.mark.parametrize("who", ["no keys", "unknown key", "wrong broker key"])
def test_unauthenticated_clients_are_refused_and_others_keep_working(secured: Cluster, keys: Path, who: str) -> None:
    credentials = {
        "no keys": Credentials(),
        "unknown key": as_client(keys, "eve", "outsiders"),
        "wrong broker key": Credentials(broker_key=keys / "outsiders" / "eve.key", key=keys / "clients" / "alice.key_secret"),
    }[who]
    with secured.client(timeout=1.5, **credentials) as stranger:
        started = time.monotonic()
        with pytest.raises(Unauthorized, match="refused this client's handshake"):
            stranger.session()
        assert time.monotonic() - started < 3
    with secured.client(**as_client(keys, "alice")) as alice, alice.session() as s:
        assert s.append(token_ids=PROMPT) == len(PROMPT)


@pytest.mark.parametrize("who", ["no keys", "unknown key"])
def test_a_refused_client_is_told_unauthorized_at_once_not_after_its_timeout_and_again_on_its_next_call(
    secured: Cluster, keys: Path, who: str
) -> None:
    """With the default timeout (60 s): it used to wait it out, or be told `Timeout: send queue is full (is the broker
    up?)` on its next call."""
    credentials = Credentials() if who == "no keys" else as_client(keys, "eve", "outsiders")
    with Client(secured.clients, **credentials) as stranger:
        for attempt in (stranger.session, stranger.status, lambda: stranger.attach("a" * 32).info()):
            started = time.monotonic()
            with pytest.raises(Unauthorized, match="refused this client's handshake"):
                attempt()
            assert time.monotonic() - started < 2.0


def test_an_async_client_is_told_unauthorized_at_once(secured: Cluster) -> None:
    import asyncio

    from client import AsyncClient

    async def attempt() -> list[float]:
        waited = []
        async with AsyncClient(secured.clients) as stranger:
            for _ in range(2):
                started = time.monotonic()
                with pytest.raises(Unauthorized, match="refused this client's handshake"):
                    await stranger.session()
                waited.append(time.monotonic() - started)
        return waited

    assert max(asyncio.run(attempt())) < 2.0


def test_keygen_makes_the_secret_private_whatever_the_umask(tmp_path: Path) -> None:
    out = subprocess.run(["sh", "-c", f"umask 000 && {sys.executable} -m broker.cli keygen {tmp_path} k"], cwd=ROOT,
                         capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.split() == [str(tmp_path / "k.key"), str(tmp_path / "k.key_secret")]
    assert (tmp_path / "k.key_secret").stat().st_mode & 0o777 == 0o600
    assert (tmp_path / "k.key").stat().st_mode & 0o777 == 0o644


def test_a_broker_whose_secret_key_others_can_read_exits_with_code_3(cluster: Cluster, tmp_path: Path) -> None:
    keygen(tmp_path, "broker")
    for d in ("workers", "clients"):
        (tmp_path / d).mkdir()
    (tmp_path / "broker.key_secret").chmod(0o644)
    broker = cluster.start_broker(["--keys", str(tmp_path)])
    assert broker.proc.wait(timeout=30) == 3
    assert "has mode 0644: other users may read it" in broker.log_text()


def test_workers_need_a_worker_key(secured: Cluster, keys: Path) -> None:
    """A client's key cannot register as a worker, and neither can a worker without keys."""
    secured.start_worker("mallory", extra=worker_keys(keys, keys / "clients" / "bob.key_secret"))
    secured.start_worker("anon")
    deadline = time.monotonic() + 60  # loading the model takes a while on a busy machine
    for name in ("mallory", "anon"):
        while "broker_refused_handshake" not in secured.workers[name].log_text():
            assert secured.workers[name].alive and time.monotonic() < deadline, secured.workers[name].log_text()
            time.sleep(0.05)
    time.sleep(0.5)  # five heartbeats more: time to register, were it allowed
    with secured.client(**as_client(keys, "alice")) as alice:
        assert [w.name for w in alice.status()] == ["w1"]
        with alice.session() as s:
            assert s.worker == "w1"
    for name in ("mallory", "anon"):
        secured.workers.pop(name).close()


def test_ownership_survives_a_broker_restart(secured: Cluster, keys: Path) -> None:
    with secured.client(**as_client(keys, "alice")) as alice:
        s = alice.session()
        s.append(token_ids=PROMPT)
        assert secured.broker is not None
        secured.broker.kill()
        secured.start_broker(["--keys", str(keys)])
        assert s.append(token_ids=[5]) == len(PROMPT) + 1  # held until w1 re-registered, then served
    with secured.client(**as_client(keys, "bob")) as bob:
        with pytest.raises(Unauthorized, match="belongs to another client"):
            bob.attach(s.id).info()
    with secured.client(**as_client(keys, "alice")) as alice:
        alice.attach(s.id).close()


def test_without_keys_the_broker_says_it_is_open_and_stays_on_loopback(cluster: Cluster) -> None:
    cluster.start_broker()
    deadline = time.monotonic() + 20
    assert cluster.broker is not None
    while "auth_disabled" not in cluster.broker.log_text():
        assert time.monotonic() < deadline, cluster.broker.log_text()
        time.sleep(0.05)
    line = next(x for x in cluster.broker.log_text().splitlines() if "auth_disabled" in x)
    assert "loopback only" in line
    assert cluster.clients.startswith("tcp://127.0.0.1:")


def test_a_broker_with_an_incomplete_key_directory_exits_with_code_3(cluster: Cluster, tmp_path: Path) -> None:
    keygen(tmp_path, "broker")  # no workers/ or clients/ allow-list
    broker = cluster.start_broker(["--keys", str(tmp_path)])
    assert broker.proc.wait(timeout=30) == 3
    assert "workers is missing" in broker.log_text()


def test_an_unauthenticated_client_can_be_used_with_the_client_helper(keys: Path) -> None:
    """Both key files or neither: one alone is a clear error before anything is sent."""
    with pytest.raises(ValueError, match="give both broker_key"):
        Client("tcp://127.0.0.1:1", key=keys / "clients" / "alice.key_secret")


def test_loadtest_drives_a_secured_broker_with_its_keys(secured: Cluster, keys: Path) -> None:
    from client.bench.loadtest import LoadConfig, run

    creds = as_client(keys, "bob")
    report = run(LoadConfig(broker=secured.clients, sessions=2, prompt_tokens=8, max_tokens=4, turns=2, ignore_eos=True,
                            broker_key=str(creds["broker_key"]), key=str(creds["key"])))
    assert (report.completed, report.failed, report.total_output_tokens) == (4, 0, 16)


def test_an_async_client_without_keys_is_told_it_was_refused(secured: Cluster) -> None:
    import asyncio

    from client import AsyncClient

    async def attempt() -> None:
        async with AsyncClient(secured.clients, timeout=1.5) as stranger:
            with pytest.raises(Unauthorized, match="refused this client's handshake"):
                await stranger.session()

    asyncio.run(attempt())


def test_broker_sessions_and_close_session_with_keys_a_client_s_own_and_an_admin_any(secured: Cluster, keys: Path) -> None:
    def cli(who: str, *args: str) -> tuple[int, str, str]:
        out = subprocess.run([sys.executable, "-m", "broker.cli", *args, "--clients", secured.clients,
                              "--broker-key", str(keys / "broker.key"), "--key", str(keys / "clients" / f"{who}.key_secret")],
                             cwd=ROOT, capture_output=True, text=True, timeout=60)
        return out.returncode, out.stdout, out.stderr

    def owners(who: str) -> dict[str, str]:
        code, out, err = cli(who, "sessions", "--json")
        assert (code, err) == (0, "")
        return {e["session"]: e["owner"] for e in json.loads(out)}

    def key_of(name: str) -> str:
        text = (keys / "clients" / f"{name}.key").read_text()
        return text.split('public-key = "', 1)[1].split('"', 1)[0]

    with secured.client(**as_client(keys, "alice")) as alice, secured.client(**as_client(keys, "bob")) as bob:
        mine, theirs = alice.session(), bob.session()
        hers = owners("alice")  # her own only (earlier tests of this module left some of hers too)
        assert hers[mine.id] == key_of("alice") and set(hers.values()) == {key_of("alice")}
        everyone = owners("ops")
        assert (everyone[mine.id], everyone[theirs.id]) == (key_of("alice"), key_of("bob")) and hers.items() <= everyone.items()
        code, out, err = cli("bob", "close-session", mine.id)
        assert code == 1 and "answered unauthorized: session " in err and "belongs to another client" in err
        assert cli("ops", "close-session", theirs.id) == (0, f"closed {theirs.id}\n", "")
        assert theirs.id not in owners("ops") and mine.id in owners("ops")
        assert mine.info().length == 0
        mine.close()


def test_a_malformed_public_key_file_is_exit_3_at_start_and_keeps_the_keys_in_force_on_sighup(
    cluster: Cluster, tmp_path: Path,
) -> None:
    keygen(tmp_path, "broker")
    keygen(tmp_path / "workers", "w1")
    (tmp_path / "clients").mkdir()
    (tmp_path / "clients" / "typo.key").write_text("not a certificate\n")
    broker = cluster.start_broker(["--keys", str(tmp_path)])
    assert broker.proc.wait(timeout=30) == 3
    assert f"No public key found in {tmp_path / 'clients' / 'typo.key'}" in broker.log_text()
    (tmp_path / "clients" / "typo.key").unlink()
    broker = cluster.start_broker(["--keys", str(tmp_path)])
    deadline = time.monotonic() + 30
    while '"event": "broker_started"' not in broker.log_text():
        assert time.monotonic() < deadline and broker.proc.poll() is None
        time.sleep(0.05)
    (tmp_path / "clients" / "typo.key").write_text("not a certificate\n")
    broker.proc.send_signal(signal.SIGHUP)  # (systemctl reload)
    while "keys_reload_failed" not in broker.log_text():
        assert time.monotonic() < deadline and broker.proc.poll() is None
        time.sleep(0.05)
    assert broker.proc.poll() is None  # on the allow-lists it had
    assert broker.terminate() == 0
