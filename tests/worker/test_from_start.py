"""A GENERATE whose prompt is the session's whole context (from_start): the session keeps what it holds that the
prompt starts with and drops the rest, and then generates exactly what transformers generates from that context.

On folders transformers wrote (a dense Qwen3, whose K/V can be cut at any position, and the hybrid Qwen3.5, whose
recurrent state cannot take tokens back, so that a cut session is computed again from its start): an edited
conversation, an answer generated again, a context that only extends the session's, each beside another session
generating in the same steps, and a fork after it; the refusals; and on the worker's request handling, the prompt as
ids, as text (tokenized as a first text, off the loop too) and as chat messages (rendered as on a new session), with
the reply's counts of what was dropped and appended."""

from __future__ import annotations

import random
import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import worker.serve.dispatch as dispatch_module
from broker.common import protocol as p
from tests.worker import test_families, test_qwen3_5
from worker.engine import Engine, SamplingParams
from worker.engine.session import common_prefix
from worker.errors import BadRequest, ContextOverflow, SessionBusy
from worker.serve.config import WorkerConfig
from worker.serve.dispatch import Dispatch
from worker.serve.metrics import NoMetrics

transformers = pytest.importorskip("transformers")

VOCAB = test_families.VOCAB
TEMPLATES = Path(__file__).parent / "templates"


class Model:
    def __init__(self, path: Path, prompts: list[list[int]], recurrent: bool) -> None:
        self.path, self.prompts, self.recurrent = path, prompts, recurrent
        self.hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        self.hf.generation_config.eos_token_id = None
        self.hf.generation_config.pad_token_id = 0

    def greedy(self, context: list[int], n: int) -> list[int]:
        """transformers' greedy continuation of `context`, from nothing cached."""
        with torch.no_grad():
            out = self.hf.generate(torch.tensor([context]), max_new_tokens=n, do_sample=False,
                                   attention_mask=torch.ones(1, len(context), dtype=torch.long))
        tokens: list[int] = out[0, len(context):].tolist()
        return tokens


