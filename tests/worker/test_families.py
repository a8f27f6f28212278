"""Every supported model family against Hugging Face transformers, on folders transformers itself wrote.

For each family a tiny config with seeded random fp32 weights is saved by transformers (config.json and
safetensors, as a user's folder would be); the engine loads that folder on the CPU and must give exactly
transformers' greedy tokens: each prompt alone, all prompts interleaved in one batch, and a session forked in the
middle of its generation continuing exactly as its parent. One prompt is longer than the CPU's prefill chunk
(256 tokens), so prompts are computed in several chunks. Config fields that would change the arithmetic and are
not implemented are refused by name.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

from worker.engine import Engine
from worker.model.config import ModelLoadError
from worker.model.loader import load_model
from worker.model.tokenizer import Tokenizer

transformers = pytest.importorskip("transformers")

VOCAB = 259  # the bytes-only tokenizer's 256 bytes and 3 specials: every id the model can make decodes
NEW_TOKENS = 24
PROMPT_LENGTHS = (5, 41, 300)  # 300 > the CPU prefill chunk of 256
TINY: dict[str, Any] = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                            rms_norm_eps=1e-6, initializer_range=0.3)  # sharp attention: positions matter

# name -> (transformers config class, its arguments beyond TINY)
FAMILIES: dict[str, tuple[str, dict[str, Any]]] = {
    "llama": ("LlamaConfig", {}),
    "llama3": ("LlamaConfig", {"rope_parameters": {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0,
                                                   "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                                   "original_max_position_embeddings": 64}}),
    "llama-linear": ("LlamaConfig", {"rope_parameters": {"rope_type": "linear", "rope_theta": 10000.0,
                                                         "factor": 2.0}}),
    "llama-dynamic": ("LlamaConfig", {"rope_parameters": {"rope_type": "dynamic", "rope_theta": 10000.0,
                                                          "factor": 2.0}}),
    "llama-yarn": ("LlamaConfig", {"rope_parameters": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                                       "original_max_position_embeddings": 256}}),
    "mistral": ("MistralConfig", {"sliding_window": None, "head_dim": 32}),
    "qwen2": ("Qwen2Config", {}),
    "qwen3": ("Qwen3Config", {"head_dim": 32}),
}


@dataclass
class Folder:
    path: Path
    expected: list[list[int]]  # transformers' greedy continuation of each prompt
    prompts: list[list[int]]


def write_folder(tmp: Path, family: str) -> Folder:
    """A folder transformers wrote (seeded random fp32 weights), its greedy continuations of PROMPT_LENGTHS prompts."""
    cls_name, extra = FAMILIES[family]
    config = getattr(transformers, cls_name)(**{**TINY, **extra})
    torch.manual_seed(sum(map(ord, family)))
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():  # transformers initialises norms to ones and biases to zeros: random ones show they are read
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.2 * torch.randn_like(p))
            elif name.endswith(".bias"):
                p.copy_(0.3 * torch.randn_like(p))
    path = tmp / family
    model.save_pretrained(path)
    Tokenizer.bytes_only()._tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|im_end|>"}))
    rng = random.Random(len(family))
    prompts = [[rng.randrange(VOCAB) for _ in range(n)] for n in PROMPT_LENGTHS]
    model.generation_config.eos_token_id = None  # never stop early: the engine ignores EOS here too
    model.generation_config.pad_token_id = 0
    expected = []
    with torch.no_grad():
        for prompt in prompts:
            out = model.generate(torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, do_sample=False,
                                 attention_mask=torch.ones(1, len(prompt), dtype=torch.long))
            expected.append(out[0, len(prompt):].tolist())
    return Folder(path, expected, prompts)


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def folder(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Folder:
    return write_folder(tmp_path_factory.mktemp("families"), request.param)


@pytest.fixture(scope="module")
def engine(folder: Folder) -> Iterator[Engine]:
    eng = Engine.load(str(folder.path), device="cpu", max_sessions=len(folder.prompts) + 2, max_context=512)
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
    prompt, expected = folder.prompts[1], folder.expected[1]
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


# -- refusals ------------------------------------------------------------------------------------------------


def config_folder(tmp: Path, cfg: dict[str, Any]) -> Path:
    """A folder whose config.json is `cfg` (weights are not reached: the config is refused first)."""
    tmp.mkdir(parents=True, exist_ok=True)
    (tmp / "config.json").write_text(json.dumps(cfg))
    (tmp / "model.safetensors").write_bytes(b"")
    Tokenizer.bytes_only()._tok.save(str(tmp / "tokenizer.json"))
    return tmp


LLAMA_CFG: dict[str, Any] = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
                             "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": VOCAB,
                             "rms_norm_eps": 1e-6, "max_position_embeddings": 1024, "hidden_act": "silu"}


@pytest.mark.parametrize(("change", "named"), [
    ({"attention_bias": True}, "attention_bias=True"),
    ({"mlp_bias": True}, "mlp_bias=True"),
    ({"hidden_act": "gelu"}, "hidden_act='gelu'"),
    ({"rope_parameters": {"rope_type": "longrope", "rope_theta": 1e4}}, "rope_type='longrope'"),
    ({"rope_scaling": {"type": "linear"}}, "rope factor=None"),
    ({"rope_scaling": {"type": "yarn", "original_max_position_embeddings": 256}}, "rope factor=None"),  # as transformers
    ({"rope_scaling": {"type": "llama3", "factor": 8.0, "low_freq_factor": 1.0}}, "high_freq_factor=None"),
    ({"rope_parameters": {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5}},
     "partial_rotary_factor=0.5"),
    ({"quantization_config": {"quant_method": "gptq"}}, "quantization_config"),
    ({"model_type": "gemma"}, "model_type 'gemma' is not supported"),
    ({"model_type": "qwen3", "attention_bias": True}, "attention_bias=True"),
    ({"layer_types": ["full_attention", "chunked_attention"]}, "layer_types"),
])
def test_config_fields_that_are_not_implemented_are_refused_by_name(
    tmp_path: Path, change: dict[str, Any], named: str,
) -> None:
    with pytest.raises(ModelLoadError, match=named.replace("[", r"\[").replace("(", r"\(")):
        load_model(str(config_folder(tmp_path, {**LLAMA_CFG, **change})))


def test_a_sliding_window_caps_the_context_and_the_scaled_rope_types_change_the_frequencies(tmp_path: Path) -> None:
    from worker.model.hf_config import read_common
    from worker.model.rope import inv_freq

    mistral = read_common({**LLAMA_CFG, "sliding_window": 300}, "m", "llama", "test")
    assert mistral["context_length"] == 300  # full attention equals a window of 300 up to 300 tokens
    qwen = read_common({**LLAMA_CFG, "sliding_window": 300, "use_sliding_window": False}, "q", "qwen2", "test")
    assert qwen["context_length"] == 1024
    from worker.model.config import ModelConfig

    plain = ModelConfig(**read_common(LLAMA_CFG, "p", "llama", "test"))
    base, _ = inv_freq(plain)
    for params in FAMILIES["llama3"][1]["rope_parameters"], FAMILIES["llama-yarn"][1]["rope_parameters"]:
        scaled = ModelConfig(**read_common({**LLAMA_CFG, "rope_parameters": params}, "s", "llama", "test"))
        freq, _ = inv_freq(scaled)
        assert not torch.equal(freq, base) and freq.shape == base.shape
