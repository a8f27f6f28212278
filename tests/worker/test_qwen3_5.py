"""Qwen3.5, the hybrid model (gated DeltaNet + gated attention), against Hugging Face transformers on a folder transformers
itself wrote.

A tiny `qwen3_5_text` config with both layer kinds (three DeltaNet layers, then full attention), seeded random fp32
weights (the norms, dt_bias and A_log random too, so that each is shown to be read) is saved by transformers; the engine
loads the folder on the CPU and must give exactly transformers' greedy tokens over 24 tokens for prompts shorter than
the delta rule's 64-token blocks, longer and not a multiple of them, and longer than a prefill chunk: each prompt alone,
all interleaved in one batch, a session forked in the middle of its generation continuing exactly as its parent, and
a second turn continuing as transformers continues from its cache.
The engines run with prefill chunks of 64 and of 256 tokens (the CPU's default), so the convolution and recurrent
states are carried across chunks; teacher-forced, the logits are transformers' bit for bit. Each per-session state is
shown to be read (zeroing it changes the next logits), a fork to copy all of it, and the engine running ahead (as on
the GPU) to give exactly what one step at a time gives through stops, cancels, forks and a failed step.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from tests.worker.faults import fail_once
from worker.engine import Engine
from worker.engine.executor import StepRows
from worker.engine.sampling import SamplingParams
from worker.model.config import PRESETS, ModelLoadError
from worker.model.loader import load_model
from worker.model.qwen3_5 import Qwen3_5, state_spec
from worker.model.tokenizer import Tokenizer

transformers = pytest.importorskip("transformers")

VOCAB = 259  # the bytes-only tokenizer's ids
NEW_TOKENS = 24
# under one 64-token block, over it and not a multiple, over the 256-token chunk; one token, one whole block
PROMPT_LENGTHS = (5, 41, 100, 300, 1, 64)
CHUNKS = (64, 256)  # the engines' prefill chunks (step_tokens): 300 tokens are 4 x 64 + 44, or 256 + 44
TINY: dict[str, Any] = dict(
    vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
    num_key_value_heads=2, head_dim=32, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
    linear_value_head_dim=24, linear_conv_kernel_dim=4, max_position_embeddings=1024, rms_norm_eps=1e-6,
    initializer_range=0.3,  # sharp attention and DeltaNet inputs: positions and states matter
)


@pytest.fixture(scope="module", autouse=True)
def one_thread() -> Iterator[None]:
    """The depthwise convolution (oneDNN, as transformers calls it too) runs an OpenMP region for a few hundred
    numbers: on two cores shared with other work, two spinning threads made each call take ~20 ms instead of 0.2."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@dataclass
class Folder:
    path: Path
    prompts: list[list[int]]
    expected: list[list[int]]  # transformers' greedy continuation of each prompt
    logits: list[torch.Tensor]  # transformers' logits at each of those steps (NEW_TOKENS, vocab)


def write_folder(tmp: Path) -> Folder:
    return hybrid_folder(tmp / "qwen3_5", transformers.Qwen3_5TextConfig(**TINY), "Qwen3_5ForCausalLM", 35,
                         PROMPT_LENGTHS, NEW_TOKENS)


def hybrid_folder(path: Path, config: Any, architecture: str, seed: int, prompt_lengths: Sequence[int],
                  new_tokens: int) -> Folder:
    """A tiny hybrid model (three DeltaNet layers, then full attention) that transformers makes from `config` with
    seeded random weights, saved at `path` with the bytes-only tokenizer; with transformers' greedy tokens and logits
    for seeded random prompts of `prompt_lengths`. Also the MoE family's (tests/worker/test_qwen3_5_moe.py)."""
    assert config.layer_types == ["linear_attention"] * 3 + ["full_attention"]
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    assert type(model).__name__ == architecture
    with torch.no_grad():  # transformers initialises the norms to zero (a scale of one) and dt_bias to ones
        for name, p in model.named_parameters():
            if "linear_attn.norm" in name:
                p.copy_(1 + 0.2 * torch.randn_like(p))
            elif "norm" in name:
                p.copy_(0.2 * torch.randn_like(p))
            elif name.endswith("dt_bias"):  # slow decays (exp(g) near 1): the state carries far back
                p.copy_(-3 + 0.2 * torch.randn_like(p))
            elif name.endswith("A_log"):
                p.copy_(torch.empty_like(p).uniform_(0.01, 0.5).log())
            elif name.endswith("shared_expert_gate.weight"):  # MoE: the shared expert's weight in (0.1, 0.9)
                p.mul_(0.2)
    model.save_pretrained(path)
    Tokenizer.bytes_only()._tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|im_end|>"}))
    rng = random.Random(seed)
    prompts = [[rng.randrange(VOCAB) for _ in range(n)] for n in prompt_lengths]
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    expected, logits = [], []
    with torch.no_grad():
        for prompt in prompts:
            out = model.generate(torch.tensor([prompt]), max_new_tokens=new_tokens, do_sample=False,
                                 attention_mask=torch.ones(1, len(prompt), dtype=torch.long), output_logits=True,
                                 return_dict_in_generate=True)
            expected.append(out.sequences[0, len(prompt):].tolist())
            logits.append(torch.cat(out.logits))
    return Folder(path, prompts, expected, logits)


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Folder:
    return write_folder(tmp_path_factory.mktemp("qwen3_5"))


