"""Model files as users have them, read as transformers and llama.cpp read them: which config field wins where two
say the same thing, and every malformed folder or GGUF file refused with a ModelLoadError naming the problem (never
another exception, never served with weights cast or arithmetic left out)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from worker.engine import Engine
from worker.errors import BadRequest
from worker.model.config import ModelLoadError
from worker.model.hf_config import read_common, read_rope
from worker.model.loader import load_model
from worker.model.qwen3_5 import text_config
from worker.model.tokenizer import Tokenizer

from .test_families import LLAMA_CFG, NEW_TOKENS, VOCAB, config_folder, write_folder


def test_rope_scaling_wins_over_rope_parameters_as_in_transformers() -> None:
    both = {**LLAMA_CFG, "rope_parameters": {"rope_type": "default", "rope_theta": 1e4},
            "rope_scaling": {"rope_type": "linear", "factor": 4.0}}
    assert (read_rope(both, "test").kind, read_rope(both, "test").factor) == ("linear", 4.0)


@pytest.mark.parametrize("kind", [{"rope_type": "yarn", "factor": 4.0},
                                  {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0}])
def test_original_max_position_embeddings_defaults_to_max_position_embeddings_as_in_transformers(
    kind: dict[str, Any],
) -> None:
    """transformers' standardize_rope_params fills it in (a folder without it gave transformers' greedy tokens
    exactly); without max_position_embeddings either (whose default is the family's) it is refused."""
    given = read_rope({**LLAMA_CFG, "rope_parameters": {**kind, "original_max_position_embeddings": 1024}}, "t")
    assert read_rope({**LLAMA_CFG, "rope_parameters": kind}, "t") == given
    assert given.original_context == LLAMA_CFG["max_position_embeddings"] == 1024
    without = {k: v for k, v in LLAMA_CFG.items() if k != "max_position_embeddings"}
    with pytest.raises(ModelLoadError, match="original_max_position_embeddings=None"):
        read_rope({**without, "rope_parameters": kind}, "t")


def test_a_qwen3_head_is_128_wide_when_head_dim_is_absent_as_in_transformers() -> None:
    """(A folder transformers wrote with head_dim 128 over hidden 64 / 4 heads, head_dim then left out of its
    config.json, was refused for its tensors' shapes; it gives transformers' greedy tokens now.)"""
    from worker.model import qwen3

    qwen = {**LLAMA_CFG, "model_type": "qwen3"}
    assert qwen3.read_hf_config(qwen, "q", "t").head_dim == 128
    assert qwen3.read_hf_config({**qwen, "head_dim": 16}, "q", "t").head_dim == 16


@pytest.mark.parametrize("change", [{"pretraining_tp": 2}, {"hidden_act": "swish"}])
def test_fields_transformers_reads_to_the_same_arithmetic_are_taken(change: dict[str, Any]) -> None:
    """(Each was refused; a folder transformers wrote, the field then set, gives transformers' greedy tokens.)"""
    from worker.model import llama

    assert llama.read_hf_config({**LLAMA_CFG, **change}, "l", "t") == llama.read_hf_config(LLAMA_CFG, "l", "t")


def test_mistral_slides_by_its_window_whatever_the_other_fields_say() -> None:
    mistral = {**LLAMA_CFG, "model_type": "mistral", "max_position_embeddings": 8192}
    assert read_common(mistral, "m", "llama", "t")["context_length"] == 4096  # transformers' default window
    for change in ({"sliding_window": 64, "use_sliding_window": False},
                   {"sliding_window": 64, "layer_types": ["full_attention"] * 2}):
        assert read_common({**mistral, **change}, "m", "llama", "t")["context_length"] == 64
    assert read_common({**mistral, "sliding_window": None}, "m", "llama", "t")["context_length"] == 8192


@pytest.mark.parametrize("model_type", ["qwen2", "qwen3"])
def test_qwen_slides_by_transformers_default_window_where_use_sliding_window_says(model_type: str) -> None:
    """transformers' Qwen2 and Qwen3 slide by 4096 keys when use_sliding_window is on and sliding_window absent (a
    4150-token prompt gave other tokens than full attention), and not at all when use_sliding_window is absent."""
    qwen = {**LLAMA_CFG, "model_type": model_type, "max_position_embeddings": 32768}

    def context(change: dict[str, Any]) -> int:
        return int(read_common({**qwen, **change}, "q", model_type, "t")["context_length"])

    assert context({"use_sliding_window": True}) == 4096
    assert context({"use_sliding_window": True, "sliding_window": 64}) == 64
    assert context({"use_sliding_window": True, "sliding_window": None}) == 32768
    assert context({"sliding_window": 64}) == 32768  # use_sliding_window is false when absent
    assert context({}) == 32768
    assert context({"sliding_window": 64, "layer_types": ["full_attention", "sliding_attention"]}) == 64


@pytest.mark.parametrize(("top", "text", "tied"), [(False, True, False), (True, False, True), (None, True, False)])
def test_a_vision_language_folder_ties_its_head_by_its_own_field(top: bool | None, text: bool, tied: bool) -> None:
    cfg: dict[str, Any] = {"model_type": "qwen3_5", "text_config": {"tie_word_embeddings": text}}
    if top is not None:
        cfg["tie_word_embeddings"] = top
    assert text_config(cfg, "qwen3_5", "t")[0]["tie_word_embeddings"] is tied


@pytest.mark.parametrize(("change", "named"), [
    ({"num_attention_heads": 0}, "num_attention_heads must be a positive integer, got 0"),
    ({"hidden_size": "abc"}, "hidden_size must be a positive integer, got 'abc'"),
    ({"vocab_size": None}, "vocab_size must be a positive integer, got None"),
    ({"max_position_embeddings": 0}, "max_position_embeddings must be a positive integer"),
    ({"tie_word_embeddings": "false"}, "tie_word_embeddings='false'"),
    ({"rms_norm_eps": "x"}, "malformed model (ValueError"),
    ({"layer_types": 5}, "malformed model (TypeError"),
    ({"model_type": "qwen3_5_text", "linear_num_key_heads": 0}, "malformed model (ZeroDivisionError"),
])
def test_malformed_config_fields_are_refused_by_name(tmp_path: Path, change: dict[str, Any], named: str) -> None:
    with pytest.raises(ModelLoadError, match=named.replace("(", r"\(")):
        load_model(str(config_folder(tmp_path, {**LLAMA_CFG, **change})))


def weights_folder(tmp: Path, dtype: torch.dtype = torch.float32, truncate: bool = False) -> Path:
    """A one-layer Llama folder of LLAMA_CFG's shapes, its q_proj stored as `dtype`, its file cut in half or not."""
    cfg = {**LLAMA_CFG, "num_hidden_layers": 1}
    config_folder(tmp, cfg)
    (tmp / "generation_config.json").write_text(json.dumps({"eos_token_id": VOCAB - 1}))
    d, f, kv = 64, 128, 32
    shapes = {"model.embed_tokens.weight": (VOCAB, d), "model.norm.weight": (d,), "lm_head.weight": (VOCAB, d),
              "model.layers.0.input_layernorm.weight": (d,), "model.layers.0.post_attention_layernorm.weight": (d,),
              "model.layers.0.self_attn.q_proj.weight": (d, d), "model.layers.0.self_attn.k_proj.weight": (kv, d),
              "model.layers.0.self_attn.v_proj.weight": (kv, d), "model.layers.0.self_attn.o_proj.weight": (d, d),
              "model.layers.0.mlp.gate_proj.weight": (f, d), "model.layers.0.mlp.up_proj.weight": (f, d),
              "model.layers.0.mlp.down_proj.weight": (d, f)}
    tensors = {name: torch.randn(shape) * 0.1 for name, shape in shapes.items()}
    tensors["model.layers.0.self_attn.q_proj.weight"] = tensors["model.layers.0.self_attn.q_proj.weight"].to(dtype)
    path = tmp / "model.safetensors"
    save_file(tensors, str(path))
    if truncate:
        path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    return tmp


def test_a_head_stored_apart_from_an_embedding_said_tied_is_served_as_transformers_serves_it(tmp_path: Path) -> None:
    """transformers ties the head to the embedding only where the stored head equals it; a different one stored is
    the head it serves (the product served the embedding: other tokens)."""
    import transformers

    folder = write_folder(tmp_path, "llama")  # its head stored apart from the embedding
    cfg = json.loads((folder.path / "config.json").read_text())
    (folder.path / "config.json").write_text(json.dumps({**cfg, "tie_word_embeddings": True}))
    model = transformers.AutoModelForCausalLM.from_pretrained(folder.path, dtype=torch.float32).eval()
    prompt = folder.prompts[1]
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=None,
                             pad_token_id=0, attention_mask=torch.ones(1, len(prompt), dtype=torch.long))
    expected = out[0, len(prompt):].tolist()
    assert expected == folder.expected[1]  # the head stored, as before the change
    eng = Engine.load(str(folder.path), device="cpu", max_sessions=1, max_context=256)
    try:
        assert not eng.model.config.tie_embeddings
        sid = eng.create_session()
        eng.append(sid, token_ids=prompt)
        assert eng.generate(sid, max_tokens=NEW_TOKENS, ignore_eos=True).token_ids == expected
    finally:
        eng.unload()
    weights = load_safetensors(folder.path / "model.safetensors")  # the head stored equal to the embedding: tied
    save_file({**weights, "lm_head.weight": weights["model.embed_tokens.weight"].clone()},
              str(folder.path / "model.safetensors"))
    assert load_model(str(folder.path)).config.tie_embeddings


