"""The engine running one step ahead (launching the next decode step before reading the last) gives
exactly what one step at a time gives: the same tokens, texts and finish reasons for every request,
the same session states, through new arrivals, cancels, closes, forks, stops and length limits.

On the CPU the executor is synchronous, so running ahead gains nothing there and is off by default;
these tests force it on to check the bookkeeping (the GPU tests cover it on the real executor).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import pytest

from tests.worker.faults import fail_once
from worker.engine import Engine
from worker.engine.sampling import SamplingParams


@pytest.fixture
def tiny(engine: Engine) -> Iterator[Engine]:
    """The shared bundled-model engine (real text, so stop strings and ids really fire), overlap restored."""
    yield engine
    engine.overlap = False


PROMPTS = [
    "The capital of France is",
    "Once upon a time, in a small village by the sea, there lived",
    "def fibonacci(n):",
    "The three primary colours are",
    "Water boils at",
    "List of fruits: apple, banana,",
    "My favourite book is",
    "In 1969, the first",
    "The weather today is",
    "Photosynthesis is the process by which plants",
]


def prompt(engine: Engine, i: int) -> list[int]:
    return engine.tokenizer.encode(PROMPTS[i % len(PROMPTS)])


@dataclass
class Run:
    """What one drive of the scenario produced."""

    outputs: dict[str, tuple[list[int], str, str | None]] = field(default_factory=dict)  # name -> ids, text, reason
    sessions: dict[str, list[int]] = field(default_factory=dict)
    steps: int = 0
    ahead: int = 0  # steps launched before the previous one was read


def drive(engine: Engine, overlap: bool, stop_id: int, stop_text: str) -> Run:
    """A fixed scenario whose events fire on the progress of requests, not on step counts."""
    engine.overlap = overlap
    run = Run()
    engine.overlap = overlap
    sid = {name: engine.create_session() for name in "ABCEF"}
    for i, name in enumerate("ABCEF"):
        engine.append(sid[name], token_ids=prompt(engine, i))
    names: dict[str, str] = {}  # engine request id -> name

    def start(name: str, session: str, **kw: object) -> None:
        rid = engine.start_generate(session, SamplingParams(**kw))  # type: ignore[arg-type]
        names[rid] = name
        run.outputs[name] = ([], "", None)

    start("A", sid["A"], max_tokens=14, ignore_eos=True)
    start("B", sid["B"], max_tokens=20, temperature=0.8, top_p=0.9, seed=5, ignore_eos=True)
    start("C", sid["C"], max_tokens=20, ignore_eos=True)
    start("E", sid["E"], max_tokens=20, stop_token_ids=(stop_id,), ignore_eos=True)
    start("F", sid["F"], max_tokens=1, ignore_eos=True)
    fired: set[str] = set()

    def got(name: str) -> int:
        return len(run.outputs[name][0]) if name in run.outputs else 0

    def open_and_start_d() -> None:
        engine.append(sid.setdefault("D", engine.create_session()), token_ids=prompt(engine, 5))
        start("D", sid["D"], max_tokens=12, stop=(stop_text,), ignore_eos=True)

    events: list[tuple[str, Callable[[], bool], Callable[[], None]]] = [
        ("D", lambda: got("A") >= 2, open_and_start_d),
        ("cancel B", lambda: got("B") >= 3, lambda: engine.cancel(next(r for r, n in names.items() if n == "B"))),
        ("close C", lambda: got("C") >= 4, lambda: (engine.close(sid.pop("C")))),
        ("fork F", lambda: run.outputs["F"][2] is not None,
         lambda: start("G", sid.setdefault("G", engine.fork(sid["F"])), max_tokens=6, ignore_eos=True)),
        ("again A", lambda: run.outputs["A"][2] is not None,
         lambda: start("A2", sid["A"], max_tokens=5, temperature=0.7, seed=11, ignore_eos=True)),
    ]
    launched_before = engine.steps
    while engine.has_work():
        inflight_before = engine._unread is not None
        for chunk in engine.step():
            name = names[chunk.request_id]
            ids, text, _ = run.outputs[name]
            run.outputs[name] = (ids + chunk.token_ids, text + chunk.text, chunk.finish_reason)
        run.ahead += inflight_before
        for key, when, do in events:
            if key not in fired and when():
                fired.add(key)
                do()
    assert fired == {key for key, _, _ in events}
    run.steps = engine.steps - launched_before
    run.sessions = {name: engine.session_tokens(s) for name, s in sid.items()}
    # One more turn on every open session: it continues exactly where the last one ended.
    for s in sid.values():
        engine.append(s, token_ids=prompt(engine, 8))
    follow = engine.generate_many([(s, {"max_tokens": 4, "ignore_eos": True}) for s in sid.values()])
    for name, g in zip(sid, follow, strict=True):
        run.outputs[f"{name}+"] = (g.token_ids, g.text, g.finish_reason)
    for s in sid.values():
        engine.close(s)
    return run


def test_running_ahead_changes_nothing_but_the_timing(tiny: Engine) -> None:
    # The scenario's stop id (E) and stop string (D): from plain runs, so that both fire mid-way.
    def probe(i: int) -> list[int]:
        s = tiny.create_session()
        tiny.append(s, token_ids=prompt(tiny, i))
        ids = tiny.generate(s, max_tokens=20, ignore_eos=True).token_ids
        tiny.close(s)
        return ids

    ids = probe(3)
    stop_id = next(t for k, t in enumerate(ids) if k >= 4 and t not in ids[:k])
    ids = probe(5)
    texts = [tiny.tokenizer.decode(ids[:k]) for k in range(len(ids) + 1)]
    stop_text = next(texts[k][len(texts[k - 1]):] for k in range(4, len(ids))
                     if texts[k][len(texts[k - 1]):].strip() and texts[k][len(texts[k - 1]):] not in texts[k - 1])

    plain = drive(tiny, False, stop_id, stop_text)
    ahead = drive(tiny, True, stop_id, stop_text)
    assert ahead.outputs == plain.outputs
    assert ahead.sessions == plain.sessions
    assert plain.ahead == 0 and ahead.ahead > 10  # it did run ahead, most of the time
    reasons = {name: out[2] for name, out in plain.outputs.items()}
    assert reasons["A"] == "length" and reasons["B"] == "cancelled" and reasons["C"] == "cancelled"
    assert reasons["E"] == "stop" and 4 <= len(plain.outputs["E"][0]) < 20 and reasons["F"] == "length"
    assert reasons["D"] == "stop" and stop_text not in plain.outputs["D"][1] and 3 <= len(plain.outputs["D"][0]) < 12
    assert reasons["G"] == "length" and reasons["A2"] == "length"
    assert len(plain.outputs["B"][0]) == 3 and len(plain.outputs["C"][0]) == 4
    assert ahead.steps >= plain.steps  # a step run for requests that had all stopped is the only extra work


def test_a_step_that_fails_while_another_runs_ahead_is_run_again(tiny: Engine, monkeypatch: pytest.MonkeyPatch) -> None:
    """A failure while the next step is in flight drops both: no tokens lost, none doubled."""
    import worker.engine.core

    sids = [tiny.create_session() for _ in range(2)]
    for i, s in enumerate(sids):
        tiny.append(s, token_ids=prompt(tiny, i))
    expected = [g.token_ids for g in tiny.generate_many([(s, {"max_tokens": 8, "ignore_eos": True}) for s in sids])]
    for s in sids:
        tiny.close(s)

    tiny.overlap = True
    sids = [tiny.create_session() for _ in range(2)]
    for i, s in enumerate(sids):
        tiny.append(s, token_ids=prompt(tiny, i))
    rids = [tiny.start_generate(s, SamplingParams(max_tokens=8, ignore_eos=True)) for s in sids]
    out: dict[str, list[int]] = {r: [] for r in rids}
    for _ in range(3):
        for chunk in tiny.step():
            out[chunk.request_id] += chunk.token_ids
    assert tiny._unread is not None
    fail_once(monkeypatch, worker.engine.core, "sample_ids")
    with pytest.raises(RuntimeError, match="injected"):
        tiny.step()
    assert tiny._unread is None
    while tiny.has_work():
        for chunk in tiny.step():
            out[chunk.request_id] += chunk.token_ids
    assert [out[r] for r in rids] == expected
    for s in sids:
        tiny.close(s)
    tiny.overlap = False


def test_a_new_prompt_rides_in_the_step_launched_ahead(tiny: Engine) -> None:
    """A generation that arrives while a step runs is launched with the next one, beside the decode rows that
    read the running step's ids on the device: the engine does not stop to read first, and the tokens are
    those of one step at a time."""
    def open_two() -> list[str]:
        sids = [tiny.create_session() for _ in range(3)]
        for i, s in enumerate(sids):
            tiny.append(s, token_ids=prompt(tiny, i))
        return sids

    sids = open_two()
    first = tiny.generate_many([(s, {"max_tokens": 10, "ignore_eos": True}) for s in sids[:2]])
    late = tiny.generate(sids[2], max_tokens=6, ignore_eos=True)
    for s in sids:
        tiny.close(s)

    tiny.overlap = True
    sids = open_two()
    rids = [tiny.start_generate(s, SamplingParams(max_tokens=10, ignore_eos=True)) for s in sids[:2]]
    out: dict[str, list[int]] = {r: [] for r in rids}
    while tiny._unread is None or not out[rids[0]]:
        for chunk in tiny.step():
            out[chunk.request_id] += chunk.token_ids
    pending = tiny.session_length(sids[2])
    rids.append(tiny.start_generate(sids[2], SamplingParams(max_tokens=6, ignore_eos=True)))
    out[rids[2]] = []
    for chunk in tiny.step():
        out[chunk.request_id] += chunk.token_ids
    assert tiny._unread is not None  # launched ahead, with the new prompt in it
    assert (tiny.last_rows, tiny.last_prefill_tokens) == (3, pending)
    while tiny.has_work():
        for chunk in tiny.step():
            out[chunk.request_id] += chunk.token_ids
    assert [out[r] for r in rids] == [first[0].token_ids, first[1].token_ids, late.token_ids]
    for s in sids:
        tiny.close(s)


def test_a_step_with_prompt_tokens_is_read_only_once_the_device_is_done_when_the_caller_does_not_wait(
    tiny: Engine, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """step(wait=False) returns without reading a step that computes prompt tokens while the device has not made its
    ids (the worker takes requests then, between calls), and reads it once it has; step() waits for it."""
    from worker.engine.core import Launched

    pending = {"polls": 0}

    def done(self: Launched) -> bool:
        pending["polls"] -= 1
        return pending["polls"] < 0

    monkeypatch.setattr(Launched, "done", done)
    sid = tiny.create_session()
    tiny.append(sid, token_ids=prompt(tiny, 0))
    expected = tiny.generate(sid, max_tokens=3, ignore_eos=True).token_ids
    tiny.close(sid)

    tiny.overlap = True
    sid = tiny.create_session()
    tiny.append(sid, token_ids=prompt(tiny, 0))
    rid = tiny.start_generate(sid, SamplingParams(max_tokens=3, ignore_eos=True))
    assert tiny.step(wait=False) == [] and tiny.last_rows == 1 and not tiny.last_read  # launched, read next call
    pending["polls"] = 3
    assert tiny.prefill_running
    for _ in range(2):  # the device is still on it: nothing is read, the step after it is launched once
        assert tiny.step(wait=False) == [] and not tiny.last_read
    assert not tiny.prefill_running  # done now
    out = tiny.step(wait=False)
    assert tiny.last_read and [c.request_id for c in out] == [rid]
    tokens = list(out[0].token_ids)
    while tiny.has_work():
        for chunk in tiny.step():
            tokens += chunk.token_ids
    assert tokens == expected
    tiny.close(sid)
    tiny.overlap = False


def test_a_step_plan_puts_the_rows_read_on_the_device_first() -> None:
    """Whatever the order requests are planned in (arrival order), the rows whose token the last step samples on
    the device come first, then the decode rows whose token the host knows, then prompt chunks; the logits
    follow the batch's rows, and so do the sampled requests."""
    from types import SimpleNamespace

    import torch

    from worker.engine.scheduler import StepPlan

    def request(slot: int, tokens: list[int]) -> SimpleNamespace:
        return SimpleNamespace(session=SimpleNamespace(slot=slot, tokens=tokens), generated=0)

    host_decode = request(3, [5, 6, 7])  # its last prompt token is pending: position 2
    ahead = request(1, [8, 9])  # the last step samples its next token (position 2 once read)
    chunk_end = request(4, [1, 2, 3, 4, 5])  # positions 1..4: the whole rest of its prompt
    chunk_part = request(2, list(range(10)))  # positions 0..3 of 10: samples nothing
    samples = torch.tensor([40, 41, 42])
    plan = StepPlan(samples)
    plan.add(host_decode, 2, 1)  # type: ignore[arg-type]
    plan.add(chunk_end, 1, 4)  # type: ignore[arg-type]
    plan.decode_ahead(ahead, 2, 2)  # type: ignore[arg-type]
    plan.add(chunk_part, 0, 4)  # type: ignore[arg-type]
    tokens, positions, slots, logits_at, source = plan.rows()  # a StepRows
    assert tokens == [0, 7, 2, 3, 4, 5, 0, 1, 2, 3]
    assert positions == [2, 2, 1, 2, 3, 4, 0, 1, 2, 3]
    assert slots == [1, 3, 4, 4, 4, 4, 2, 2, 2, 2]
    assert logits_at == [0, 1, 5]
    assert source is not None and source[0] is samples and source[1] == [2]
    assert plan.sampled() == ([ahead, host_decode, chunk_end], [2, 2, 4])
    assert (plan.prefill_tokens, plan.decode_prompt_tokens) == (8, 1)  # host_decode's pending prompt token
    assert plan.partial == [(chunk_part, 0, 4)]
    assert (len(plan), plan.decode_rows, plan.prefill_tokens) == (4, 2, 8)
