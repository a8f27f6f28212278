from __future__ import annotations

import pytest
import torch

from worker.engine import Engine
from worker.engine.sampling import RowRandom, SamplingParams, _sample_rows, sample

PROMPT = "Tell me a story about a dragon."


def _run(engine: Engine, seed: int, others: int = 0) -> list[int]:
    sid = engine.create_session()
    engine.chat(sid, PROMPT)
    noise = [engine.create_session() for _ in range(others)]
    for i, n in enumerate(noise):
        engine.append(n, text=f"Unrelated prompt number {i} " * (i + 1))
    requests: list[tuple[str, dict[str, object]]] = [
        (sid, {"max_tokens": 16, "temperature": 0.9, "top_p": 0.95, "top_k": 50, "seed": seed, "ignore_eos": True})
    ]
    requests += [(n, {"max_tokens": 16, "temperature": 1.0, "seed": 100 + i}) for i, n in enumerate(noise)]
    results = engine.generate_many(requests)
    for s in [sid, *noise]:
        engine.close(s)
    return results[0].token_ids


def test_seed_is_reproducible_and_independent_of_the_batch(engine: Engine) -> None:
    alone = _run(engine, seed=1234)
    assert len(alone) == 16
    assert _run(engine, seed=1234) == alone
    assert _run(engine, seed=1234, others=3) == alone
    assert _run(engine, seed=4321) != alone


def test_top_k_one_is_greedy(engine: Engine) -> None:
    sid = engine.create_session()
    engine.chat(sid, PROMPT)
    child = engine.fork(sid)
    greedy = engine.generate(sid, max_tokens=10, ignore_eos=True).token_ids
    assert engine.generate(child, max_tokens=10, temperature=1.5, top_k=1, seed=7, ignore_eos=True).token_ids == greedy


def test_inverse_cdf_picks_exact_tokens() -> None:
    # probs after softmax of log([0.5, 0.3, 0.15, 0.05]) are exactly those values.
    logits = torch.tensor([[0.5, 0.3, 0.15, 0.05]]).log()
    pick = lambda u, k=0, p=1.0: int(_sample_rows(logits, torch.tensor([u]), torch.tensor([k]), torch.tensor([p]))[0])  # noqa: E731
    assert [pick(u) for u in (0.0, 0.49, 0.51, 0.79, 0.81, 0.94, 0.96)] == [0, 0, 1, 1, 2, 2, 3]
    # top_k=2 renormalises over {0: 0.625, 1: 0.375}
    assert [pick(u, k=2) for u in (0.6, 0.63, 0.99)] == [0, 1, 1]
    # top_p=0.7 keeps tokens whose preceding mass is < 0.7: {0, 1} -> same as top_k=2
    assert [pick(u, p=0.7) for u in (0.6, 0.63, 0.999)] == [0, 1, 1]
    # top_p tiny keeps only the top token
    assert pick(0.999, p=0.01) == 0


def test_sample_mixes_greedy_and_random_rows() -> None:
    logits = torch.tensor([[0.0, 5.0, 1.0], [3.0, 0.0, 0.0], [0.0, 0.0, 9.0]])
    params = [SamplingParams(), SamplingParams(temperature=1.0, seed=3), SamplingParams()]
    randoms = [RowRandom.for_params(p) for p in params]
    out = sample(logits, params, randoms)
    assert out[0] == 1 and out[2] == 2
    again = sample(logits, params, [RowRandom.for_params(p) for p in params])
    assert again == out


@pytest.mark.parametrize(
    ("params", "message"),
    [
        (SamplingParams(max_tokens=True), "max_tokens"),
        (SamplingParams(seed=-1), "seed"),
        (SamplingParams(stop=("",)), "stop strings"),
        (SamplingParams(stop=tuple("abcdefghijklmnopq")), "at most 16"),
        (SamplingParams(stop_token_ids=(10**9,)), "stop_token_ids"),
        (SamplingParams(temperature=float("nan")), "temperature"),
        (SamplingParams(top_k=2**31), r"top_k must be an integer in \[0, 2147483647\]"),  # (overflowed every step)
    ],
)
def test_params_validation(params: SamplingParams, message: str) -> None:
    from worker.errors import BadRequest

    with pytest.raises(BadRequest, match=message):
        params.validate(49152)


