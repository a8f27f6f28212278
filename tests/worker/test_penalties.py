"""Logit bias, the repetition, frequency and presence penalties, min_tokens and min_p against Hugging Face transformers.

The reference: transformers' generate on a folder it wrote (Qwen3's tiny config, seeded random fp32 weights), with its
own RepetitionPenaltyLogitsProcessor and SequenceBiasLogitsProcessor, and the OpenAI frequency and presence
penalties as a logits processor of a few lines (transformers has none). The engine must give exactly its greedy
tokens: each prompt alone, interleaved with sessions that ask for other penalties or none, after a fork, and after a
step that failed once its samples were counted. min_tokens against transformers' MinNewTokensLengthLogitsProcessor
(greedy tokens), min_p against its MinPLogitsWarper (the tokens sampling may draw).
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from tests.worker.faults import fail_once
from tests.worker.interpreted import run_interpreted
from tests.worker.test_families import Folder, write_folder
from worker.engine import Engine
from worker.engine.penalties import Penalties
from worker.engine.sampling import SamplingParams
from worker.errors import BadRequest

transformers = pytest.importorskip("transformers")

NEW = 24


class FrequencyPresence:
    """OpenAI's penalties over the tokens generated so far (those after the prompt), as vLLM computes them."""

    def __init__(self, prompt_length: int, frequency: float, presence: float) -> None:
        self.prompt_length, self.frequency, self.presence = prompt_length, frequency, presence

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        counts = torch.zeros_like(scores, dtype=torch.int64)
        answer = input_ids[:, self.prompt_length:]
        counts.scatter_add_(1, answer, torch.ones_like(answer))
        scores = scores - self.frequency * counts
        return scores - self.presence * (counts > 0)


# name -> the engine's parameters
CASES: dict[str, dict[str, Any]] = {
    "repetition": {"repetition_penalty": 1.8},
    "below one": {"repetition_penalty": 0.6},
    "frequency and presence": {"frequency_penalty": 1.5, "presence_penalty": 0.7},
    "negative": {"frequency_penalty": -0.4, "presence_penalty": -1.1},
    "logit bias": {"logit_bias": ((7, 6.0), (200, -100.0), (31, 2.5))},
    "all of them": {"logit_bias": ((7, 3.0),), "repetition_penalty": 1.3, "frequency_penalty": 0.5,
                    "presence_penalty": 0.25},
}


def processors(case: dict[str, Any], prompt_length: int) -> list[Any]:
    """The case as transformers' logits processors, in vLLM's order: bias, repetition, frequency and presence."""
    out: list[Any] = []
    if case.get("logit_bias"):
        out.append(transformers.SequenceBiasLogitsProcessor([[[t], b] for t, b in case["logit_bias"]]))
    if case.get("repetition_penalty", 1.0) != 1.0:
        out.append(transformers.RepetitionPenaltyLogitsProcessor(case["repetition_penalty"]))
    if case.get("frequency_penalty") or case.get("presence_penalty"):
        out.append(FrequencyPresence(prompt_length, case.get("frequency_penalty", 0.0),
                                     case.get("presence_penalty", 0.0)))
    return out


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Folder:
    return write_folder(tmp_path_factory.mktemp("penalties"), "qwen3")