@pytest.fixture(scope="module", params=CHUNKS)
def engine(request: pytest.FixtureRequest, folder: Folder) -> Iterator[Engine]:
    eng = Engine.load(str(folder.path), device="cpu", max_sessions=len(folder.prompts) + 2, max_context=512,
                      step_tokens=request.param)
    assert eng.prefill_chunk == request.param
    yield eng
    eng.unload()


GREEDY: dict[str, object] = {"max_tokens": NEW_TOKENS, "ignore_eos": True}


def test_each_prompt_alone_gives_transformers_greedy_tokens(engine: Engine, folder: Folder) -> None:
    for prompt, expected in zip(folder.prompts, folder.expected, strict=True):
        sid = engine.create_session()
        engine.append(sid, token_ids=prompt)
        assert engine.generate(sid, **GREEDY).token_ids == expected
        engine.close(sid)


def test_prompts_interleaved_in_one_batch_give_the_same_tokens(engine: Engine, folder: Folder) -> None:
    sids = []
    for prompt in folder.prompts:
        sids.append(engine.create_session())
        engine.append(sids[-1], token_ids=prompt)
    results = engine.generate_many([(sid, GREEDY) for sid in sids])
    assert [r.token_ids for r in results] == folder.expected
    for sid in sids:
        engine.close(sid)


def test_a_fork_mid_generation_continues_exactly_as_its_parent(engine: Engine, folder: Folder) -> None:
    for i in (1, 3):  # a prompt within one block, and one over a chunk
        prompt, expected = folder.prompts[i], folder.expected[i]
        parent = engine.create_session()
        engine.append(parent, token_ids=prompt)
        head = engine.generate(parent, max_tokens=10, ignore_eos=True).token_ids
        child = engine.fork(parent)
        rest: dict[str, object] = {"max_tokens": NEW_TOKENS - 10, "ignore_eos": True}
        tails = engine.generate_many([(child, rest), (parent, rest)])
        assert head + tails[0].token_ids == expected
        assert head + tails[1].token_ids == expected
        engine.close(parent)
        engine.close(child)


