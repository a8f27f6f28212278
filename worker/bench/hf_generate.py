"""transformers' generate on a random model of a preset's shape, for comparison with the engine (worker.bench.engine
runs it in a child process, after the engine has freed the GPU):

    python -m worker.bench.hf_generate --model random:qwen3.5-35b-a3b --batch 16 --prompt-tokens 128 --new-tokens 256

Greedy, EOS ignored, one batch of --batch sequences, a static cache (transformers compiles the forward on first use
of each shape: two warm-up runs stay out of the timing); its own random initialisation in bf16 on the GPU (speed does
not depend on the values). Prints one line `hf-rate: <output tokens/s>`, or `hf-rate: oom` when the model and its
cache do not fit.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import torch

from worker.model.config import ModelConfig
from worker.model.loader import load_model

RESULT = "hf-rate: "


def hf_config(c: ModelConfig) -> Any:
    """transformers' config of our model's family and shape (transformers is optional here: not type-checked)."""
    import transformers

    rope: dict[str, Any] = {"rope_type": c.rope_scaling.kind, "rope_theta": c.rope_theta}
    if c.rope_scaling.kind != "default":
        r = c.rope_scaling
        rope |= {"factor": r.factor, "original_max_position_embeddings": r.original_context,
                 "low_freq_factor": r.low_freq_factor, "high_freq_factor": r.high_freq_factor}
    fields: dict[str, Any] = dict(
        vocab_size=c.vocab_size, hidden_size=c.dim, num_hidden_layers=c.n_layers, num_attention_heads=c.n_heads,
        num_key_value_heads=c.n_kv_heads, rms_norm_eps=c.norm_eps, rope_parameters=rope,
        max_position_embeddings=c.context_length, tie_word_embeddings=c.tie_embeddings, head_dim=c.head_dim,
    )
    if c.linear is not None:  # Qwen3.5: its DeltaNet layers and partial rotary
        rope["partial_rotary_factor"] = c.partial_rotary
        lin = c.linear
        fields |= dict(layer_types=list(c.layer_types), linear_conv_kernel_dim=lin.conv_kernel,
                       linear_key_head_dim=lin.key_dim, linear_value_head_dim=lin.value_dim,
                       linear_num_key_heads=lin.key_heads, linear_num_value_heads=lin.value_heads)
    if c.experts is not None:  # Qwen3.5-MoE
        ex = c.experts
        return transformers.Qwen3_5MoeTextConfig(num_experts=ex.count, num_experts_per_tok=ex.top_k,
                                                 moe_intermediate_size=ex.ffn_dim,
                                                 shared_expert_intermediate_size=ex.shared_ffn_dim, **fields)
    classes = {"llama": "LlamaConfig", "qwen2": "Qwen2Config", "qwen3": "Qwen3Config", "qwen3_5": "Qwen3_5TextConfig"}
    return getattr(transformers, classes[c.family])(intermediate_size=c.ffn_dim, **fields)


def rate(model_name: str, batch: int, prompt_tokens: int, new_tokens: int) -> float:
    from transformers import AutoModelForCausalLM

    c = load_model(model_name).config
    with torch.device("cuda"):
        model: Any = AutoModelForCausalLM.from_config(hf_config(c), dtype=torch.bfloat16)
    model.eval()
    ids = torch.randint(300, c.vocab_size, (batch, prompt_tokens), generator=torch.Generator().manual_seed(0)).cuda()
    kwargs: dict[str, Any] = dict(do_sample=False, cache_implementation="static", pad_token_id=0,
                                  attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                                  min_new_tokens=new_tokens)
    with torch.inference_mode():
        for _ in range(2):
            model.generate(ids, **kwargs)
        torch.cuda.synchronize()
        start = time.perf_counter()
        out: Any = model.generate(ids, **kwargs)
        torch.cuda.synchronize()
    return float((out.shape[1] - prompt_tokens) * batch / (time.perf_counter() - start))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--batch", type=int, required=True)
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=256)
    args = ap.parse_args()
    try:
        value = f"{rate(args.model, args.batch, args.prompt_tokens, args.new_tokens):.1f}"
    except torch.cuda.OutOfMemoryError:
        value = "oom"
    print(RESULT + value, flush=True)


if __name__ == "__main__":
    main()