def test_weights_that_are_not_floating_point_or_a_truncated_file_are_refused(tmp_path: Path) -> None:
    Engine.load(str(weights_folder(tmp_path / "ok")), device="cpu", max_sessions=1, max_context=64).unload()
    for i, dtype in enumerate((torch.int32, torch.bool, torch.float8_e4m3fn)):
        with pytest.raises(ModelLoadError, match=f"layers.0.q_proj is {dtype}: weights are floating point"):
            Engine.load(str(weights_folder(tmp_path / str(i), dtype)), device="cpu", max_sessions=1, max_context=64)
    with pytest.raises(ModelLoadError, match="malformed model \\(SafetensorError"):
        Engine.load(str(weights_folder(tmp_path / "cut", truncate=True)), device="cpu", max_sessions=1, max_context=64)
    (tmp_path / "ok" / "config.json").write_text("[1, 2]")
    with pytest.raises(ModelLoadError, match="config.json: not a JSON object"):
        load_model(str(tmp_path / "ok"))


def test_a_text_past_the_models_vocabulary_is_a_bad_request(tmp_path: Path) -> None:
    folder = weights_folder(tmp_path)
    cfg = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**cfg, "vocab_size": 200}))
    save_file({k: v[:200] if k in ("model.embed_tokens.weight", "lm_head.weight") else v for k, v in
               load_safetensors(folder / "model.safetensors").items()}, str(folder / "model.safetensors"))
    engine = Engine.load(str(folder), device="cpu", max_sessions=1, max_context=64)
    sid = engine.create_session()
    with pytest.raises(BadRequest, match="encodes to token id 239, past the model's vocabulary of 200"):
        engine.append(sid, text="\uffff")  # three bytes, 0xef first: id 239 of the bytes-only tokenizer
    assert engine.session_length(sid) == 0
    engine.unload()