def test_a_second_turn_continues_as_transformers_continues_its_cache(engine: Engine, folder: Folder) -> None:
    """Turn two of a conversation: the engine prefills the last sampled token and the new prompt from the slot's
    states; transformers' generate continuing from its cache of turn one computes the same chunk. The same tokens."""
    model = transformers.AutoModelForCausalLM.from_pretrained(folder.path, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    first, second = folder.prompts[2], folder.prompts[3][:30]

    def ones(ids: list[int]) -> torch.Tensor:
        return torch.ones(1, len(ids), dtype=torch.long)

    with torch.no_grad():
        one = model.generate(torch.tensor([first]), max_new_tokens=10, do_sample=False, return_dict_in_generate=True,
                             attention_mask=ones(first))
        history = one.sequences[0].tolist() + second
        two = model.generate(torch.tensor([history]), cache=one.past_key_values, max_new_tokens=12, do_sample=False,
                             attention_mask=ones(history))
    sid = engine.create_session()
    engine.append(sid, token_ids=first)
    assert engine.generate(sid, max_tokens=10, ignore_eos=True).token_ids == one.sequences[0, len(first):].tolist()
    engine.append(sid, token_ids=second)
    assert engine.generate(sid, max_tokens=12, ignore_eos=True).token_ids == two[0, len(history):].tolist()
    engine.close(sid)


def teacher_forced(engine: Engine, prompt: list[int], tokens: list[int], chunk: int) -> torch.Tensor:
    """Logits after the prompt (prefilled in chunks of `chunk`) and after each of `tokens` but the last (decode rows)."""
    slot = engine.table.create(engine.max_context)
    try:
        for start in range(0, len(prompt), chunk):
            part = prompt[start : start + chunk]
            rows = [engine.executor.execute(StepRows(part, list(range(start, start + len(part))), [slot] * len(part),
                                                     [len(part) - 1]))]
        for i, token in enumerate(tokens[:-1]):
            rows.append(engine.executor.execute(StepRows([token], [len(prompt) + i], [slot], [0])))
        return torch.cat(rows)
    finally:
        engine.table.free(slot)


def test_teacher_forced_logits_are_transformers_bit_for_bit(engine: Engine, folder: Folder) -> None:
    """Prompts cut into chunks that are multiples of 64 compute transformers' blocks: the same bits at every step."""
    for prompt, tokens, expected in zip(folder.prompts, folder.expected, folder.logits, strict=True):
        assert torch.equal(teacher_forced(engine, prompt, tokens, engine.prefill_chunk), expected)


def test_every_state_is_read_and_carried(engine: Engine, folder: Folder) -> None:
    """Zeroing any one per-session state (the K/V, the convolution's held inputs, the recurrent state) between a prompt
    and its next token changes that token's logits: none is silently left out. Carried across chunks that are not
    64-token blocks (40 here) the numbers move by rounding only; dropped at a chunk's end they do not."""
    prompt, tokens = folder.prompts[2], folder.expected[2]
    reference = folder.logits[2]
    uneven = teacher_forced(engine, prompt, tokens, 40)
    assert uneven.argmax(-1).tolist() == tokens and float((uneven - reference).abs().max()) < 1e-3
    state = engine.table.views()
    for name in ("k", "conv", "recurrent"):
        slot = engine.table.create(engine.max_context)
        try:
            engine.executor.execute(StepRows(prompt, list(range(len(prompt))), [slot] * len(prompt), [0]))
            state[name][slot].zero_()
            after = engine.executor.execute(StepRows([tokens[0]], [len(prompt)], [slot], [0]))[0]
        finally:
            engine.table.free(slot)
        assert float((after - reference[1]).abs().max()) > 0.05, name


@pytest.mark.parametrize("left_behind", ["conv", "recurrent"])
def test_the_checks_notice_a_state_not_carried_across_chunks(engine: Engine, folder: Folder, left_behind: str,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """A mutation of the model that starts each prompt chunk from zero convolution inputs, or from a zero recurrent
    state, instead of what the chunk before left: the logits after a 300-token prompt cut in 64-token chunks move far
    from transformers'."""
    from worker.model import delta_rule, qwen3_5

    if left_behind == "conv":
        convolve = Qwen3_5._convolve
        monkeypatch.setattr(Qwen3_5, "_convolve", staticmethod(
            lambda layer, new, held, start: convolve(layer, new, held, qwen3_5.FRESH if start == qwen3_5.PROMPT else start)))
    else:
        chunked = delta_rule.chunked
        monkeypatch.setattr(delta_rule, "chunked", lambda q, k, v, g, beta, state=None: chunked(q, k, v, g, beta))
    logits = teacher_forced(engine, folder.prompts[3], folder.expected[3], 64)
    assert float((logits - folder.logits[3]).abs().max()) > 0.1


def test_a_fork_copies_every_state_whole_and_the_kv_prefix(engine: Engine, folder: Folder) -> None:
    parent = engine.create_session()
    engine.append(parent, token_ids=folder.prompts[1])
    engine.generate(parent, max_tokens=3, ignore_eos=True)
    child = engine.fork(parent)
    sessions = engine._sessions
    p, c = sessions[parent], sessions[child]
    assert c.computed == p.computed == len(folder.prompts[1]) + 2
    state = engine.table.views()
    for name in ("conv", "recurrent"):
        assert torch.count_nonzero(state[name][p.slot]) > 0
        assert torch.equal(state[name][c.slot], state[name][p.slot])
    for name in ("k", "v"):
        ours, theirs = (state[name][slot].flatten(2, 3)[:, :, : p.computed] for slot in (c.slot, p.slot))  # positions
        assert torch.equal(ours, theirs)
    engine.close(parent)
    engine.close(child)


# -- running ahead ------------------------------------------------------------------------------------------------


def drive(engine: Engine, prompts: list[list[int]], overlap: bool, stop_id: int) -> dict[str, list[int]]:
    """Three sessions through events that leave rows of ended requests in steps launched ahead: A stops on a token
    and at once takes another turn, B is cancelled mid-way and takes another turn, C ends by length and is forked
    right away; then one more turn on every session. Returns every request's tokens."""
    engine.overlap = overlap
    try:
        sids = {name: engine.create_session() for name in "ABC"}
        for prompt, sid in zip(prompts, sids.values(), strict=False):
            engine.append(sid, token_ids=prompt)
        names: dict[str, str] = {}
        out: dict[str, list[int]] = {}

        def start(name: str, sid: str, **kw: Any) -> None:
            names[engine.start_generate(sid, SamplingParams(**kw))] = name
            out[name] = []

        start("A", sids["A"], max_tokens=20, stop_token_ids=(stop_id,), ignore_eos=True)
        start("B", sids["B"], max_tokens=20, ignore_eos=True)
        start("C", sids["C"], max_tokens=6, ignore_eos=True)
        done: set[str] = set()
        while engine.has_work():
            for chunk in engine.step():
                name = names[chunk.request_id]
                out[name] += chunk.token_ids
                if chunk.finish_reason is not None:
                    done.add(name)
            if "A" in done and "A2" not in out:
                engine.append(sids["A"], token_ids=prompts[3][:7])
                start("A2", sids["A"], max_tokens=6, ignore_eos=True)
            if len(out["B"]) >= 4 and "B" not in done:
                engine.cancel(next(r for r, n in names.items() if n == "B"))
            if "B" in done and "B2" not in out:
                engine.append(sids["B"], token_ids=prompts[3][7:12])
                start("B2", sids["B"], max_tokens=6, ignore_eos=True)
            if "C" in done and "G" not in out:
                sids["G"] = engine.fork(sids["C"])
                start("G", sids["G"], max_tokens=6, ignore_eos=True)
        assert done >= {"A", "B", "C"}
        for sid in sids.values():
            engine.append(sid, token_ids=prompts[3][12:20])
        for name, g in zip(sids, engine.generate_many([(s, {"max_tokens": 5, "ignore_eos": True})
                                                       for s in sids.values()]), strict=True):
            out[name + "+"] = g.token_ids
        for sid in sids.values():
            engine.close(sid)
        return out
    finally:
        engine.overlap = False


def test_running_ahead_gives_what_one_step_at_a_time_gives(engine: Engine, folder: Folder) -> None:
    prompts = folder.prompts
    stop_id = folder.expected[0][5]  # A (prompt 0) stops at its sixth token
    assert stop_id not in folder.expected[0][:5]
    plain = drive(engine, prompts, False, stop_id)
    ahead = drive(engine, prompts, True, stop_id)
    assert plain["A"] == folder.expected[0][:5] and plain["C"] == folder.expected[2][:6] and len(plain["B"]) == 4
    assert ahead == plain


def test_a_failed_step_leaves_the_states_to_be_computed_again(engine: Engine, folder: Folder,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """A step that fails after the forward ran (its sampling) has advanced the recurrent states of its sessions: they
    are computed again from their histories, and the tokens are the same."""
    import worker.engine.core

    engine.overlap = True
    try:
        sids = [engine.create_session() for _ in range(2)]
        for sid, prompt in zip(sids, folder.prompts[1:3], strict=True):
            engine.append(sid, token_ids=prompt)
        rids = [engine.start_generate(sid, SamplingParams(max_tokens=12, ignore_eos=True)) for sid in sids]
        out: dict[str, list[int]] = {r: [] for r in rids}
        for _ in range(4):
            for chunk in engine.step():
                out[chunk.request_id] += chunk.token_ids
        fail_once(monkeypatch, worker.engine.core, "sample_ids")
        with pytest.raises(RuntimeError, match="injected"):
            engine.step()
        assert all(engine._sessions[sid].computed == 0 for sid in sids)
        while engine.has_work():
            for chunk in engine.step():
                out[chunk.request_id] += chunk.token_ids
        assert [out[r] for r in rids] == [folder.expected[1][:12], folder.expected[2][:12]]
        for sid in sids:
            engine.close(sid)
    finally:
        engine.overlap = False


# -- folders, presets, refusals ----------------------------------------------------------------------------------


def test_a_qwen3_5_folder_serves_its_text_model(tmp_path: Path, folder: Folder) -> None:
    """The text part of a `qwen3_5` (vision-language) folder: text_config read, model.language_model.* tensors taken,
    the vision tower and the multi-token-prediction head left out. The same tokens as the text folder."""
    text_cfg = json.loads((folder.path / "config.json").read_text())
    cfg = {"model_type": "qwen3_5", "architectures": ["Qwen3_5ForConditionalGeneration"], "text_config": text_cfg,
           "vision_config": {"model_type": "qwen3_5_vision", "depth": 2}, "image_token_id": 248056,
           "tie_word_embeddings": False}
    vl = tmp_path / "vl"
    vl.mkdir()
    (vl / "config.json").write_text(json.dumps(cfg))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (vl / name).write_text((folder.path / name).read_text())
    with safe_open(str(folder.path / "model.safetensors"), framework="pt") as f:
        tensors = {(k if k.startswith("lm_head") else k.replace("model.", "model.language_model.", 1)): f.get_tensor(k)
                   for k in f.keys()}  # noqa: SIM118
    tensors["model.visual.blocks.0.attn.qkv.weight"] = torch.zeros(3, 3)
    tensors["mtp.layers.0.mlp.up_proj.weight"] = torch.zeros(2, 2)
    save_file(tensors, str(vl / "model.safetensors"))
    eng = Engine.load(str(vl), device="cpu", max_sessions=1, max_context=512)
    try:
        sid = eng.create_session()
        eng.append(sid, token_ids=folder.prompts[2])
        assert eng.generate(sid, **GREEDY).token_ids == folder.expected[2]
    finally:
        eng.unload()


def test_the_presets_and_their_bytes_per_session() -> None:
    eng = Engine.load("random:tiny-qwen3.5", device="cpu", max_sessions=2, max_context=256)
    try:
        assert isinstance(eng.model, Qwen3_5)
        # K, V: 1 full layer x 2 kv heads x 256 x 32; conv: 3 linear layers x (2*2*16 + 4*16) x 3; recurrent:
        # 3 x 4 x 16 x 16; fp32 each, buffers aligned to 256 bytes.
        assert eng.bytes_per_session == 2 * 65536 + 4608 + 12288
        sid = eng.create_session()
        eng.append(sid, token_ids=list(range(70)))
        assert len(eng.generate(sid, max_tokens=4, ignore_eos=True).token_ids) == 4
    finally:
        eng.unload()
    big = PRESETS["qwen3.5-9b"]
    assert (big.dim, big.n_layers, big.linear and (big.linear.key_heads, big.linear.value_heads, big.linear.key_dim))\
        == (4096, 32, (16, 32, 128))
    assert big.layer_types.count("full_attention") == 8
    spec = state_spec(big, 2048, torch.bfloat16)  # 64 MiB of K/V at 2048 tokens, 1.1 MiB conv, 48 MiB recurrent
    assert {b.name: b.nbytes for b in spec.buffers} == {"k": 32 << 20, "v": 32 << 20, "conv": 1152 << 10,
                                                        "recurrent": 48 << 20}


TEXT_CFG: dict[str, Any] = {"model_type": "qwen3_5_text", **TINY, "layer_types": ["linear_attention", "full_attention"],
                            "num_hidden_layers": 2}


def config_folder(tmp: Path, cfg: dict[str, Any]) -> Path:
    tmp.mkdir(parents=True, exist_ok=True)
    (tmp / "config.json").write_text(json.dumps(cfg))
    (tmp / "model.safetensors").write_bytes(b"")
    Tokenizer.bytes_only()._tok.save(str(tmp / "tokenizer.json"))
    return tmp


@pytest.mark.parametrize(("change", "named"), [
    ({"attn_output_gate": False}, "attn_output_gate=False"),
    ({"attention_bias": True}, "attention_bias=True"),
    ({"mamba_ssm_dtype": "bfloat16"}, "mamba_ssm_dtype='bfloat16'"),
    ({"mlp_only_layers": [1]}, "mlp_only_layers"),
    ({"layer_types": ["linear_attention", "sliding_attention"]}, "layer_types"),
    ({"layer_types": ["linear_attention"]}, "layer_types"),
    ({"linear_num_value_heads": 3}, "linear_num_value_heads=3"),
    ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 2.0}}, "rope_type='yarn'"),
    ({"rope_parameters": {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.3}},
     "partial_rotary_factor=0.3"),
    ({"num_experts": 8}, "num_experts"),
    ({"hidden_act": "gelu"}, "hidden_act='gelu'"),
])
def test_config_fields_that_are_not_implemented_are_refused_by_name(
    tmp_path: Path, change: dict[str, Any], named: str,
) -> None:
    with pytest.raises(ModelLoadError, match=named.replace("[", r"\[").replace("(", r"\(")):
        load_model(str(config_folder(tmp_path, {**TEXT_CFG, **change})))


