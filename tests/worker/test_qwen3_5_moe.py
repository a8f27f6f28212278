"""Qwen3.5-MoE (the hybrid layers with a sparse mixture of experts in every layer) against Hugging Face transformers on
a folder transformers itself wrote.

A tiny `qwen3_5_moe_text` config (three DeltaNet layers then full attention; 8 experts, top 3, a shared expert), seeded
random fp32 weights (the norms, dt_bias and A_log random too; a sharp router, so tokens spread over the experts) is
saved by transformers; the engine loads the folder on the CPU and must give transformers' greedy tokens exactly: each
prompt alone, all interleaved in one batch, a session forked mid-generation continuing as its parent; teacher-forced,
transformers' logits bit for bit. The experts stored fused (transformers' in-memory layout) give the same tokens as
stored one by one, and so does the text part of a `qwen3_5_moe` (vision-language) folder. Config fields that would
change the arithmetic and are not implemented are refused by name.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from worker.engine import Engine
from worker.engine.executor import StepRows
from worker.model.config import PRESETS, ModelLoadError
from worker.model.loader import load_model, parameters
from worker.model.qwen3_5 import state_spec
from worker.model.qwen3_5_moe import Qwen3_5Moe, SparseMoe, read_hf_config
from worker.model.tokenizer import Tokenizer

from . import test_qwen3_5
from .test_qwen3_5 import Folder, hybrid_folder

transformers = pytest.importorskip("transformers")

VOCAB = 259  # the bytes-only tokenizer's ids
NEW_TOKENS = 16
PROMPT_LENGTHS = (5, 41, 100, 1)  # within one 64-token block, over it, one token
CHUNK = 256  # the CPU's prefill chunk: every prompt in one piece, as transformers computes it
EXPERTS, TOP_K = 8, 3
TINY: dict[str, Any] = dict(
    vocab_size=VOCAB, hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
    linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=24,
    linear_conv_kernel_dim=4, max_position_embeddings=1024, rms_norm_eps=1e-6, moe_intermediate_size=32,
    shared_expert_intermediate_size=48, num_experts=EXPERTS, num_experts_per_tok=TOP_K,
    initializer_range=0.3,  # sharp attention, DeltaNet inputs and router: positions, states and routing matter
)


one_thread = test_qwen3_5.one_thread  # autouse: the depthwise convolution's OpenMP region is slow on a shared machine


def write_folder(tmp: Path) -> Folder:
    return hybrid_folder(tmp / "qwen3_5_moe", transformers.Qwen3_5MoeTextConfig(**TINY), "Qwen3_5MoeForCausalLM", 36,
                         PROMPT_LENGTHS, NEW_TOKENS)


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Folder:
    return write_folder(tmp_path_factory.mktemp("qwen3_5_moe"))


@pytest.fixture(scope="module")
def engine(folder: Folder) -> Iterator[Engine]:
    eng = Engine.load(str(folder.path), device="cpu", max_sessions=len(folder.prompts) + 2, max_context=256,
                      step_tokens=CHUNK)
    assert isinstance(eng.model, Qwen3_5Moe)
    yield eng
    eng.unload()


GREEDY: dict[str, object] = {"max_tokens": NEW_TOKENS, "ignore_eos": True}


def test_the_folder_is_the_layout_transformers_writes_and_routes_over_every_expert(folder: Folder,
                                                                                    engine: Engine) -> None:
    """transformers 5 writes the experts one by one; the router spreads the prompts' tokens over all of them (so
    every expert's weights are shown to be read where they belong)."""
    with safe_open(str(folder.path / "model.safetensors"), framework="pt") as f:
        names = set(f.keys())  # noqa: SIM118
    assert "model.layers.0.mlp.experts.7.down_proj.weight" in names and "model.layers.0.mlp.gate.weight" in names
    model = engine.model
    assert isinstance(model, Qwen3_5Moe)
    mlp = model.blocks[0].mlp
    assert isinstance(mlp, SparseMoe)
    embedded = model.embed.rows(torch.tensor(folder.prompts[2]))
    ids, weights = mlp.route(mlp.w_route(embedded)[0])
    assert set(ids.flatten().tolist()) == set(range(EXPERTS))
    torch.testing.assert_close(weights.sum(-1), torch.ones(len(folder.prompts[2])))


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
    prompt, expected = folder.prompts[2], folder.expected[2]
    parent = engine.create_session()
    engine.append(parent, token_ids=prompt)
    head = engine.generate(parent, max_tokens=6, ignore_eos=True).token_ids
    child = engine.fork(parent)
    rest: dict[str, object] = {"max_tokens": NEW_TOKENS - 6, "ignore_eos": True}
    tails = engine.generate_many([(child, rest), (parent, rest)])
    assert head + tails[0].token_ids == expected
    assert head + tails[1].token_ids == expected
    engine.close(parent)
    engine.close(child)


