"""The worker's metrics: weighted bucket math, the per-step and per-generation hooks, the exposition."""

from __future__ import annotations

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

import worker.serve.metrics as wm
from broker.common import protocol as p
from worker.serve.metrics import Buckets, WorkerMetrics, WorkerSnapshot, buckets_1_2_5, torch_memory, worker_readiness

LABELS = (("device", "cpu"), ("model", "tiny"), ("worker", "w1"))
SNAPSHOT = WorkerSnapshot(sessions=3, capacity=8, free_slots=5, running=2, bytes_per_session=1 << 20)
# Times are exact binary fractions so that differences land exactly on bucket bounds.
T0 = 10.0
TICK = 1 / 512  # 0.001953125 s: in the (0.0015, 0.002] bucket of the inter-token histogram

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def scrape(metrics: WorkerMetrics) -> Samples:
    out: Samples = {}
    for family in text_string_to_metric_families(generate_latest(metrics.registry).decode()):
        for s in family.samples:
            if s.name.startswith("sessionserve:"):
                out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def labels(**extra: str) -> tuple[tuple[str, str], ...]:
    return tuple(sorted((*LABELS, *extra.items())))


def histogram(got: Samples, name: str) -> dict[str, float]:
    """le -> cumulative count of one histogram, plus "count" and "sum"."""
    out = {dict(k[1])["le"]: v for k, v in got.items() if k[0] == f"sessionserve:{name}_bucket"}
    out["count"] = got[(f"sessionserve:{name}_count", LABELS)]
    out["sum"] = got[(f"sessionserve:{name}_sum", LABELS)]
    return out


def nonzero(h: dict[str, float]) -> dict[str, float]:
    """The buckets where the cumulative count changes, plus count and sum: what a test can state exactly."""
    out: dict[str, float] = {}
    previous = 0.0
    for le, n in h.items():
        if le in ("count", "sum"):
            out[le] = n
        elif n != previous:
            out[le] = n
            previous = n
    return out


def new_metrics(snapshot: WorkerSnapshot = SNAPSHOT, **kw: object) -> WorkerMetrics:
    return WorkerMetrics(lambda: snapshot, worker="w1", model="tiny", device="cpu", max_context=100,
                         process=False, **kw)  # type: ignore[arg-type]


# -- bucket math ---------------------------------------------------------------------------------------


def test_weighted_observations_land_in_their_le_bucket_once_each() -> None:
    b = Buckets((0.001, 0.002, 0.005))
    b.observe(0.0015, 64)  # 64 generations, one gap each, one bisect
    b.observe(0.001, 2)  # on a bound: that bound's bucket (le is <=)
    b.observe(1.0)  # above every bound: +Inf
    assert b.counts == [2, 64, 0, 1]
    assert b.count == 67
    cumulative, total = b.cumulative()
    assert cumulative == [("0.001", 2.0), ("0.002", 66.0), ("0.005", 66.0), ("+Inf", 67.0)]
    assert total == pytest.approx(0.0015 * 64 + 0.001 * 2 + 1.0)


@pytest.mark.parametrize("bounds", [(), (1.0, 1.0), (2.0, 1.0)])
def test_bucket_bounds_must_increase(bounds: tuple[float, ...]) -> None:
    with pytest.raises(ValueError, match="increasing"):
        Buckets(bounds)


def test_1_2_5_buckets_stop_at_the_maximum() -> None:
    assert buckets_1_2_5(100) == (1, 2, 5, 10, 20, 50, 100)
    assert buckets_1_2_5(2048) == (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000)
    assert buckets_1_2_5(1) == (1,)


# -- hooks ---------------------------------------------------------------------------------------------


def run_two_generations(m: WorkerMetrics) -> None:
    """g1 and g2 prefill together (30 prompt tokens) and each get a token per step; g1 ends at EOS in step 4
    (2 tokens), g2 is cancelled after step 4 (3 tokens)."""
    m.generation_started("g1", T0)
    m.generation_started("g2", T0)
    # step 1: the prefill, both first tokens
    m.first_token("g1", T0 + 0.125)
    m.first_token("g2", T0 + 0.125)
    m.step(T0 + 0.125, 0.125, rows=2, prefill_tokens=30, new_tokens=2)
    # steps 2 and 3: one token each, a gap of TICK
    m.step(T0 + 0.125 + TICK, TICK, rows=2, prefill_tokens=0, new_tokens=2)
    m.step(T0 + 0.125 + 2 * TICK, TICK, rows=2, prefill_tokens=0, new_tokens=2)
    # step 4: g1 samples EOS (no token delivered), g2 one more token
    m.step(T0 + 0.125 + 3 * TICK, TICK, rows=2, prefill_tokens=0, new_tokens=1)
    m.generation_finished("g1", T0 + 0.125 + 3 * TICK, tokens=2, reason="stop")
    m.generation_finished("g2", T0 + 0.25, tokens=3, reason="cancelled")