@pytest.fixture(scope="module")
def expected(folder: Folder) -> dict[str, list[list[int]]]:
    """transformers' greedy tokens of each case, for each of the folder's prompts."""
    model = transformers.AutoModelForCausalLM.from_pretrained(folder.path, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    out: dict[str, list[list[int]]] = {}
    with torch.no_grad():
        for name, case in CASES.items():
            out[name] = []
            for prompt in folder.prompts:
                ids = model.generate(torch.tensor([prompt]), max_new_tokens=NEW, do_sample=False,
                                     attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                                     logits_processor=transformers.LogitsProcessorList(processors(case, len(prompt))))
                out[name].append(ids[0, len(prompt):].tolist())
    return out


@pytest.fixture(scope="module")
def engine(folder: Folder) -> Iterator[Engine]:
    eng = Engine.load(str(folder.path), device="cpu", max_sessions=12, max_context=512)
    yield eng
    eng.unload()


def args(name: str, max_tokens: int = NEW) -> dict[str, object]:
    return {"max_tokens": max_tokens, "ignore_eos": True, **CASES[name]}


def opened(engine: Engine, prompt: list[int]) -> str:
    sid = engine.create_session()
    engine.append(sid, token_ids=prompt)
    return sid


def test_the_cases_change_the_greedy_tokens(folder: Folder, expected: dict[str, list[list[int]]]) -> None:
    """Each case's reference differs from plain greedy for some prompt: the tests below would see a penalty dropped."""
    for name in CASES:
        assert expected[name] != folder.expected, name


@pytest.mark.parametrize("name", sorted(CASES))
def test_each_prompt_alone_gives_transformers_tokens(engine: Engine, folder: Folder,
                                                     expected: dict[str, list[list[int]]], name: str) -> None:
    for prompt, tokens in zip(folder.prompts, expected[name], strict=True):
        sid = opened(engine, prompt)
        assert engine.generate(sid, **args(name)).token_ids == tokens
        engine.close(sid)
    assert engine.penalties is not None and engine.penalties.held == 0


def test_interleaved_sessions_each_get_their_own_cases_tokens(engine: Engine, folder: Folder,
                                                              expected: dict[str, list[list[int]]]) -> None:
    """Every case and plain greedy on every prompt, all in one batch: each row's numbers are its own request's."""
    runs: list[tuple[str, dict[str, object], list[int]]] = []
    for i, prompt in enumerate(folder.prompts):
        runs.append((opened(engine, prompt), {"max_tokens": NEW, "ignore_eos": True}, folder.expected[i]))
        for name in ("repetition", "frequency and presence", "all of them"):
            runs.append((opened(engine, prompt), args(name), expected[name][i]))
    results = engine.generate_many([(sid, a) for sid, a, _ in runs])
    assert [r.token_ids for r in results] == [tokens for _, _, tokens in runs]
    for sid, _, _ in runs:
        engine.close(sid)


def test_a_fork_continues_with_its_own_count_of_its_answer(engine: Engine, folder: Folder,
                                                           expected: dict[str, list[list[int]]]) -> None:
    """The penalties count the generation's answer and the context it started from. After 10 tokens, a fork and its
    parent each generate again: their context now holds those 10 tokens (so the repetition penalty, over context and
    answer, gives transformers' tokens), and a frequency penalty starts counting afresh."""
    prompt, tokens = folder.prompts[1], expected["repetition"][1]
    parent = opened(engine, prompt)
    head = engine.generate(parent, **args("repetition", 10)).token_ids
    child = engine.fork(parent)
    tails = engine.generate_many([(child, args("repetition", NEW - 10)), (parent, args("repetition", NEW - 10))])
    assert head + tails[0].token_ids == tokens
    assert head + tails[1].token_ids == tokens
    for sid in (parent, child):
        engine.close(sid)


def test_a_failed_step_after_its_samples_were_counted_counts_them_once(
        engine: Engine, folder: Folder, expected: dict[str, list[list[int]]], monkeypatch: pytest.MonkeyPatch) -> None:
    """The step is run again, so its samples are counted again: the counts are built again from the tokens accepted,
    and the answer is the uninterrupted one (a frequency penalty counted twice would change it)."""
    import worker.engine.core

    overlap = engine.overlap
    engine.overlap = True  # a step launched ahead, its samples counted before the failure is read
    try:
        sids = [opened(engine, folder.prompts[i]) for i in (0, 1)]
        rids = [engine.start_generate(sids[0], SamplingParams(**args("frequency and presence"))),  # type: ignore[arg-type]
                engine.start_generate(sids[1], SamplingParams(**args("all of them")))]  # type: ignore[arg-type]
        out: dict[str, list[int]] = {r: [] for r in rids}
        for _ in range(5):
            for chunk in engine.step():
                out[chunk.request_id] += chunk.token_ids
        fail_once(monkeypatch, worker.engine.core, "step_logprobs")  # after the step's sampling and its count
        with pytest.raises(RuntimeError, match="injected"):
            engine.step()
        while engine.has_work():
            for chunk in engine.step():
                out[chunk.request_id] += chunk.token_ids
        assert [out[r] for r in rids] == [expected["frequency and presence"][0], expected["all of them"][1]]
        for sid in sids:
            engine.close(sid)
    finally:
        engine.overlap = overlap


def amid_noise(engine: Engine, prompt: list[int], asked: dict[str, object], folder: Folder, others: int) -> list[int]:
    """The tokens of a generation of `prompt` batched with `others` sessions generating with the negative penalties."""
    sid = opened(engine, prompt)
    noise = [opened(engine, folder.prompts[i % 2]) for i in range(others)]
    results = engine.generate_many([(sid, asked), *((n, args("negative")) for n in noise)])
    for s in (sid, *noise):
        engine.close(s)
    return results[0].token_ids


def test_a_seeded_sample_with_penalties_is_the_same_in_any_batch(engine: Engine, folder: Folder) -> None:
    sampled: dict[str, object] = {"max_tokens": 16, "ignore_eos": True, "temperature": 0.8, "seed": 7,
                                  **CASES["all of them"]}
    alone = amid_noise(engine, folder.prompts[2], sampled, folder, 0)
    assert amid_noise(engine, folder.prompts[2], sampled, folder, 3) == alone
    assert amid_noise(engine, folder.prompts[2], sampled, folder, 0) == alone


@pytest.mark.parametrize(("change", "named"), [
    ({"presence_penalty": 2.5}, "presence_penalty must be in [-2, 2]"),
    ({"frequency_penalty": float("nan")}, "frequency_penalty must be in [-2, 2]"),
    ({"repetition_penalty": 0.0}, "repetition_penalty must be in [0.01, 10]"),
    ({"repetition_penalty": 1e-40}, "repetition_penalty must be in [0.01, 10]"),  # would overflow a logit to inf
    ({"presence_penalty": 10**400}, "presence_penalty must be in [-2, 2]"),
    ({"logit_bias": None}, "logit_bias must be (token id, bias) pairs, got NoneType"),
    ({"logit_bias": ((5, 10**400),)}, "logit_bias values must be in [-100, 100]"),
    ({"logit_bias": ((1000, 1.0),)}, "logit_bias keys must be token ids in [0, 259)"),
    ({"logit_bias": ((5, 1.0), (5, 2.0))}, "logit_bias names token 5 twice"),
    ({"logit_bias": ((5, 101.0),)}, "logit_bias values must be in [-100, 100]"),
    ({"logit_bias": tuple((i, 1.0) for i in range(301))}, "logit_bias may hold at most 300 tokens"),
])
def test_bad_values_are_refused_by_name_and_change_nothing(engine: Engine, folder: Folder, change: dict[str, Any],
                                                           named: str) -> None:
    sid = opened(engine, folder.prompts[0])
    with pytest.raises(BadRequest, match=re.escape(named)):
        engine.start_generate(sid, SamplingParams(max_tokens=4, **change), prompt_ids=[1, 2])
    assert engine.session_length(sid) == len(folder.prompts[0])
    engine.close(sid)


def test_the_pool_grows_keeps_rows_and_builds_a_row_again_as_counted() -> None:
    pool = Penalties(16, torch.device("cpu"))
    params = SamplingParams(frequency_penalty=1.0, repetition_penalty=2.0, logit_bias=((3, 0.5),))
    rows = [pool.open(params, [1, 2]) for _ in range(5)]  # past the first 4 rows: grown
    assert rows == [0, 1, 2, 3, 4] and pool.rows == 8 and pool.held == 5
    step = pool.rows_of([0, 1], [rows[0], rows[4]])
    pool.count(torch.tensor([9, 9]), step)
    pool.count(torch.tensor([9, 4]), step)
    counted = pool.counts[rows[4]].clone()
    pool.rebuild(rows[4], [1, 2], [9, 4])
    assert torch.equal(pool.counts[rows[4]], counted)
    assert pool.counts[rows[0], 9] == 2 and pool.context[rows[0], 1] and not pool.context[rows[0], 9]
    logits = torch.arange(32, dtype=torch.float32).reshape(2, 16) - 8.0
    changed = pool.apply(logits, pool.rows_of([1], [rows[0]]))
    assert torch.equal(changed[0], logits[0])  # the row not named is the model's
    want = logits[1].clone()
    want[3] += 0.5
    for t in (1, 2, 9):  # context and answer: positive logits divided by 2
        want[t] = want[t] / 2.0
    want[9] -= 2.0  # counted twice, frequency 1
    assert torch.equal(changed[1], want)
    pool.close(rows[2])
    assert pool.open(SamplingParams(presence_penalty=1.0), []) == rows[2]
    assert pool.counts[rows[2]].sum() == 0 and not pool.context[rows[2]].any() and pool.bias[rows[2]].sum() == 0


def test_the_engine_takes_logit_bias_as_a_map_or_as_pairs(engine: Engine, folder: Folder,
                                                           expected: dict[str, list[list[int]]]) -> None:
    bias = CASES["logit bias"]["logit_bias"]
    for given in (dict(bias), [list(pair) for pair in bias]):
        sid = opened(engine, folder.prompts[0])
        assert engine.generate(sid, max_tokens=NEW, ignore_eos=True, logit_bias=given).token_ids == \
            expected["logit bias"][0]
        engine.close(sid)
    sid = opened(engine, folder.prompts[0])
    with pytest.raises(BadRequest, match=re.escape("logit_bias entries must be (token id, bias) pairs, got 5")):
        engine.generate(sid, max_tokens=2, logit_bias=[5])
    engine.close(sid)


def test_a_request_without_them_takes_no_row(engine: Engine, folder: Folder) -> None:
    sid = opened(engine, folder.prompts[0])
    held = 0 if engine.penalties is None else engine.penalties.held
    engine.start_generate(sid, SamplingParams(max_tokens=2, ignore_eos=True, repetition_penalty=1.0))
    assert (0 if engine.penalties is None else engine.penalties.held) == held
    while engine.has_work():
        engine.step()
    engine.close(sid)


def test_the_gpu_kernels_give_the_torch_ops_bits_in_the_interpreter() -> None:
    run_interpreted("penalties_kernels", timeout_s=300)


@pytest.mark.parametrize("least", [8, 11])
def test_min_tokens_keeps_a_stop_token_out_of_reach_as_transformers_does(
        engine: Engine, folder: Folder, expected: dict[str, list[list[int]]], least: int) -> None:
    """The stop token is plain greedy's third token: without min_tokens the answer ends there; with `least` it is
    the tokens transformers generates with min_new_tokens `least`, up to that token's next turn (not returned), run
    ahead too. With 11 the token comes back exactly at the 12th: a mask lifted a token late would miss it."""
    prompt, stop = folder.prompts[1], folder.expected[1][2]
    model = transformers.AutoModelForCausalLM.from_pretrained(folder.path, dtype=torch.float32).eval()
    model.generation_config.pad_token_id = 0
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=NEW, do_sample=False, eos_token_id=stop,
                             min_new_tokens=least, attention_mask=torch.ones(1, len(prompt), dtype=torch.long))
    reference = out[0, len(prompt):].tolist()
    assert stop in reference[least:] and stop not in reference[:least]
    reference = reference[:reference.index(stop, least)]
    assert least != 11 or len(reference) == 11
    sid = opened(engine, prompt)
    early = engine.generate(sid, max_tokens=NEW, ignore_eos=True, stop_token_ids=[stop])
    assert (early.token_ids, early.finish_reason) == (folder.expected[1][:2], "stop")
    engine.close(sid)
    overlap = engine.overlap
    try:
        for ahead in (False, True):
            engine.overlap = ahead
            sid = opened(engine, prompt)
            done = engine.generate(sid, max_tokens=NEW, ignore_eos=True, stop_token_ids=[stop], min_tokens=least)
            assert (done.token_ids, done.finish_reason) == (reference, "stop")
            engine.close(sid)
    finally:
        engine.overlap = overlap