def test_a_shared_expert_as_wide_as_the_routed_ones_runs_as_one_more_expert_and_gives_the_same_tokens(
        tmp_path: Path) -> None:
    """The published shape's shared expert is as wide as the routed ones: it is stored after them as one more expert
    (which the GPU kernels run with the routed ones). Alone, interleaved and forked: transformers' tokens."""
    folder = hybrid_folder(tmp_path / "equal", transformers.Qwen3_5MoeTextConfig(
        **{**TINY, "shared_expert_intermediate_size": TINY["moe_intermediate_size"]}), "Qwen3_5MoeForCausalLM", 37,
        PROMPT_LENGTHS, NEW_TOKENS)
    eng = Engine.load(str(folder.path), device="cpu", max_sessions=len(folder.prompts) + 2, max_context=256,
                      step_tokens=CHUNK)
    try:
        mlp = eng.model.blocks[0].mlp  # type: ignore[attr-defined]
        assert isinstance(mlp, SparseMoe) and mlp.shared_in_experts and mlp.gate_up.shape[0] == EXPERTS + 1
        sids = []
        for prompt, expected in zip(folder.prompts, folder.expected, strict=True):
            sid = eng.create_session()
            eng.append(sid, token_ids=prompt)
            assert eng.generate(sid, **GREEDY).token_ids == expected
            eng.close(sid)
            sids.append(eng.create_session())
            eng.append(sids[-1], token_ids=prompt)
        assert [r.token_ids for r in eng.generate_many([(sid, GREEDY) for sid in sids])] == folder.expected
        parent = eng.create_session()
        eng.append(parent, token_ids=folder.prompts[2])
        head = eng.generate(parent, max_tokens=6, ignore_eos=True).token_ids
        child = eng.fork(parent)
        rest: dict[str, object] = {"max_tokens": NEW_TOKENS - 6, "ignore_eos": True}
        assert [head + r.token_ids for r in eng.generate_many([(child, rest), (parent, rest)])] == [folder.expected[2]] * 2
    finally:
        eng.unload()


def teacher_forced(engine: Engine, prompt: list[int], tokens: list[int], chunk: int = CHUNK) -> torch.Tensor:
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
    for prompt, tokens, expected in zip(folder.prompts, folder.expected, folder.logits, strict=True):
        assert torch.equal(teacher_forced(engine, prompt, tokens), expected)


def test_a_prompt_in_other_chunks_moves_only_by_the_cpu_products_rounding(engine: Engine, folder: Folder) -> None:
    """Prefilled in 64-token chunks (transformers computes the prompt whole), each expert takes other groups of rows:
    the CPU's BLAS rounds a product of fewer than 4 rows differently from a longer one (its small-matrix path), so
    the logits move in the last bits only, and the tokens are the same."""
    prompt, tokens, expected = folder.prompts[2], folder.expected[2], folder.logits[2]
    got = teacher_forced(engine, prompt, tokens, 64)
    assert got.argmax(-1).tolist() == tokens
    assert float((got - expected).abs().max()) < 1e-4


def test_the_shared_expert_and_its_gate_count(engine: Engine, folder: Folder) -> None:
    """The shared expert's output moves the logits (its gate is not saturated at zero), and so do the routed ones."""
    model = engine.model
    assert isinstance(model, Qwen3_5Moe)
    mlp = model.blocks[1].mlp
    assert isinstance(mlp, SparseMoe)
    x = model.embed.rows(torch.tensor(folder.prompts[1]))
    gate = torch.sigmoid(mlp.w_route(x)[1])
    assert 0.05 < float(gate.min()) and float(gate.max()) < 0.95
    full = mlp(x)
    saved = mlp.down.clone()
    try:
        mlp.down.zero_()
        routed_off = mlp(x)
    finally:
        mlp.down.copy_(saved)
    assert float((full - routed_off).abs().max()) > 1e-2
    assert float(routed_off.abs().max()) > 1e-2  # what is left: the shared expert's part