def test_steps_count_tokens_and_add_one_weighted_gap_observation_per_step() -> None:
    m = new_metrics()
    run_two_generations(m)
    assert (m.steps, m.prompt_tokens, m.generation_tokens) == (4, 30, 7)
    assert m.itl.counts[m.itl.bounds.index(0.002)] == 5  # steps 2, 3 (2 gaps each) and 4 (1): first tokens excluded
    assert m.itl.count == 5
    assert m.itl.sum == pytest.approx(5 * TICK)
    assert m.ttft.count == 2 and m.ttft.sum == 0.25
    assert m.batch.counts[m.batch.bounds.index(2)] == 4
    assert m.finished == {"stop": 1, "cancelled": 1}


def test_the_first_step_ever_has_no_previous_step_to_measure_a_gap_from() -> None:
    m = new_metrics()
    m.step(T0, 0.01, rows=4, prefill_tokens=0, new_tokens=4)  # decode rows of generations the metrics never saw start
    assert m.itl.count == 0
    m.step(T0 + TICK, TICK, rows=4, prefill_tokens=0, new_tokens=4)
    assert m.itl.count == 4


def test_a_step_that_ran_no_batch_is_not_counted_and_keeps_the_gap_measured_from_the_last_batch() -> None:
    m = new_metrics()
    m.step(T0, 0.01, rows=1, prefill_tokens=0, new_tokens=1)
    m.step(T0 + TICK / 2, 0.0, rows=0, prefill_tokens=0, new_tokens=0)  # only cancellations reported
    m.step(T0 + TICK, TICK, rows=1, prefill_tokens=0, new_tokens=1)
    assert m.steps == 2
    assert (m.itl.count, m.itl.sum) == (1, TICK)


def test_a_call_that_only_launches_and_one_that_only_reads_count_one_step_and_gaps_between_deliveries() -> None:
    # On a GPU a step launched afresh is read by the next call: the first call launches (rows, no tokens),
    # the second reads (tokens, no launch).
    m = new_metrics()
    m.step(T0, 0.01, rows=2, prefill_tokens=0, new_tokens=2)
    m.step(T0 + TICK / 4, 0.001, rows=2, prefill_tokens=16, new_tokens=0)  # launches a prefill beside the decode rows
    m.step(T0 + TICK, 0.003, rows=0, prefill_tokens=0, new_tokens=2)  # reads it
    assert (m.steps, m.prompt_tokens, m.generation_tokens) == (2, 16, 4)
    assert (m.itl.count, m.itl.sum) == (2, 2 * TICK)  # from the last delivery, not from the launch
    assert m.batch.count == 2


def test_a_generation_that_ends_at_its_first_token_has_a_ttft_and_one_that_is_cancelled_first_has_none() -> None:
    m = new_metrics()
    m.generation_started("eos", T0)
    m.generation_started("gone", T0)
    m.step(T0 + 0.125, 0.125, rows=2, prefill_tokens=8, new_tokens=0)
    m.generation_finished("eos", T0 + 0.125, tokens=0, reason="stop")
    m.generation_finished("gone", T0 + 0.125, tokens=0, reason="cancelled")
    assert (m.ttft.count, m.ttft.sum) == (1, 0.125)
    assert (m.e2e.count, m.e2e.sum) == (2, 0.25)
    assert m.itl.count == 0


def test_a_failed_generation_counts_no_success_and_no_latency() -> None:
    m = new_metrics()
    m.generation_started("g", T0)
    m.error(p.ErrorCode.INTERNAL)
    m.generation_finished("g", T0 + 1, tokens=0, reason="error")
    assert m.finished == {} and m.e2e.count == 0 and m.errors == {p.ErrorCode.INTERNAL: 1}
    m.first_token("g", T0 + 2)  # late or repeated hooks for a finished generation do nothing
    m.generation_finished("g", T0 + 2, tokens=1, reason="stop")
    assert m.ttft.count == 0 and m.e2e.count == 0 and m.finished == {"stop": 1}


