"""Log-probabilities, prefill-only generations and multi-turn chat rendering, on the real SmolLM2 (CPU); and a turn after
an answer Qwen3's template rewrites, with its template on the engine."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from worker.engine import Engine
from worker.engine.sampling import MAX_LOGPROBS, SamplingParams, step_logprobs
from worker.errors import BadRequest, PromptBoundary
from worker.model.tokenizer import Tokenizer

QUESTION = "What is the capital of France?"
TEMPLATES = Path(__file__).parent / "templates"


def test_step_logprobs_are_the_rows_log_softmax_with_the_top_k_in_order() -> None:
    logits = torch.tensor([[1.0, 3.0, 3.0, -2.0], [0.5, 0.0, 0.0, 0.0], [9.0, 1.0, 2.0, 3.0]])
    ids = torch.tensor([2, 0, 3])
    params = [SamplingParams(logprobs=2), SamplingParams(), SamplingParams(logprobs=0)]
    lp = step_logprobs(logits, ids, params)
    assert lp is not None and lp.rows == [0, 2]
    ref = torch.log_softmax(logits.double(), dim=-1)
    rows = lp.by_row()
    assert rows[0][0] == pytest.approx(float(ref[0, 2]), rel=1e-6)
    assert rows[0][1] == [1, 2]  # a tie: the lower id first, whatever the batch
    assert rows[0][2] == pytest.approx([float(ref[0, 1]), float(ref[0, 2])], rel=1e-6)
    assert rows[2][0] == pytest.approx(float(ref[2, 3]), rel=1e-6)
    assert rows[2][1] == [0, 3]  # the widest request sets k for every row (the engine keeps each row's own)
    assert step_logprobs(logits, ids, [SamplingParams()] * 3) is None


def test_logprobs_parameter_is_checked() -> None:
    for bad in (-1, MAX_LOGPROBS + 1, True, 1.5):
        with pytest.raises(BadRequest, match="logprobs"):
            SamplingParams(logprobs=bad).validate(100)  # type: ignore[arg-type]
    SamplingParams(logprobs=MAX_LOGPROBS, max_tokens=0).validate(100)


def test_greedy_tokens_come_with_their_logprobs_alone_and_batched(engine: Engine) -> None:
    def run(noise: int) -> tuple[list[int], list[tuple[float, bytes, tuple[tuple[int, float, bytes], ...]]]]:
        sid = engine.create_session()
        engine.chat(sid, QUESTION)
        others = [engine.create_session() for _ in range(noise)]
        for i, o in enumerate(others):
            engine.append(o, text=f"Some other prompt {i}. " * (i + 2))
        requests: list[tuple[str, dict[str, object]]] = [(sid, {"max_tokens": 6, "logprobs": 3})]
        requests += [(o, {"max_tokens": 6, "temperature": 1.0, "seed": i}) for i, o in enumerate(others)]
        results = engine.generate_many(requests)
        for s in [sid, *others]:
            engine.close(s)
        return results[0].token_ids, results[0].logprobs or []

    ids, logprobs = run(0)
    assert len(logprobs) == len(ids) > 0
    for token, (value, token_bytes, top) in zip(ids, logprobs, strict=True):
        assert len(top) == 3 and top[0][0] == token and top[0][1] == value  # greedy: the token is the most likely
        assert top[0][1] >= top[1][1] >= top[2][1] and value <= 0
        assert token_bytes == engine.tokenizer.token_bytes[token]  # type: ignore[index]
        assert sum(math.exp(v) for _, v, _ in top) <= 1.0 + 1e-6
    assert b"".join(b for _, b, _ in logprobs).decode() == engine.tokenizer.decode(ids)
    # Beside other rows: the same tokens; the CPU's products are not bitwise batch-invariant (the GPU's are, and
    # there the values are equal too: tests/worker/gpu/test_engine.py), so the values agree to float precision.
    batched_ids, batched = run(2)
    assert batched_ids == ids and [(b, [i for i, _, _ in t]) for _, b, t in batched] == [(b, [i for i, _, _ in t]) for _, b, t in logprobs]
    assert [v for v, _, _ in batched] == pytest.approx([v for v, _, _ in logprobs], rel=1e-3, abs=1e-5)


def test_a_rows_logprobs_do_not_depend_on_the_other_rows() -> None:
    torch.manual_seed(0)
    logits = torch.randn(7, 5000) * 4
    ids = logits.argmax(dim=-1)
    params = [SamplingParams(logprobs=5)] * 7
    batch = step_logprobs(logits, ids, params)
    alone = step_logprobs(logits[3:4], ids[3:4], params[:1])
    assert batch is not None and alone is not None
    assert batch.by_row()[3] == alone.by_row()[0]  # bitwise


def test_sampled_tokens_logprob_is_under_the_models_distribution(engine: Engine) -> None:
    sid = engine.create_session()
    engine.chat(sid, QUESTION)
    g = engine.generate(sid, max_tokens=6, temperature=1.0, seed=11, logprobs=MAX_LOGPROBS, ignore_eos=True)
    assert g.logprobs is not None and len(g.logprobs) == 6
    for token, (value, _, top) in zip(g.token_ids, g.logprobs, strict=True):
        assert len(top) == MAX_LOGPROBS
        in_top = [v for i, v, _ in top if i == token]
        assert in_top == [value] or (not in_top and value <= top[-1][1])
    engine.close(sid)


def test_prefill_only_computes_all_but_the_last_token_and_forks_continue_like_a_plain_turn(engine: Engine) -> None:
    plain = engine.create_session()
    engine.chat(plain, "Name a color.")
    expected = engine.generate(plain, max_tokens=6).token_ids
    parent = engine.create_session()
    length = engine.chat(parent, "Name a color.")
    done = engine.generate(parent, max_tokens=0)
    assert (done.token_ids, done.text, done.finish_reason) == ([], "", "length")
    assert engine._sessions[parent].computed == length - 1 and engine.session_length(parent) == length
    assert engine.generate(parent, max_tokens=0).finish_reason == "length"  # nothing left to prefill: ends at once
    children = [engine.fork(parent) for _ in range(2)]
    assert all(engine._sessions[c].computed == length - 1 for c in children)
    assert [engine.generate(c, max_tokens=6).token_ids for c in children] == [expected, expected]
    for s in [plain, parent, *children]:
        engine.close(s)


def test_a_long_prefill_only_prompt_is_cut_into_chunks(engine: Engine) -> None:
    sid = engine.create_session()
    engine.append(sid, token_ids=list(range(10, 10 + 300)))  # more than one 256-token CPU chunk
    assert engine.generate(sid, max_tokens=0).finish_reason == "length"
    assert engine._sessions[sid].computed == 299
    engine.close(sid)


def test_chat_ids_render_one_turn_as_chat_and_several_as_the_template(engine: Engine) -> None:
    turns = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": QUESTION}]
    a, b = engine.create_session(), engine.create_session()
    assert engine.chat_ids(a, turns) == engine.tokenizer.apply_chat_template(turns, True, tokenize=True)
    engine.append(a, token_ids=engine.chat_ids(a, turns))
    engine.chat(b, QUESTION)
    answer = engine.generate(a, max_tokens=4)  # cut short: the next turn closes it with the EOS first
    engine.generate(b, max_tokens=4)
    follow = [{"role": "user", "content": "And Spain?"}]
    before = engine.session_length(b)
    engine.chat(b, "And Spain?")
    ids = engine.chat_ids(a, follow)
    assert ids == engine.session_tokens(b)[before:] and ids[0] == engine.tokenizer.eos_id
    assert answer.finish_reason == "length"
    assert engine.tokenizer.decode(engine.chat_ids(a, [])) == "<|im_end|>\n<|im_start|>assistant\n"
    with pytest.raises(BadRequest, match="first chat turn"):
        engine.chat_ids(engine.create_session(), [])
    with pytest.raises(BadRequest, match="role and content"):
        engine.chat_ids(a, [{"role": "user"}])


def test_a_turn_after_an_answer_the_template_rewrites_follows_it_or_with_the_check_is_refused(
        engine: Engine, monkeypatch: pytest.MonkeyPatch) -> None:
    """Qwen3's template (tests/worker/templates/qwen3.jinja) drops the reasoning of answers before the last user turn.
    After a plain answer the next turn is appended as the template continues it. After one with reasoning the
    session's tokens cannot be the whole conversation's: the turn follows the answer as the session holds it, or, with
    boundary_check (the gateway's), PromptBoundary, nothing appended (the gateway starts the turn over in a new session
    given the whole conversation). Before, every resumed turn on Qwen3 was a BadRequest."""
    raw = Tokenizer.bytes_only()._tok
    qwen3 = Tokenizer(raw, bos_id=None, eos_id=258, chat_template=(TEMPLATES / "qwen3.jinja").read_text(encoding="utf-8"))
    monkeypatch.setattr(engine, "tokenizer", qwen3)  # ids under 259: within SmolLM2's vocabulary; nothing is generated
    follow = [{"role": "user", "content": "And Spain?"}]
    turn = "\n<|im_start|>user\nAnd Spain?<|im_end|>\n<|im_start|>assistant\n"  # after the answer's <|im_end|>
    for answer, resumes in (("Paris.", True), ("<think>\nThe capital.\n</think>\n\nParis.", False)):
        sid = engine.create_session()
        engine.append(sid, token_ids=engine.chat_ids(sid, [{"role": "user", "content": QUESTION}]))
        engine.append(sid, token_ids=[*qwen3.encode(answer, add_bos=False), qwen3.eos_id])  # as if generated
        whole = qwen3.apply_chat_template([{"role": "user", "content": QUESTION},
                                           {"role": "assistant", "content": answer}, *follow], tokenize=True)
        held = engine.session_tokens(sid)
        if resumes:
            assert [*held, *engine.chat_ids(sid, follow, boundary_check=True)] == whole
        else:
            with pytest.raises(PromptBoundary, match="renders the session's last answer otherwise"):
                engine.chat_ids(sid, follow, boundary_check=True)
            assert engine.session_tokens(sid) == held and held != whole[:len(held)]
        engine.chat(sid, "And Spain?")
        assert engine.session_tokens(sid) == held + qwen3.encode(turn, add_bos=False)
        engine.close(sid)