def fused_folder(src: Path, dst: Path, prefix: str = "model.") -> None:
    """`src` with each layer's experts stored fused, (experts, 2 * ffn, dim) and (experts, dim, ffn), as transformers
    holds them in memory; the other tensors renamed from `model.` to `prefix`."""
    dst.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json", "config.json"):
        (dst / name).write_text((src / name).read_text())
    with safe_open(str(src / "model.safetensors"), framework="pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118
    out: dict[str, torch.Tensor] = {}
    for i in range(TINY["num_hidden_layers"]):
        p = f"model.layers.{i}.mlp.experts."

        def part(e: int, name: str, p: str = p) -> torch.Tensor:
            return tensors.pop(f"{p}{e}.{name}.weight")

        out[f"{p}gate_up_proj"] = torch.stack([torch.cat([part(e, "gate_proj"), part(e, "up_proj")])
                                               for e in range(EXPERTS)])
        out[f"{p}down_proj"] = torch.stack([part(e, "down_proj") for e in range(EXPERTS)])
    out |= tensors
    save_file({(k.replace("model.", prefix, 1) if k.startswith("model.") else k): v.contiguous()
               for k, v in out.items()}, str(dst / "model.safetensors"))


def test_experts_stored_fused_give_the_same_tokens(tmp_path: Path, folder: Folder) -> None:
    fused = tmp_path / "fused"
    fused_folder(folder.path, fused)
    model = transformers.AutoModelForCausalLM.from_pretrained(fused, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    prompt = folder.prompts[1]
    with torch.no_grad():  # transformers reads the fused layout too, as the same model
        out = model.generate(torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, do_sample=False,
                             attention_mask=torch.ones(1, len(prompt), dtype=torch.long))
    assert out[0, len(prompt):].tolist() == folder.expected[1]
    eng = Engine.load(str(fused), device="cpu", max_sessions=1, max_context=256, step_tokens=CHUNK)
    try:
        sid = eng.create_session()
        eng.append(sid, token_ids=prompt)
        assert eng.generate(sid, **GREEDY).token_ids == folder.expected[1]
    finally:
        eng.unload()


def test_a_qwen3_5_moe_folder_serves_its_text_model(tmp_path: Path, folder: Folder) -> None:
    """The text part of a `qwen3_5_moe` (vision-language) folder: text_config read, model.language_model.* tensors
    taken (here with the experts fused), the vision tower and the multi-token-prediction head left out."""
    text_cfg = json.loads((folder.path / "config.json").read_text())
    vl = tmp_path / "vl"
    fused_folder(folder.path, vl, prefix="model.language_model.")
    cfg = {"model_type": "qwen3_5_moe", "architectures": ["Qwen3_5MoeForConditionalGeneration"],
           "text_config": text_cfg, "vision_config": {"model_type": "qwen3_5_moe_vision", "depth": 2},
           "image_token_id": 248056, "tie_word_embeddings": False}
    (vl / "config.json").write_text(json.dumps(cfg))
    with safe_open(str(vl / "model.safetensors"), framework="pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118
    tensors["model.visual.blocks.0.attn.qkv.weight"] = torch.zeros(3, 3)
    tensors["mtp.layers.0.mlp.experts.0.up_proj.weight"] = torch.zeros(2, 2)
    save_file(tensors, str(vl / "model.safetensors"))
    eng = Engine.load(str(vl), device="cpu", max_sessions=1, max_context=256, step_tokens=CHUNK)
    try:
        sid = eng.create_session()
        eng.append(sid, token_ids=folder.prompts[0])
        assert eng.generate(sid, **GREEDY).token_ids == folder.expected[0]
    finally:
        eng.unload()


def test_the_presets_their_shapes_and_bytes_per_session() -> None:
    eng = Engine.load("random:tiny-qwen3.5-moe", device="cpu", max_sessions=2, max_context=256)
    try:
        assert isinstance(eng.model, Qwen3_5Moe)
        # the same per-session state as the dense tiny Qwen3.5 (the experts hold none)
        assert eng.bytes_per_session == 2 * 65536 + 4608 + 12288
        sid = eng.create_session()
        eng.append(sid, token_ids=list(range(70)))
        assert len(eng.generate(sid, max_tokens=4, ignore_eos=True).token_ids) == 4
    finally:
        eng.unload()
    big = PRESETS["qwen3.5-35b-a3b"]
    ex = big.experts
    assert ex is not None and (ex.count, ex.top_k, ex.ffn_dim, ex.shared_ffn_dim) == (256, 8, 512, 512)
    assert (big.dim, big.n_layers, big.n_kv_heads, big.head_dim, big.rope_theta) == (2048, 40, 2, 256, 1e7)
    assert big.layer_types.count("full_attention") == 10
    assert 34.5e9 < parameters(big) < 35e9  # "35B": every expert counted
    spec = state_spec(big, 2048, torch.bfloat16)  # K/V of 10 layers at 2048 tokens, 30 DeltaNet layers' states
    assert {b.name: b.nbytes for b in spec.buffers} == {"k": 20 << 20, "v": 20 << 20, "conv": 1440 << 10,
                                                        "recurrent": 60 << 20}


def test_the_config_is_read_as_transformers_fills_it() -> None:
    """Defaults are Qwen3_5MoeTextConfig's; the published config's extra fields (an unused intermediate_size, the
    multi-token-prediction head, the router's training settings, multimodal RoPE sections) change nothing."""
    defaults = transformers.Qwen3_5MoeTextConfig()
    config = read_hf_config({"model_type": "qwen3_5_moe_text"}, "x", "test")
    ex = config.experts
    assert ex is not None
    assert (config.dim, config.n_layers, config.n_heads, config.n_kv_heads, config.head_dim, config.vocab_size) == (
        defaults.hidden_size, defaults.num_hidden_layers, defaults.num_attention_heads, defaults.num_key_value_heads,
        defaults.head_dim, defaults.vocab_size)
    assert (ex.count, ex.top_k, ex.ffn_dim, ex.shared_ffn_dim) == (
        defaults.num_experts, defaults.num_experts_per_tok, defaults.moe_intermediate_size,
        defaults.shared_expert_intermediate_size)
    assert list(config.layer_types) == defaults.layer_types
    published = {"model_type": "qwen3_5_moe_text", "intermediate_size": 512, "mtp_num_hidden_layers": 1,
                 "output_router_logits": False, "router_aux_loss_coef": 0.001, "norm_topk_prob": True,
                 "decoder_sparse_step": 1, "mlp_only_layers": [], "max_position_embeddings": 262144,
                 "rope_parameters": {"mrope_interleaved": True, "mrope_section": [11, 11, 10],
                                     "partial_rotary_factor": 0.25, "rope_theta": 10000000, "rope_type": "default"}}
    read = read_hf_config(published, "x", "test")
    assert dataclasses_equal(read, PRESETS["qwen3.5-35b-a3b"])


def dataclasses_equal(a: Any, b: Any) -> bool:
    import dataclasses

    return dataclasses.replace(a, name="") == dataclasses.replace(b, name="")


MOE_CFG: dict[str, Any] = {"model_type": "qwen3_5_moe_text", **TINY,
                           "layer_types": ["linear_attention", "full_attention"], "num_hidden_layers": 2}


@pytest.mark.parametrize(("change", "named"), [
    ({"norm_topk_prob": False}, "norm_topk_prob=False"),
    ({"decoder_sparse_step": 2}, "decoder_sparse_step=2"),
    ({"mlp_only_layers": [1]}, "mlp_only_layers"),
    ({"num_experts_per_tok": 9}, "num_experts_per_tok=9"),
    ({"moe_intermediate_size": 0}, "moe_intermediate_size"),
    ({"attention_bias": True}, "attention_bias=True"),
    ({"hidden_act": "gelu"}, "hidden_act='gelu'"),
    ({"router_jitter_noise": 0.1}, "router_jitter_noise"),
    ({"first_k_dense_replace": 1}, "first_k_dense_replace"),
])
def test_config_fields_that_are_not_implemented_are_refused_by_name(
    tmp_path: Path, change: dict[str, Any], named: str,
) -> None:
    tmp_path.mkdir(parents=True, exist_ok=True)
    (tmp_path / "config.json").write_text(json.dumps({**MOE_CFG, **change}))
    (tmp_path / "model.safetensors").write_bytes(b"")
    Tokenizer.bytes_only()._tok.save(str(tmp_path / "tokenizer.json"))
    with pytest.raises(ModelLoadError, match=named.replace("[", r"\[")):
        load_model(str(tmp_path))


def test_missing_and_misshapen_expert_tensors_are_refused(tmp_path: Path, folder: Folder) -> None:
    for broken, why in (("missing", "tensors missing"), ("shape", "has shape")):
        dst = tmp_path / broken
        dst.mkdir()
        for name in ("tokenizer.json", "tokenizer_config.json", "config.json"):
            (dst / name).write_text((folder.path / name).read_text())
        with safe_open(str(folder.path / "model.safetensors"), framework="pt") as f:
            tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118
        name = "model.layers.2.mlp.experts.5.up_proj.weight"
        if broken == "missing":
            del tensors[name]
        else:
            tensors[name] = tensors[name][:, :-1].contiguous()
        save_file(tensors, str(dst / "model.safetensors"))
        with pytest.raises(ModelLoadError, match=why):
            Engine.load(str(dst), device="cpu", max_sessions=1, max_context=64)