def load_safetensors(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(path))


def gguf_file(path: Path, extra_tensors: tuple[str, ...] = (), rope_dims: int | None = None, experts: int = 0) -> Path:
    """A one-layer Llama GGUF (byte-level tokenizer) with whatever llama.cpp would read beyond what is implemented."""
    from gguf import GGUFWriter

    d, f, heads, kv_heads = 64, 128, 4, 2
    writer = GGUFWriter(str(path), "llama")
    for key, value in {"context_length": 256, "embedding_length": d, "block_count": 1, "feed_forward_length": f,
                       "attention.head_count": heads, "attention.head_count_kv": kv_heads}.items():
        writer.add_uint32(f"llama.{key}", value)
    writer.add_float32("llama.attention.layer_norm_rms_epsilon", 1e-5)
    if rope_dims is not None:
        writer.add_uint32("llama.rope.dimension_count", rope_dims)
    if experts:
        writer.add_uint32("llama.expert_count", experts)
    tokenizer = Tokenizer.bytes_only()
    writer.add_string("tokenizer.ggml.model", "gpt2")
    vocab = [t for t, _ in sorted(tokenizer._tok.get_vocab().items(), key=lambda item: item[1])] + ["ab"]
    writer.add_token_list(vocab)
    writer.add_token_merges(["a b"])
    writer.add_eos_token_id(VOCAB - 1)
    rng = np.random.default_rng(0)
    shapes = {"token_embd.weight": (len(vocab), d), "output_norm.weight": (d,), "blk.0.attn_norm.weight": (d,),
              "blk.0.attn_q.weight": (d, d), "blk.0.attn_k.weight": (kv_heads * 16, d),
              "blk.0.attn_v.weight": (kv_heads * 16, d), "blk.0.attn_output.weight": (d, d),
              "blk.0.ffn_norm.weight": (d,), "blk.0.ffn_gate.weight": (f, d), "blk.0.ffn_up.weight": (f, d),
              "blk.0.ffn_down.weight": (d, f)}
    for name in extra_tensors:
        shapes[name] = (d,)
    for name, shape in shapes.items():
        writer.add_tensor(name, (rng.standard_normal(shape) * 0.1).astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_a_gguf_file_with_arithmetic_not_implemented_is_refused(tmp_path: Path) -> None:
    assert load_model(str(gguf_file(tmp_path / "ok.gguf", rope_dims=16))).config.n_layers == 1
    for kwargs, named in (({"extra_tensors": ("blk.0.attn_q.bias",)}, "tensors not part of a Llama as implemented: "
                                                                        "blk.0.attn_q.bias"),
                          ({"rope_dims": 8}, "rope.dimension_count 8 is not implemented"),
                          ({"experts": 4}, "expert_count 4 is not implemented")):
        with pytest.raises(ModelLoadError, match=named):
            load_model(str(gguf_file(tmp_path / "bad.gguf", **kwargs)))


def _tokenizer_folder(folder: Path, single: str | None) -> Path:
    """A byte-level tokenizer as transformers writes it, whose post-processor makes a text `single` (None: none)."""
    from tokenizers import AddedToken, processors
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer.bytes_only()._tok
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in ("<|begin_of_text|>", "<|eot|>")])
    specials = [(t, tok.token_to_id(t)) for t in ("<|begin_of_text|>", "<|eot|>")]
    tok.post_processor = None if single is None else processors.TemplateProcessing(single=single, special_tokens=specials)
    PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|begin_of_text|>", eos_token="<|eot|>").save_pretrained(
        folder)
    return folder


