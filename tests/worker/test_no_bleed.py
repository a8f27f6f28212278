"""Sessions are isolated: nothing one session does changes another's tokens."""

from __future__ import annotations

import pytest

from worker.engine import Engine

PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "List three colors.",
    "Explain gravity in one sentence.",
]


def _solo(engine: Engine, prompt: str, max_tokens: int) -> list[int]:
    sid = engine.create_session()
    engine.chat(sid, prompt)
    ids = engine.generate(sid, max_tokens=max_tokens, ignore_eos=True).token_ids
    engine.close(sid)
    return ids


def test_solo_equals_interleaved_and_batched(engine: Engine) -> None:
    lengths = [24, 16, 20, 12]
    solo = [_solo(engine, p, n) for p, n in zip(PROMPTS, lengths, strict=True)]

    # Batched: all four decode in the same steps, at different context lengths.
    sids = [engine.create_session() for _ in PROMPTS]
    for sid, p in zip(sids, PROMPTS, strict=True):
        engine.chat(sid, p)
    batched = engine.generate_many([(sid, {"max_tokens": n, "ignore_eos": True}) for sid, n in zip(sids, lengths, strict=True)])
    assert [g.token_ids for g in batched] == solo
    for sid in sids:
        engine.close(sid)

    # Interleaved: streams advanced in a scattered order, one joining while others are mid-way.
    sids = [engine.create_session() for _ in PROMPTS]
    for sid, p in zip(sids, PROMPTS, strict=True):
        engine.chat(sid, p)
    streams = {i: engine.stream(sids[i], max_tokens=lengths[i], ignore_eos=True) for i in (0, 2)}
    got: dict[int, list[int]] = {i: [] for i in range(4)}
    for _ in range(5):
        for i in (0, 2):
            got[i] += next(streams[i]).token_ids
    streams[1] = engine.stream(sids[1], max_tokens=lengths[1], ignore_eos=True)
    streams[3] = engine.stream(sids[3], max_tokens=lengths[3], ignore_eos=True)
    while streams:
        for i in list(streams):
            try:
                got[i] += next(streams[i]).token_ids
            except StopIteration:
                del streams[i]
    assert [got[i] for i in range(4)] == solo
    assert engine.steps > 0


def test_fork_continues_exactly_as_the_parent(engine: Engine) -> None:
    reference = _solo(engine, PROMPTS[0], 24)

    parent = engine.create_session()
    engine.chat(parent, PROMPTS[0])
    head = engine.generate(parent, max_tokens=8, ignore_eos=True).token_ids
    assert head == reference[:8]
    child = engine.fork(parent)
    assert engine.session_tokens(child) == engine.session_tokens(parent)
    # Child and parent continue together (batched) and separately: all equal the unforked run.
    both = engine.generate_many([(parent, {"max_tokens": 16, "ignore_eos": True}), (child, {"max_tokens": 16, "ignore_eos": True})])
    assert both[0].token_ids == reference[8:] == both[1].token_ids


def test_fork_of_a_session_with_pending_prompt(engine: Engine) -> None:
    reference = _solo(engine, PROMPTS[1], 10)
    parent = engine.create_session()
    engine.chat(parent, PROMPTS[1])  # nothing computed yet: the fork copies tokens, not state
    child = engine.fork(parent)
    assert engine.generate(child, max_tokens=10, ignore_eos=True).token_ids == reference
    assert engine.generate(parent, max_tokens=10, ignore_eos=True).token_ids == reference


def test_closing_one_session_never_changes_another(engine: Engine) -> None:
    reference = _solo(engine, PROMPTS[2], 20)
    keep = engine.create_session()
    engine.chat(keep, PROMPTS[2])
    other = engine.create_session()
    engine.chat(other, PROMPTS[3])
    first = engine.generate_many([(keep, {"max_tokens": 10, "ignore_eos": True}), (other, {"max_tokens": 10, "ignore_eos": True})])
    engine.close(other)
    # A new session takes the freed slot and writes all over it.
    reuse = engine.create_session()
    engine.chat(reuse, PROMPTS[0] * 5)
    engine.generate(reuse, max_tokens=4)
    rest = engine.generate(keep, max_tokens=10, ignore_eos=True)
    assert first[0].token_ids + rest.token_ids == reference