def test_the_fields_that_change_nothing_of_the_text_model_are_taken(tmp_path: Path) -> None:
    cfg = {**TEXT_CFG, "mtp_num_hidden_layers": 1, "mtp_use_dedicated_embeddings": False, "mamba_ssm_dtype": "float32",
           "attn_output_gate": True, "mlp_only_layers": [], "full_attention_interval": 2,
           "rope_parameters": {"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25,
                               "mrope_section": [11, 11, 10], "mrope_interleaved": True}}
    from worker.model.qwen3_5 import read_hf_config

    config = read_hf_config(cfg, "x", "test")
    assert (config.rotary_dim, config.rope_theta, config.layer_types) == (8, 1e7, ("linear_attention", "full_attention"))
    del cfg["layer_types"]  # from the interval, as transformers derives them
    assert read_hf_config(cfg, "x", "test").layer_types == ("linear_attention", "full_attention")


def test_a_hibernated_session_continues_exactly_from_host_memory_and_from_disk(folder: Folder, tmp_path: Path) -> None:
    """The recurrent and convolution states (the slot's first pages) and the K/V of the full-attention layer go out
    and come back with every bit: a session hibernated to host memory, or to the session store and read back by a
    new engine (a worker restart), continues with transformers' greedy tokens."""
    prompt, want = folder.prompts[2], folder.expected[2]  # 100 tokens: over a 64-token block
    eng = Engine.load(str(folder.path), device="cpu", max_sessions=2, max_context=512, host_cache_bytes=64 << 20,
                      session_store=tmp_path)
    try:
        sid = eng.create_session(owner="alice")
        eng.append(sid, token_ids=prompt)
        got = eng.generate(sid, max_tokens=8, ignore_eos=True).token_ids
        assert eng.hibernate(sid) and eng.residency() == (0, 1, 0)
        got += eng.generate(sid, max_tokens=8, ignore_eos=True).token_ids  # from host memory
        assert eng.hibernate(sid) and eng.persist() == 1  # to disk: the clean stop
    finally:
        eng.table.close()  # the worker stops: its session is in the store, not closed
    again = Engine.load(str(folder.path), device="cpu", max_sessions=2, max_context=512, session_store=tmp_path)
    try:
        assert again.sessions() == [sid] and again.session_owner(sid) == "alice"
        got += again.generate(sid, max_tokens=NEW_TOKENS - 16, ignore_eos=True).token_ids  # from disk
        assert got == want
    finally:
        again.unload()


def test_a_moved_session_continues_exactly_on_another_engine(folder: Folder) -> None:
    """A move's two halves with a hybrid state: the snapshot of a session (its recurrent and convolution states and
    the full-attention layer's K/V) taken into a second engine of the same model, which goes on with transformers'
    greedy tokens; the source keeps the session until it is closed there."""
    prompt, want = folder.prompts[2], folder.expected[2]
    source = Engine.load(str(folder.path), device="cpu", max_sessions=2, max_context=512)
    target = Engine.load(str(folder.path), device="cpu", max_sessions=2, max_context=512)
    try:
        sid = source.create_session(owner="alice")
        source.append(sid, token_ids=prompt)
        got = source.generate(sid, max_tokens=8, ignore_eos=True).token_ids
        snapshot = source.export_session(sid)
        assert snapshot is not None and snapshot.computed == len(prompt) + 7
        assert target.import_session(snapshot, snapshot.digest()) == sid
        assert source.sessions() == [sid] and target.session_owner(sid) == "alice"
        source.close(sid)
        got += target.generate(sid, max_tokens=NEW_TOKENS - 8, ignore_eos=True).token_ids
        assert got == want
    finally:
        source.unload()
        target.unload()