def test_generations_never_finished_are_forgotten_past_max_open(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(wm, "MAX_OPEN", 2)
    m = new_metrics()
    for key in ("a", "b", "c"):
        m.generation_started(key, T0)
    assert list(m._started) == ["b", "c"] and list(m._waiting_first) == ["b", "c"]


# -- the exposition ------------------------------------------------------------------------------------


def test_the_exposition_has_exact_gauges_counters_and_histograms() -> None:
    m = new_metrics()
    m.request(p.Command.GENERATE)
    m.request(p.Command.GENERATE)
    m.request("create")
    m.error(p.ErrorCode.SESSION_NOT_FOUND)
    run_two_generations(m)
    got = scrape(m)
    scalars = {k: v for k, v in got.items() if not k[0].endswith(("_bucket", "_count", "_sum"))}
    assert scalars == {
        ("sessionserve:num_sessions", LABELS): 3,
        ("sessionserve:session_capacity", LABELS): 8,
        ("sessionserve:free_slots", LABELS): 5,
        ("sessionserve:num_requests_running", LABELS): 2,
        ("sessionserve:kv_cache_usage_perc", LABELS): 0.375,
        ("sessionserve:draining", LABELS): 0,
        ("sessionserve:session_bytes", LABELS): 1 << 20,
        ("sessionserve:session_state_bytes", LABELS): 3 << 20,
        ("sessionserve:engine_steps_total", LABELS): 4,
        ("sessionserve:generation_tokens_total", LABELS): 7,
        ("sessionserve:prompt_tokens_total", LABELS): 30,
        ("sessionserve:requests_total", labels(command="create")): 1,
        ("sessionserve:requests_total", labels(command="generate")): 2,
        ("sessionserve:request_errors_total", labels(code="session_not_found")): 1,
        ("sessionserve:request_success_total", labels(finished_reason="cancelled")): 1,
        ("sessionserve:request_success_total", labels(finished_reason="stop")): 1,
    }
    assert nonzero(histogram(got, "inter_token_latency_seconds")) == {"0.002": 5, "count": 5, "sum": 5 * TICK}
    assert nonzero(histogram(got, "time_to_first_token_seconds")) == {"0.25": 2, "count": 2, "sum": 0.25}
    # g1: 0.125 + 3 TICK = 0.130859375 s; g2: 0.25 s
    assert nonzero(histogram(got, "e2e_request_latency_seconds")) == {
        "0.2": 1, "0.3": 2, "count": 2, "sum": 0.130859375 + 0.25}
    assert nonzero(histogram(got, "request_generation_tokens")) == {"2.0": 1, "5.0": 2, "count": 2, "sum": 5}
    assert nonzero(histogram(got, "engine_step_batch_size")) == {"2.0": 4, "count": 4, "sum": 8}
    assert nonzero(histogram(got, "iteration_tokens_total")) == {
        "1.0": 1, "8.0": 3, "32.0": 4, "count": 4, "sum": 32 + 2 + 2 + 1}
    assert nonzero(histogram(got, "engine_step_duration_seconds")) == {
        "0.002": 3, "0.25": 4, "count": 4, "sum": 0.125 + 3 * TICK}
    ttft = histogram(got, "time_to_first_token_seconds")
    assert list(ttft)[:3] == ["0.001", "0.005", "0.01"] and list(ttft)[-3:] == ["+Inf", "count", "sum"]


def test_empty_metrics_export_zero_histograms_and_no_session_bytes_when_unknown() -> None:
    m = new_metrics(WorkerSnapshot(sessions=0, capacity=0, free_slots=0, running=0))
    got = scrape(m)
    assert got[("sessionserve:kv_cache_usage_perc", LABELS)] == 0.0
    assert ("sessionserve:session_bytes", LABELS) not in got
    assert histogram(got, "inter_token_latency_seconds")["+Inf"] == 0
    assert histogram(got, "inter_token_latency_seconds")["count"] == 0


def test_memory_gauges_come_from_the_probe_and_a_failing_probe_only_drops_them() -> None:
    m = new_metrics(memory=lambda: {"gpu_memory_allocated_bytes": 123.0, "gpu_memory_reserved_bytes": 456.0})
    got = scrape(m)
    assert got[("sessionserve:gpu_memory_allocated_bytes", LABELS)] == 123.0
    assert got[("sessionserve:gpu_memory_reserved_bytes", LABELS)] == 456.0

    def broken() -> dict[str, float]:
        raise RuntimeError("no driver")

    got = scrape(new_metrics(memory=broken))
    assert ("sessionserve:gpu_memory_allocated_bytes", LABELS) not in got
    assert got[("sessionserve:num_sessions", LABELS)] == 3


def test_torch_memory_is_for_cuda_devices_only() -> None:
    assert torch_memory("cpu") is None
    assert torch_memory("cuda:0") is not None


def test_worker_readiness() -> None:
    assert worker_readiness(registered=True, draining=False) == (True, "ready")
    assert worker_readiness(registered=False, draining=False) == (False, "not registered with the broker")
    assert worker_readiness(registered=True, draining=True) == (False, "draining")


def test_where_sessions_are_pages_and_restore_latency() -> None:
    snapshot = WorkerSnapshot(sessions=7, capacity=8, free_slots=3, running=1, bytes_per_session=1 << 20,
                              mapped_bytes=6 << 21, resident=4, in_host=2, on_disk=1, pages=5, page_budget=40,
                              hibernated=9)
    metrics = new_metrics(snapshot)
    metrics.restored(0.0015, "host")
    metrics.restored(0.004, "host")
    metrics.restored(0.2, "disk")
    metrics.restored(1.0, "elsewhere")  # not a source: ignored
    got = scrape(metrics)
    assert [got[("sessionserve:sessions", labels(where=w))] for w in ("resident", "host", "disk")] == [4, 2, 1]
    assert got[("sessionserve:state_pages", LABELS)] == 5
    assert got[("sessionserve:state_page_budget", LABELS)] == 40
    assert got[("sessionserve:sessions_hibernated_total", LABELS)] == 9
    host = {dict(k[1])["le"]: v for k, v in got.items()
            if k[0] == "sessionserve:session_restore_seconds_bucket" and dict(k[1])["source"] == "host"}
    assert host["0.001"] == 0 and host["0.002"] == 1 and host["0.005"] == 2 and host["+Inf"] == 2
    assert got[("sessionserve:session_restore_seconds_count", labels(source="disk"))] == 1
    assert got[("sessionserve:session_restore_seconds_sum", labels(source="disk"))] == pytest.approx(0.2)


@pytest.mark.parametrize(("resident", "free_slots", "pages", "budget", "usage"), [
    (3, 4, 3, 4, 0.75),  # hibernation on: free_slots counts the 3 idle resident sessions too, the table is 3/4 full
    (1, 3, 4, 4, 1.0),  # one long session holds every page: no create fits
    (0, 4, 0, 4, 0.0),  # all hibernated
])
def test_kv_cache_usage_is_the_fuller_of_resident_slots_and_pages(resident: int, free_slots: int, pages: int, budget: int,
                                                                 usage: float) -> None:
    snapshot = WorkerSnapshot(sessions=3, capacity=4, free_slots=free_slots, running=0, bytes_per_session=1 << 20,
                              resident=resident, in_host=3 - resident, pages=pages, page_budget=budget)
    assert scrape(new_metrics(snapshot))[("sessionserve:kv_cache_usage_perc", LABELS)] == usage


def test_a_worker_that_does_not_hibernate_has_no_residency_gauges() -> None:
    got = scrape(new_metrics())
    assert not [k for k in got if k[0] in ("sessionserve:sessions", "sessionserve:state_pages")]


def test_checkpoints_are_counted_where_the_model_has_a_recurrent_state() -> None:
    hybrid = WorkerSnapshot(sessions=2, capacity=8, free_slots=6, running=0, checkpoints=(2, 7, 3, 1))
    got = scrape(new_metrics(hybrid))
    assert got[("sessionserve:state_checkpoints_held", LABELS)] == 2
    assert [got[("sessionserve:state_checkpoints_total", labels(event=e))]
            for e in ("taken", "used", "restored")] == [7, 3, 1]
    assert not [k for k in scrape(new_metrics()) if k[0].startswith("sessionserve:state_checkpoints")]


def test_moves_are_counted_by_event_where_the_worker_moves_sessions() -> None:
    moving = WorkerSnapshot(sessions=1, capacity=8, free_slots=7, running=0,
                            moves={"sent": 3, "released": 2, "imported": 4, "failed": 1})
    got = scrape(new_metrics(moving))
    assert {e: got[("sessionserve:session_moves_total", labels(event=e))]
            for e in ("sent", "released", "imported", "failed")} == {"sent": 3, "released": 2, "imported": 4, "failed": 1}
    assert not [k for k in scrape(new_metrics()) if k[0] == "sessionserve:session_moves_total"]