def test_ties_sample_the_same_token_alone_and_batched() -> None:
    """Many equal logits (as bf16 gives): a row's token must not depend on the other rows."""
    torch.manual_seed(0)
    row = torch.randint(0, 4, (1, 4096)).float()  # only 4 distinct values: ties everywhere
    others = torch.randn(7, 4096)
    params = [SamplingParams(temperature=1.0, seed=s) for s in range(8)]
    for u_seed in range(20):
        alone = sample(row, params[:1], [RowRandom(u_seed)])
        randoms = [RowRandom(100 + i) for i in range(3)] + [RowRandom(u_seed)] + [RowRandom(200 + i) for i in range(4)]
        batched = sample(torch.cat([others[:3], row, others[3:]]), params, randoms)
        assert batched[3] == alone[0]


@pytest.mark.parametrize(("temperature", "top_p"), [(1e-300, 1.0), (5e-324, 1.0), (1.0, 5e-324), (60.0, 1e-45)])
def test_extreme_but_valid_parameters_pick_the_top_token(temperature: float, top_p: float) -> None:
    """Temperatures that vanish in float32 are greedy; a top_p below any token's mass keeps the top token."""
    logits = torch.tensor([[0.0, 5.0, 1.0, 4.0]])
    params = [SamplingParams(temperature=temperature, top_p=top_p, seed=1)]
    assert sample(logits, params, [RowRandom.for_params(p) for p in params]) == [1]


def test_a_failed_step_leaves_the_session_able_to_generate(engine: Engine, monkeypatch: pytest.MonkeyPatch) -> None:
    """A step that fails (here: in sampling, after the forward) is run again, not skipped: the session neither
    loses tokens nor is left with nothing to compute and a generation that never ends."""
    import worker.engine.core

    sid = engine.create_session()
    engine.append(sid, text=PROMPT)
    expected = engine.generate(sid, max_tokens=4, ignore_eos=True).token_ids
    engine.close(sid)
    sid = engine.create_session()
    engine.append(sid, text=PROMPT)

    def failing(*args: object) -> torch.Tensor:
        raise RuntimeError("injected")

    monkeypatch.setattr(worker.engine.core, "sample_ids", failing)
    engine.start_generate(sid, SamplingParams(max_tokens=4, ignore_eos=True), request_id="r1")
    with pytest.raises(RuntimeError, match="injected"):
        engine.step()
    monkeypatch.undo()
    engine.cancel("r1")
    engine.step()  # the cancelled request's final chunk
    assert not engine.has_work()
    engine.start_generate(sid, SamplingParams(max_tokens=4, ignore_eos=True), request_id="r2")
    tokens: list[int] = []
    for _ in range(20):  # bounded: before the fix this generation never produced a token
        tokens += [t for chunk in engine.step() for t in chunk.token_ids]
        if not engine.has_work():
            break
    assert tokens == expected
    engine.close(sid)


def test_a_failed_step_keeps_the_ends_made_between_steps(engine: Engine, monkeypatch: pytest.MonkeyPatch) -> None:
    """A cancel's final chunk (made between steps) was taken by the next step and lost when that step failed: the
    caller never heard that generation end."""
    import worker.engine.core

    a, b = engine.create_session(), engine.create_session()
    engine.append(a, text=PROMPT)
    engine.append(b, text=PROMPT)
    engine.start_generate(a, SamplingParams(max_tokens=4, ignore_eos=True), request_id="cancelled")
    engine.cancel("cancelled")
    engine.start_generate(b, SamplingParams(max_tokens=1, ignore_eos=True), request_id="runs")

    def failing(*args: object) -> torch.Tensor:
        raise RuntimeError("injected")

    monkeypatch.setattr(worker.engine.core, "sample_ids", failing)
    with pytest.raises(RuntimeError, match="injected"):
        engine.step()
    monkeypatch.undo()
    ends: dict[str, str | None] = {}
    while engine.has_work():
        ends.update((c.request_id, c.finish_reason) for c in engine.step() if c.finish_reason is not None)
    assert ends == {"cancelled": "cancelled", "runs": "length"}
    engine.close(a)
    engine.close(b)


def test_every_bit_of_a_seed_counts() -> None:
    """torch's CPU generator kept 32 bits of a seed: 1, 1 + 2**32 and 2**62 + 1 drew the same numbers."""
    draws = {seed: RowRandom(seed).uniform() for seed in (1, 1 + 2**32, 2**62 + 1, 2**63 - 1)}
    assert len(set(draws.values())) == 4
    first, again = RowRandom(2**62 + 1), RowRandom(2**62 + 1)
    assert [first.uniform() for _ in range(5)] == [again.uniform() for _ in range(5)]