@pytest.fixture(scope="module", params=["qwen3", "qwen3_5"])
def model(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Model:
    tmp = tmp_path_factory.mktemp("from_start")
    if request.param == "qwen3":
        dense = test_families.write_folder(tmp, "qwen3")
        return Model(dense.path, dense.prompts, recurrent=False)
    hybrid = test_qwen3_5.write_folder(tmp)
    return Model(hybrid.path, hybrid.prompts, recurrent=True)


@pytest.fixture(scope="module")
def engine(model: Model) -> Iterator[Engine]:
    torch.set_num_threads(1)  # (see tests/worker/test_qwen3_5.py's one_thread)
    eng = Engine.load(str(model.path), device="cpu", max_sessions=4, max_context=512, step_tokens=64)
    yield eng
    eng.unload()


def run(engine: Engine, starts: list[tuple[str, int, dict[str, Any]]]) -> list[list[int]]:
    """Start every (session, max_tokens, prompt arguments) generation, then step until all end: their tokens."""
    rids = [engine.start_generate(sid, SamplingParams(max_tokens=n, ignore_eos=True), **kw) for sid, n, kw in starts]
    out: dict[str, list[int]] = {rid: [] for rid in rids}
    open_ = set(rids)
    for chunk in engine._finished:  # (a prefill-only request with nothing to compute ends at once)
        open_.discard(chunk.request_id)
    while open_:
        for chunk in engine.step():
            if chunk.request_id in out:
                out[chunk.request_id] += chunk.token_ids
                if chunk.finish_reason is not None:
                    open_.discard(chunk.request_id)
    while engine.has_work():
        engine.step()
    return [out[rid] for rid in rids]


def finish(engine: Engine, rid: str) -> list[int]:
    """Step until no work is left: the tokens generation `rid` gave."""
    got: list[int] = []
    while engine.has_work():
        got += [t for c in engine.step() if c.request_id == rid for t in c.token_ids]
    return got


def session(engine: Engine, prompt: list[int], n: int) -> tuple[str, list[int]]:
    sid = engine.create_session()
    [answer] = run(engine, [(sid, n, {"prompt_ids": prompt})])
    return sid, answer


def test_an_edited_conversation_continues_as_transformers_continues_it(engine: Engine, model: Model) -> None:
    """The session held a prompt and a 10-token answer; the new context keeps the prompt and 4 of those tokens and
    goes on otherwise. Beside it, another session generates in the same steps."""
    prompt, other = model.prompts[1], model.prompts[0]
    sid, answer = session(engine, prompt, 10)
    rng = random.Random(7)
    context = prompt + answer[:4] + [rng.randrange(VOCAB) for _ in range(9)]
    assert engine.kept(sid, context) == len(prompt) + 4
    beside = engine.create_session()
    beside_got, got = run(engine, [(beside, 12, {"prompt_ids": other}), (sid, 12, {"prompt_ids": context,
                                                                                   "from_start": True})])
    assert got == model.greedy(context, 12)
    assert beside_got == model.greedy(other, 12)
    assert engine.session_tokens(sid) == context + got
    engine.close(sid)
    engine.close(beside)


def test_an_answer_generated_again_is_the_first_answer(engine: Engine, model: Model) -> None:
    prompt = model.prompts[1]
    sid, answer = session(engine, prompt, 10)
    assert answer == model.greedy(prompt, 10)
    assert engine.kept(sid, prompt) == len(prompt)
    [again] = run(engine, [(sid, 10, {"prompt_ids": prompt, "from_start": True})])
    assert again == answer
    assert engine.session_length(sid) == len(prompt) + 10
    engine.close(sid)


def test_a_context_that_extends_the_session_keeps_all_of_it(engine: Engine, model: Model) -> None:
    """Even a recurrent state keeps everything when the context only adds to it; then a fork of the session goes on
    exactly as the session does."""
    prompt = model.prompts[1]
    sid, answer = session(engine, prompt, 10)
    held = engine.session_tokens(sid)
    context = held + model.prompts[0]
    assert engine.kept(sid, context) == len(held)
    [got] = run(engine, [(sid, 6, {"prompt_ids": context, "from_start": True})])
    assert got == model.greedy(context, 6)
    child = engine.fork(sid)
    tails = run(engine, [(child, 6, {}), (sid, 6, {})])
    assert tails[0] == tails[1] == model.greedy(context, 12)[6:]
    engine.close(sid)
    engine.close(child)


def test_running_ahead_a_context_cut_right_after_an_answer_or_a_cancel(engine: Engine, model: Model) -> None:
    """With the engine running a step ahead (as on the GPU), steps launched before a request ended still hold rows
    of its session when the next request cuts its tokens back: the state they leave is not kept where it is not the
    new context's."""
    prompt, other = model.prompts[1], model.prompts[0]
    new = [random.Random(5).randrange(VOCAB) for _ in range(6)]
    engine.overlap = True
    try:
        for cancel in (False, True):
            sid, beside = engine.create_session(), engine.create_session()
            rid = engine.start_generate(sid, SamplingParams(max_tokens=8, ignore_eos=True), prompt_ids=prompt)
            engine.start_generate(beside, SamplingParams(max_tokens=40, ignore_eos=True), prompt_ids=other)
            answer: list[int] = []
            ended = False
            while not ended:
                for chunk in engine.step():
                    if chunk.request_id == rid:
                        answer += chunk.token_ids
                        ended = chunk.finish_reason is not None
                if cancel and len(answer) >= 3 and not ended:
                    engine.cancel(rid)
            context = prompt + answer[:2] + new
            again = engine.start_generate(sid, SamplingParams(max_tokens=6, ignore_eos=True), prompt_ids=context,
                                          from_start=True)
            assert finish(engine, again) == model.greedy(context, 6), cancel
            engine.close(sid)
            engine.close(beside)
    finally:
        engine.overlap = False


def test_what_a_from_start_keeps_computed(engine: Engine, model: Model) -> None:
    """kept() counts the tokens kept; session_computed() after start_generate, their state kept. A recurrent state
    cannot be cut: where the context leaves out a token it took in, or ends inside what it took in (the context's
    last token must run again to sample from), it starts again from its checkpoint (the prompt but its last token)
    when the context keeps the prompt, else from nothing."""
    prompt = model.prompts[1]
    n = len(prompt)
    for case in ("cut inside", "cut with a new token", "extension", "cut inside the prompt"):
        sid, answer = session(engine, prompt, 6)
        held = prompt + answer
        assert engine.session_computed(sid) == n + 5  # the last sample pending
        context, kept, state, recurrent = {
            "cut inside": (prompt + answer[:3], n + 3, n + 2, n - 1),  # all kept; its last token runs again
            "cut with a new token": (prompt + answer[:3] + [answer[3] ^ 1], n + 3, n + 3, n - 1),
            "extension": (held + [1, 2], n + 6, n + 5, n + 5),
            "cut inside the prompt": (prompt[:9] + [prompt[9] ^ 1], 9, 9, 0),
        }[case]
        assert engine.kept(sid, context) == kept, case
        rid = engine.start_generate(sid, SamplingParams(max_tokens=1, ignore_eos=True), prompt_ids=context,
                                    from_start=True)
        assert engine.session_computed(sid) == (recurrent if model.recurrent else state), case
        assert finish(engine, rid) == model.greedy(context, 1), case
        engine.close(sid)


def test_a_recurrent_checkpoint_takes_only_free_room(engine: Engine, model: Model) -> None:
    """A checkpoint takes a slot no session needs: a session has none where the table has no slot free, and a
    create that finds none drops the least recently used checkpoint rather than fail; a fork shares its parent's (no
    slot, no copy), so that the parent's answer asked again in the fork computes one token."""
    if not model.recurrent:
        assert engine.checkpoints is None
        return
    cps = engine.checkpoints
    assert cps is not None and len(cps) == 0 and engine.capacity == 4
    prompt = model.prompts[1]
    n = len(prompt)
    a, answer = session(engine, prompt, 6)
    assert len(cps) == 1 and engine.free_slots == 3  # the checkpoint's slot counts free: it goes first
    child = engine.fork(a)
    assert len(cps) == 1 and cps.get(child) is cps.get(a)
    rid = engine.start_generate(child, SamplingParams(max_tokens=6, ignore_eos=True), prompt_ids=prompt,
                                from_start=True)
    assert engine.session_computed(child) == n - 1  # its prompt's last token runs again, nothing before it
    assert finish(engine, rid) == answer == model.greedy(prompt, 6)
    engine.close(child)
    b, c = engine.create_session(), engine.create_session()  # 3 sessions and a's checkpoint fill the table
    assert len(cps) == 1 and engine.free_slots == 1
    [got] = run(engine, [(b, 4, {"prompt_ids": model.prompts[0]})])  # no slot free: no checkpoint
    assert got == model.greedy(model.prompts[0], 4) and len(cps) == 1
    d = engine.create_session()  # takes a's checkpoint's slot
    assert len(cps) == 0 and engine.free_slots == 0
    engine.start_generate(a, SamplingParams(max_tokens=1, ignore_eos=True), prompt_ids=prompt, from_start=True)
    assert engine.session_computed(a) == 0  # computed again from its start
    while engine.has_work():
        engine.step()
    for sid in (a, b, c, d):
        engine.close(sid)
    assert len(cps) == 0


def test_an_edited_last_question_starts_from_the_turn_before(engine: Engine, model: Model) -> None:
    """A session keeps its last two turns' checkpoints: a context that edits the last question (the second prompt
    changed after the first answer) cuts inside the latest checkpoint and starts from the one before, computing the
    first answer and the new question only; edited once more, the same. A regenerate of the edited turn then starts
    from its own checkpoint. Each gives transformers' tokens."""
    if not model.recurrent:
        return
    cps = engine.checkpoints
    assert cps is not None
    first, rng = model.prompts[1], random.Random(11)
    sid, answer = session(engine, first, 5)
    question = [rng.randrange(VOCAB) for _ in range(7)]
    [second] = run(engine, [(sid, 5, {"prompt_ids": question})])
    assert sorted(cp.at for cp in cps.of(sid)) == [len(first) - 1, len(first) + 5 + 6]
    for edit in range(2):
        edited = first + answer + [rng.randrange(VOCAB) for _ in range(6 + edit)]
        rid = engine.start_generate(sid, SamplingParams(max_tokens=6, ignore_eos=True), prompt_ids=edited,
                                    from_start=True)
        assert engine.session_computed(sid) == len(first) - 1, edit
        assert finish(engine, rid) == model.greedy(edited, 6), edit
        assert sorted(cp.at for cp in cps.of(sid)) == [len(first) - 1, len(edited) - 1]
    taken = cps.taken
    rid = engine.start_generate(sid, SamplingParams(max_tokens=6, ignore_eos=True), prompt_ids=edited,
                                from_start=True)
    assert engine.session_computed(sid) == len(edited) - 1
    assert finish(engine, rid) == model.greedy(edited, 6)
    assert cps.taken == taken  # it holds that checkpoint already: not taken again
    engine.close(sid)
    assert len(cps) == 0


def test_who_gives_a_checkpoint_its_room(engine: Engine, model: Model) -> None:
    """Room for checkpoints, four slots in all. A session's new checkpoint takes a free slot, else the slot of another
    session's older checkpoint, never its latest; a fork's own slot comes from another session's checkpoint before its
    parent's, which the child shares: the parent's answer asked again in the fork computes its last token only."""
    if not model.recurrent:
        return
    cps = engine.checkpoints
    assert cps is not None and len(cps) == 0
    first = model.prompts[1]
    a, answer = session(engine, first, 4)
    run(engine, [(a, 4, {"prompt_ids": [5, 6, 7]})])
    older, latest = sorted(cps.of(a), key=lambda cp: cp.at)
    b, _ = session(engine, model.prompts[0], 4)  # the fourth slot: its checkpoint takes a's older one's
    assert cps.of(a) == [latest] and len(cps.of(b)) == 1 and older.dropped
    c = engine.create_session()  # no slot free: the least recently used checkpoint, a's, goes
    assert cps.of(a) == [] and len(cps) == 1
    run(engine, [(c, 2, {"prompt_ids": [9, 8, 7]})])
    assert cps.of(c) == []  # b's is its latest: c has none
    engine.close(c)
    run(engine, [(a, 2, {"prompt_ids": [4, 3]})])  # the free slot: a's checkpoint, more recent than b's
    [mine] = cps.of(b)
    assert len(cps.of(a)) == 1 and engine.table.live == 4
    child = engine.fork(b)  # its slot: a's checkpoint goes, not b's (the least recently used), which it shares
    assert cps.of(a) == [] and cps.of(child) == [mine] and not mine.dropped
    rid = engine.start_generate(child, SamplingParams(max_tokens=4, ignore_eos=True), prompt_ids=model.prompts[0],
                                from_start=True)
    assert engine.session_computed(child) == len(model.prompts[0]) - 1
    assert finish(engine, rid) == model.greedy(model.prompts[0], 4)
    for sid in (a, b, child):
        engine.close(sid)
    assert len(cps) == 0 and engine.table.live == 0


def test_a_cut_to_nothing_new_and_the_refusals(engine: Engine, model: Model) -> None:
    prompt = model.prompts[1]
    sid, _ = session(engine, prompt, 4)
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    with pytest.raises(BadRequest, match="whole context"):
        engine.start_generate(sid, params, from_start=True)
    with pytest.raises(BadRequest, match="whole context"):
        engine.start_generate(sid, params, prompt_ids=prompt, from_start=True, boundary_check=True)
    with pytest.raises(ContextOverflow):
        engine.start_generate(sid, params, prompt_ids=[1] * 600, from_start=True)
    # A context within max_context although the session's tokens and it together are not: the session is replaced.
    long = [random.Random(3).randrange(VOCAB) for _ in range(500)]
    [got] = run(engine, [(sid, 4, {"prompt_ids": long[:300], "from_start": True})])
    assert got == model.greedy(long[:300], 4)
    [got] = run(engine, [(sid, 4, {"prompt_ids": long, "from_start": True})])
    assert got == model.greedy(long, 4)
    assert engine.session_length(sid) == 504
    # Cut back to a prefix of what it held, computing nothing: prefilled only.
    [none] = run(engine, [(sid, 0, {"prompt_ids": long[:100], "from_start": True})])
    assert none == [] and engine.session_tokens(sid) == long[:100]
    engine.start_generate(sid, params)
    with pytest.raises(SessionBusy):
        engine.start_generate(sid, params, prompt_ids=prompt, from_start=True)
    while engine.has_work():
        engine.step()
    engine.close(sid)


def test_a_fork_takes_no_checkpoint_past_the_state_it_copies(engine: Engine, model: Model) -> None:
    """A context that is the prompt less its last token, cancelled before any step: the session's state goes back to
    nothing, its checkpoint (the prompt but its last token) stays and its own K/V under it too. A fork copies the
    state the session computed, none of those K/V: it takes no checkpoint, and computes its context from the start;
    the session itself starts from its checkpoint. Both give transformers' tokens."""
    if not model.recurrent:
        return
    prompt = model.prompts[1]
    n = len(prompt)
    sid, _ = session(engine, prompt, 5)
    cps = engine.checkpoints
    assert cps is not None and (cp := cps.get(sid)) is not None and cp.at == n - 1
    rid = engine.start_generate(sid, SamplingParams(max_tokens=3, ignore_eos=True), prompt_ids=prompt[:-1],
                                from_start=True)
    engine.cancel(rid)
    while engine.has_work():
        engine.step()
    assert engine.session_computed(sid) == 0 and cps.get(sid) is cp
    child = engine.fork(sid)
    assert cps.get(child) is None
    extra = [11, 12, 13]
    context = prompt[:-1] + extra
    [got] = run(engine, [(child, 6, {"prompt_ids": extra})])
    assert got == model.greedy(context, 6)
    rid = engine.start_generate(sid, SamplingParams(max_tokens=6, ignore_eos=True), prompt_ids=extra)
    assert engine.session_computed(sid) == n - 1
    again = finish(engine, rid)
    assert again == got
    engine.close(sid)
    engine.close(child)


# -- the worker's request handling ----------------------------------------------------------------------------------

SID = "f" * 32


def sampling(s: p.Sampling) -> SamplingParams:
    return SamplingParams(max_tokens=s.max_tokens, ignore_eos=s.ignore_eos)


def generate(d: Dispatch, engine: Engine, rid: str, **kw: Any) -> p.Generated:
    answers = d.handle(p.Generate(request_id=rid, session_id=SID, params=p.Sampling(max_tokens=3, ignore_eos=True),
                                  **kw))
    deadline = time.monotonic() + 30
    while not answers:
        assert time.monotonic() < deadline
        answers += d.completed()  # (a long text is tokenized off the loop first)
        while engine.has_work():
            answers += d.step_answers(engine.step(wait=True), time.perf_counter())[0]
    [reply] = answers
    assert isinstance(reply, p.Generated), reply
    return reply


@pytest.mark.parametrize("off_loop", [False, True])
def test_the_worker_takes_the_whole_context_as_ids_text_or_messages(smol_engine: Engine, off_loop: bool,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """Each from_start request leaves the session holding exactly what a new session given the same prompt holds
    (the text with the tokenizer's BOS, the messages rendered from the template's start), and the reply counts the
    tokens it dropped and those it appended after what it kept."""
    engine = smol_engine
    if off_loop:
        monkeypatch.setattr(dispatch_module, "OFFLOAD_CHARS", 8)
    d = Dispatch(engine, WorkerConfig(), sampling, NoMetrics())
    d.handle(p.CreateSession(request_id="c", session_id=SID, route=b"c"))
    try:
        first = generate(d, engine, "g1", prompt="The capital of France is")
        held = engine.session_tokens(SID)
        assert (first.appended, first.rewound, first.cached) == (len(held) - 3, 0, 0)
        text = "The capital of Spain is"
        new = engine.create_session()
        engine.append(new, text=text)
        fresh = engine.session_tokens(new)  # what a new session given the text holds
        engine.close(new)
        reply = generate(d, engine, "g2", prompt=text, from_start=True)
        same = next(i for i, (a, b) in enumerate(zip(held, fresh, strict=False)) if a != b)
        assert engine.session_tokens(SID)[:len(fresh)] == fresh
        assert (reply.rewound, reply.appended, reply.length) == (len(held) - same, len(fresh) - same, len(fresh) + 3)
        assert reply.cached == same  # (the session had computed all it held but its last token)
        turns = [{"role": "user", "content": "Name a colour."}, {"role": "assistant", "content": "Blue."},
                 {"role": "user", "content": "And another?"}]
        rendered = engine.tokenize(engine.tokenizer.apply_chat_template(turns, add_generation_prompt=True),
                                   add_bos=False)
        before = engine.session_length(SID)
        reply = generate(d, engine, "g3", messages=tuple(p.ChatMessage(t["role"], t["content"]) for t in turns), from_start=True)
        assert engine.session_tokens(SID)[:len(rendered)] == rendered
        assert reply.length == len(rendered) + 3 and before - reply.rewound + reply.appended == len(rendered)
        assert reply.rewound > 0 and reply.appended > 0 and reply.cached == before - reply.rewound
        ids = rendered[:10]
        reply = generate(d, engine, "g4", prompt_ids=tuple(ids), from_start=True)
        assert (reply.rewound, reply.appended) == (len(rendered) + 3 - 10, 0)
        assert reply.cached == 9  # all 10 kept, the last computed again to sample from
        assert engine.session_tokens(SID)[:10] == ids and reply.length == 13
    finally:
        d.handle(p.Close(request_id="x", session_id=SID, route=b"c"))


def test_a_chat_turn_resumes_from_the_checkpoint_before_the_reasoning_prompt(model: Model, tmp_path: Path) -> None:
    """Qwen3.5's template opens a <think> in the assistant prompt that no earlier answer shows, so a turn sent whole
    from its start (the gateway's way) keeps the session's tokens up to the prompt less that "<think>\n". The hybrid's
    recurrent state then starts from the checkpoint taken there (the prompt's turn_tail), as the dense model's K/V are
    cut there: both compute only what follows, and generate transformers' tokens for the rendered conversation."""
    folder = tmp_path / "chat"
    shutil.copytree(model.path, folder)
    (folder / "chat_template.jinja").write_text(TEMPLATES.joinpath("qwen3.5.jinja").read_text(encoding="utf-8"),
                                                 encoding="utf-8")
    engine = Engine.load(str(folder), device="cpu", max_sessions=4, max_context=512, step_tokens=64)
    d = Dispatch(engine, WorkerConfig(), sampling, NoMetrics())
    d.handle(p.CreateSession(request_id="c", session_id=SID, route=b"c"))
    try:
        first = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Capital of France?"}]
        asked = engine.tokenize(engine.tokenizer.apply_chat_template(first, add_generation_prompt=True), add_bos=False)
        think = engine.tokenize("<think>\n", add_bos=False)
        assert asked[-len(think):] == think and engine.turn_tail(asked) == (len(think) if model.recurrent else 0)
        generate(d, engine, "g1", messages=tuple(p.ChatMessage(t["role"], t["content"]) for t in first))
        answer = engine.tokenizer.decode(engine.session_tokens(SID)[len(asked):])
        turns = [*first, {"role": "assistant", "content": answer}, {"role": "user", "content": "And of Spain?"}]
        context = engine.tokenize(engine.tokenizer.apply_chat_template(turns, add_generation_prompt=True),
                                  add_bos=False)
        assert common_prefix(context, asked) == len(asked) - len(think)
        reply = generate(d, engine, "g2", messages=tuple(p.ChatMessage(t["role"], t["content"]) for t in turns), from_start=True)
        assert reply.cached == len(asked) - len(think)
        assert engine.session_tokens(SID)[len(context):] == model.greedy(context, 3)
    finally:
        d.handle(p.Close(request_id="x", session_id=SID, route=b"c"))
        engine.unload()


def test_the_message_checks_from_start() -> None:
    with pytest.raises(p.ProtocolError, match="whole context"):
        p.Generate(request_id="r", session_id=SID, from_start=True)
    with pytest.raises(p.ProtocolError, match="whole context"):
        p.Generate(request_id="r", session_id=SID, prompt="x", from_start=True, boundary_check=True)