@pytest.mark.parametrize("single", ["<|begin_of_text|> $A", "$A", None])
def test_a_text_prompt_starts_with_the_bos_where_transformers_puts_one(tmp_path: Path, single: str | None) -> None:
    """Llama 3's folders start a text with <|begin_of_text|> from tokenizer.json's post-processor (its
    tokenizer_config.json has no add_bos_token, and transformers writes none): the prompt's tokens are transformers'."""
    from transformers import AutoTokenizer

    folder = _tokenizer_folder(tmp_path, single)
    theirs, ours = AutoTokenizer.from_pretrained(folder), Tokenizer.from_hf_folder(folder)
    for text in ("The capital of France is", "<|eot|> x", "é"):
        assert ours.encode(text) == theirs(text)["input_ids"]
    assert (ours.encode("a")[0] == 259) is (single is not None and "begin" in single)  # 259: <|begin_of_text|>
    assert ours.apply_chat_template([{"role": "user", "content": "a"}], tokenize=True)[0] != 259  # the template's own


def test_a_post_processor_that_adds_other_tokens_is_refused(tmp_path: Path) -> None:
    folder = _tokenizer_folder(tmp_path, "$A <|eot|>")
    with pytest.raises(ValueError, match=r"post-processor turns \[97\] into \[97, 260\]; only a BOS token before a text"):
        Tokenizer.from_hf_folder(folder)
