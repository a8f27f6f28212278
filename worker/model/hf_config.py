"""Reading a Hugging Face config.json into a ModelConfig: the fields every family shares, and the refusal of any
field this project does not implement.

A field is either implemented (read here or by the family's module), known not to change the arithmetic of
inference (METADATA), or refused with a ModelLoadError naming it. Unknown fields are refused too unless they are
null: a config this reader does not understand is never served with silently different numbers.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from typing import Any

from worker.model.config import ROPE_KINDS, ModelLoadError, RopeScaling

# Fields that do not change what a forward pass computes (training settings, ids, bookkeeping).
METADATA = frozenset({
    "_name_or_path", "architectures", "model_type", "transformers_version", "torch_dtype", "dtype", "use_cache",
    "bos_token_id", "eos_token_id", "pad_token_id", "initializer_range", "attention_dropout", "output_attentions",
    "output_hidden_states", "return_dict", "use_return_dict", "id2label", "label2id", "torchscript", "is_decoder",
    "tokenizer_class", "max_window_layers", "pretraining_tp_comment", "problem_type", "chunk_size_feed_forward",
    "add_cross_attention", "tie_encoder_decoder", "is_encoder_decoder", "prefix", "task_specific_params",
})
# Read by read_common (or by ModelConfig's callers), for every family.
COMMON = frozenset({
    "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
    "intermediate_size", "rms_norm_eps", "rope_theta", "rope_scaling", "rope_parameters", "max_position_embeddings",
    "tie_word_embeddings", "hidden_act", "head_dim", "sliding_window", "use_sliding_window", "layer_types",
})


# model_types whose transformers config has use_sliding_window and a sliding_window of its own default.
QWEN_WINDOWED = frozenset({"qwen2", "qwen3"})


def refuse_unknown(cfg: Mapping[str, Any], family_fields: Collection[str], where: str) -> None:
    """Refuse any field neither metadata, common, nor read by the family (null ones are let through)."""
    unknown = sorted(k for k, v in cfg.items() if k not in METADATA | COMMON | set(family_fields) and v is not None)
    if unknown:
        raise ModelLoadError(f"{where}: config fields not implemented here: {', '.join(unknown)}")


def refuse(where: str, field: str, value: Any, why: str) -> ModelLoadError:
    return ModelLoadError(f"{where}: config field {field}={value!r} is not implemented ({why})")


def read_common(cfg: Mapping[str, Any], name: str, family: str, where: str, partial_rotary: bool = False,
                rope_no_ops: Collection[str] = ()) -> dict[str, Any]:
    """The ModelConfig fields every family reads the same way, checked; the family adds its own and builds it.
    `partial_rotary`, `rope_no_ops`: see read_rope."""
    act = cfg.get("hidden_act", "silu")
    if act not in ("silu", "swish"):  # transformers' "swish" is SiLU too
        raise refuse(where, "hidden_act", act, "only silu")
    def size(field: str, default: int | None = None) -> int:
        return _positive_int(cfg.get(field, default), field, where)

    n_heads = size("num_attention_heads")
    dim = size("hidden_size")
    head_dim = cfg.get("head_dim")
    context = min(size("max_position_embeddings", 2048), _sliding_limit(cfg, where))
    tie = cfg.get("tie_word_embeddings", False)
    if not isinstance(tie, bool):
        raise refuse(where, "tie_word_embeddings", tie, "true or false")
    return dict(
        name=name,
        family=family,
        vocab_size=size("vocab_size"),
        dim=dim,
        n_layers=size("num_hidden_layers"),
        n_heads=n_heads,
        n_kv_heads=size("num_key_value_heads", n_heads) if cfg.get("num_key_value_heads") is not None else n_heads,
        ffn_dim=size("intermediate_size"),
        norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        rope_theta=float(rope_params(cfg).get("rope_theta", cfg.get("rope_theta", 10000.0))),
        context_length=context,
        tie_embeddings=tie,
        explicit_head_dim=None if head_dim is None or _positive_int(head_dim, "head_dim", where) == dim // n_heads
        else int(head_dim),
        rope_scaling=read_rope(cfg, where, partial_rotary, rope_no_ops),
    )


def _positive_int(value: Any, field: str, where: str) -> int:
    """A size field: a positive integer (a JSON number without a fraction), or a ModelLoadError naming it."""
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if type(value) is not int or value <= 0:
        raise ModelLoadError(f"{where}: config field {field} must be a positive integer, got {value!r}")
    return value


def rope_params(cfg: Mapping[str, Any]) -> dict[str, Any]:
    """transformers 5's `rope_parameters`, or the older `rope_scaling` (with `rope_theta` beside it), which wins when
    a config has both (transformers' convert_rope_params_to_dict)."""
    params = cfg.get("rope_scaling") or cfg.get("rope_parameters") or {}  # both: rope_scaling, as transformers takes
    if not isinstance(params, dict):
        raise ModelLoadError(f"rope_parameters must be a mapping, got {params!r}")
    return params


def read_rope(cfg: Mapping[str, Any], where: str, partial_rotary: bool = False,
              no_ops: Collection[str] = ()) -> RopeScaling:
    """The RoPE scaling. `partial_rotary`: the family reads partial_rotary_factor itself (else only 1.0 is taken);
    `no_ops`: parameters the family knows change nothing of its arithmetic (they are let through)."""
    params = rope_params(cfg)
    kind = params.get("rope_type") or params.get("type") or "default"
    if kind not in ROPE_KINDS:
        raise refuse(where, "rope_type", kind, f"implemented: {', '.join(ROPE_KINDS)}")
    if not partial_rotary and float(params.get("partial_rotary_factor", 1.0)) != 1.0:
        raise refuse(where, "partial_rotary_factor", params["partial_rotary_factor"], "rotary over the whole head only")
    known = {"rope_type", "type", "rope_theta", "partial_rotary_factor", "factor", "original_max_position_embeddings",
             "low_freq_factor", "high_freq_factor", "attention_factor", "beta_fast", "beta_slow", "mscale",
             "mscale_all_dim", "truncate", *no_ops}
    unknown = sorted(k for k, v in params.items() if k not in known and v is not None)
    if unknown:
        raise ModelLoadError(f"{where}: rope parameters not implemented here: {', '.join(unknown)}")
    if kind == "default":
        return RopeScaling()
    # transformers' defaults below come from max_position_embeddings, whose own default is the family's (not known
    # here): they are taken only where the config gives it.
    context = cfg.get("max_position_embeddings")
    original = int(params.get("original_max_position_embeddings") or 0)
    if kind in ("yarn", "llama3") and not original:
        if context is None:
            raise refuse(where, "original_max_position_embeddings", None, f"{kind} needs it or max_position_embeddings")
        original = int(context)  # transformers' standardize_rope_params default
    for field in ("low_freq_factor", "high_freq_factor") if kind == "llama3" else ():
        if params.get(field) is None:  # transformers refuses such a config; no default is taken for it here either
            raise refuse(where, field, None, "llama3 needs it")
    factor = params.get("factor")
    if factor is None:  # transformers refuses such a config (its yarn validation reads the factor as required)
        raise refuse(where, "rope factor", None, f"{kind} needs a factor")
    return RopeScaling(
        kind=kind, factor=float(factor), original_context=original,
        low_freq_factor=float(params.get("low_freq_factor", 1.0)),
        high_freq_factor=float(params.get("high_freq_factor", 4.0)),
        attention_factor=None if params.get("attention_factor") is None else float(params["attention_factor"]),
        beta_fast=float(params.get("beta_fast") or 32.0), beta_slow=float(params.get("beta_slow") or 1.0),
        mscale=None if params.get("mscale") is None else float(params["mscale"]),
        mscale_all_dim=None if params.get("mscale_all_dim") is None else float(params["mscale_all_dim"]),
        truncate=bool(params.get("truncate", True)),
    )


def _sliding_limit(cfg: Mapping[str, Any], where: str) -> int:
    """How far the model may be served with plain causal attention: a sliding window of W keys attends exactly like
    full attention to sequences of up to W tokens, so a worker serves at most W (large number: no window)."""
    if cfg.get("model_type") == "mistral":  # transformers' Mistral slides by sliding_window (4096 when absent) in every
        window = cfg.get("sliding_window", 4096)  # layer, whatever use_sliding_window and layer_types say
        return 1 << 62 if window is None else _positive_int(window, "sliding_window", where)
    if cfg.get("model_type") in QWEN_WINDOWED:  # transformers' Qwen2 and Qwen3 slide by sliding_window (4096 when
        window = cfg.get("sliding_window", 4096)  # absent) where use_sliding_window (false when absent) says so
        uses_window = cfg.get("use_sliding_window", False)
    else:  # elsewhere a window given is taken as meant
        window = cfg.get("sliding_window")
        uses_window = cfg.get("use_sliding_window", window is not None)
    types = cfg.get("layer_types")
    if types is not None:
        bad = sorted({t for t in types if t not in ("full_attention", "sliding_attention")})
        if bad:
            raise refuse(where, "layer_types", bad, "full or sliding attention only")
        uses_window = "sliding_attention" in types
    if not uses_window or window is None:
        return 1 << 62
    return int(window)