def test_min_tokens_above_max_tokens_is_refused(engine: Engine, folder: Folder) -> None:
    sid = opened(engine, folder.prompts[0])
    with pytest.raises(BadRequest, match=re.escape("min_tokens must be an integer in [0, max_tokens = 4], got 5")):
        engine.generate(sid, max_tokens=4, min_tokens=5)
    with pytest.raises(BadRequest, match=re.escape("min_p must be in [0, 1], got 1.5")):
        engine.generate(sid, max_tokens=4, min_p=1.5)
    engine.close(sid)


@pytest.mark.parametrize(("top_k", "top_p", "min_p"), [(0, 1.0, 0.05), (0, 1.0, 0.3), (20, 1.0, 0.1), (0, 1.0, 1.0),
                                                       (0, 0.9, 0.0), (0, 0.9, 0.05), (20, 0.8, 0.1), (0, 0.5, 0.5)])
def test_min_p_keeps_the_tokens_transformers_keeps(top_k: int, top_p: float, min_p: float) -> None:
    from worker.engine.sampling import kept

    gen = torch.Generator().manual_seed(11)
    scaled = torch.randn((6, 500), generator=gen) * 3
    probs, ids = kept(scaled, torch.full((6,), top_k), torch.full((6,), top_p, dtype=torch.float64),
                      torch.full((6,), min_p, dtype=torch.float64))
    ours = [set(ids[r][probs[r] > 0].tolist()) for r in range(6)]
    warpers: list[Any] = []
    if top_k:
        warpers.append(transformers.TopKLogitsWarper(top_k))
    if top_p < 1.0:
        warpers.append(transformers.TopPLogitsWarper(top_p))
    if min_p:
        warpers.append(transformers.MinPLogitsWarper(min_p))
    scores = scaled.clone()
    for warper in warpers:
        scores = warper(torch.zeros((6, 1), dtype=torch.long), scores)
    theirs = [set(torch.nonzero(scores[r] > float("-inf"))[:, 0].tolist()) for r in range(6)]
    assert ours == theirs and all(len(s) < 500 for s in ours)


def test_a_seeded_sample_with_min_p_is_the_same_in_any_batch_and_its_cut_changes_the_draws(
        engine: Engine, folder: Folder) -> None:
    sampled: dict[str, object] = {"max_tokens": 16, "ignore_eos": True, "temperature": 1.5, "seed": 3, "min_p": 0.2}
    alone = amid_noise(engine, folder.prompts[1], sampled, folder, 0)
    assert amid_noise(engine, folder.prompts[1], sampled, folder, 2) == alone
    sid = opened(engine, folder.prompts[1])
    wide = engine.generate(sid, **{**sampled, "min_p": 0.0}).token_ids
    engine.close(sid)
    assert wide != alone  # at temperature 1.5 the cut changes what is drawn
