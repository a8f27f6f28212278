"""Fixtures that start real daemons. Every cluster is stopped when its scope ends, pass or fail."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from .cluster import Cluster, Measure


@pytest.fixture(scope="module")
def one_worker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    """A broker and one random:tiny worker ("w1", 4 sessions), shared by a module's tests."""
    cluster = Cluster(tmp_path_factory.mktemp("one_worker"))
    try:
        cluster.start_broker()
        cluster.start_worker("w1", max_sessions=4)
        cluster.wait_for_workers({"w1"})
        yield cluster
    finally:
        cluster.close()


@pytest.fixture
def cluster(tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest) -> Iterator[Cluster]:
    """An empty cluster for one test (which starts what it needs). `@pytest.mark.parametrize("cluster",
    [{"recovery_ms": ...}], indirect=True)` changes its settings."""
    cluster = Cluster(tmp_path_factory.mktemp("cluster"), **getattr(request, "param", {}))
    try:
        yield cluster
    finally:
        cluster.close()


@pytest.fixture
def measure(request: pytest.FixtureRequest) -> Measure:
    """Record a measured value: in the test's `user_properties` (not through record_property, which warns under
    junit_family xunit2) and as a `measured NAME=VALUE` line on stdout (`pytest -rP` or `-s` shows them)."""

    def record(name: str, value: float) -> None:
        request.node.user_properties.append((name, value))
        print(f"measured {name}={value}")

    return record