def test_close_during_generation_cancels_only_that_session(engine: Engine) -> None:
    reference = _solo(engine, PROMPTS[0], 12)
    a, b = engine.create_session(), engine.create_session()
    engine.chat(a, PROMPTS[0])
    engine.chat(b, PROMPTS[1])
    stream_a = engine.stream(a, max_tokens=12, ignore_eos=True)
    rid_b = engine.start_generate(b, __import__("worker.engine.sampling", fromlist=["SamplingParams"]).SamplingParams(max_tokens=50))
    got = next(stream_a).token_ids
    engine.close(b)
    for chunk in stream_a:
        got += chunk.token_ids
    assert got == reference
    assert rid_b not in engine._active


def test_prefill_chunks_do_not_depend_on_the_batch(engine: Engine) -> None:
    """A long prompt is cut at the same places alone and next to other prompts."""
    from worker.engine.sampling import SamplingParams

    long_prompt = list(range(100, 700))  # 600 tokens: chunks of 256, 256, 88
    seen: list[list[int]] = []
    for others in (0, 2):
        sids = [engine.create_session() for _ in range(1 + others)]
        engine.append(sids[0], token_ids=long_prompt)
        for s in sids[1:]:
            engine.append(s, token_ids=list(range(300, 500)))
        rids = [engine.start_generate(s, SamplingParams(max_tokens=1)) for s in sids]
        chunks = []
        while engine.has_work():
            before = engine._sessions[sids[0]].computed
            engine.step()
            chunks.append(engine._sessions[sids[0]].computed - before)
        seen.append([c for c in chunks if c])
        assert rids
        for s in sids:
            engine.close(s)
    assert seen[0] == seen[1] == [256, 256, 88]


@pytest.mark.parametrize("step_tokens", [1, 2, 3])
def test_a_prompt_cut_into_one_token_chunks_samples_only_at_its_end(step_tokens: int) -> None:
    """A step budget of 1 cuts a prompt into 1-token chunks: each used to be taken for a decode row, sampled and
    appended as a generated token (the prompt came back as the answer)."""
    prompt = [5, 6, 7, 8, 9]
    plain = Engine.load("random:tiny", device="cpu", max_sessions=1, max_context=64)
    small = Engine.load("random:tiny", device="cpu", max_sessions=1, max_context=64, step_tokens=step_tokens)
    results = []
    for eng in (plain, small):
        sid = eng.create_session()
        eng.append(sid, token_ids=prompt)
        results.append(eng.generate(sid, max_tokens=3, ignore_eos=True).token_ids)
        assert eng.session_tokens(sid) == prompt + results[-1]
    assert results[1] == results[0]


@pytest.mark.parametrize("step_tokens", [0, -5])
def test_a_step_budget_below_one_token_is_refused(step_tokens: int) -> None:
    """(-5 made every generation wait forever: no prompt token ever fit a step.)"""
    with pytest.raises(ValueError, match="step_tokens must be >= 1"):
        Engine.load("random:tiny", device="cpu", max_sessions=1, max_context=64, step_tokens=step_tokens)


def test_generate_many_runs_every_request_from_the_first_step(engine: Engine) -> None:
    """All three start before the first step, so 6 tokens each take 6 steps (the prompts' step, then 5 decode
    steps), not the 8 of requests started one after the other as each earlier one yields."""
    sids = [engine.create_session() for _ in range(3)]
    try:
        for i, sid in enumerate(sids):
            engine.append(sid, token_ids=[100 + i, 200, 300])
        before = engine.steps
        results = engine.generate_many([(sid, {"max_tokens": 6, "ignore_eos": True}) for sid in sids])
        assert [len(r.token_ids) for r in results] == [6, 6, 6]
        assert [r.finish_reason for r in results] == ["length"] * 3
        assert engine.steps - before == 6
    finally:
        for sid in sids:
            engine.close(sid)
