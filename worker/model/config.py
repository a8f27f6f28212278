"""The shape of a model: what every family's forward needs to know, read from GGUF metadata or a Hugging Face
config.json (each family's module reads its own config: worker.model.families), or a preset of a known shape.

A field that changes the arithmetic is either here and implemented, or refused by the reader with a
ModelLoadError naming it: never ignored.
"""

from __future__ import annotations

from dataclasses import dataclass, field

ROPE_KINDS = ("default", "linear", "dynamic", "yarn", "llama3")


class ModelLoadError(Exception):
    """The model could not be found, read or served as it is; the message says which file or field and why."""


@dataclass(frozen=True)
class RopeScaling:
    """Rotary position embedding beyond the plain one: transformers' `rope_parameters` / `rope_scaling`.

    kind "default" is plain RoPE; "linear" divides every frequency by `factor`; "dynamic" (NTK) equals the plain
    one up to the model's context length, which is as far as a worker serves it; "yarn" and "llama3" blend the
    frequencies as transformers' modeling_rope_utils does, "yarn" also scaling cos and sin by its attention factor.
    """

    kind: str = "default"
    factor: float = 1.0
    original_context: int = 0  # original_max_position_embeddings (yarn, llama3)
    low_freq_factor: float = 1.0  # llama3
    high_freq_factor: float = 4.0  # llama3
    attention_factor: float | None = None  # yarn: None = from factor (and mscale / mscale_all_dim)
    beta_fast: float = 32.0  # yarn
    beta_slow: float = 1.0  # yarn
    mscale: float | None = None  # yarn
    mscale_all_dim: float | None = None  # yarn
    truncate: bool = True  # yarn


@dataclass(frozen=True)
class LinearAttention:
    """The gated DeltaNet layers of a hybrid model (Qwen3.5's `linear_*` fields): a depthwise causal convolution of
    `conv_kernel` taps over q|k|v, then the gated delta rule with `key_heads` query/key heads of `key_dim` and
    `value_heads` value heads of `value_dim` (each key head serves value_heads / key_heads consecutive value heads).
    """

    conv_kernel: int
    key_heads: int
    value_heads: int
    key_dim: int
    value_dim: int

    @property
    def conv_dim(self) -> int:
        """Channels of the convolution: q, k and v side by side."""
        return 2 * self.key_heads * self.key_dim + self.value_heads * self.value_dim


@dataclass(frozen=True)
class Experts:
    """A sparse mixture-of-experts MLP (Qwen3.5-MoE's): a router picks each token's `top_k` of `count` experts
    (softmax over all of them, the top k renormalised to sum to one), each a SiLU-gated MLP of `ffn_dim`; their
    outputs weighted by the router's weights are added to a shared expert's (an MLP of `shared_ffn_dim`) scaled by
    sigmoid of its own one-output gate."""

    count: int
    top_k: int
    ffn_dim: int
    shared_ffn_dim: int


FULL_ATTENTION = "full_attention"
LINEAR_ATTENTION = "linear_attention"


@dataclass(frozen=True)
class ModelConfig:
    name: str
    vocab_size: int
    dim: int  # hidden size
    n_layers: int
    n_heads: int
    n_kv_heads: int
    ffn_dim: int
    norm_eps: float
    rope_theta: float
    context_length: int  # what the model was trained for; a worker may serve less
    tie_embeddings: bool = True
    family: str = "llama"  # worker.model.families: which module builds the model
    explicit_head_dim: int | None = None  # None: dim // n_heads
    qkv_bias: bool = False  # q, k and v products carry a bias (Qwen2)
    qk_norm: bool = False  # RMSNorm over each head of q and k before RoPE (Qwen3)
    rope_scaling: RopeScaling = field(default_factory=RopeScaling)
    partial_rotary: float = 1.0  # the share of each head RoPE rotates (its first dims); the rest passes as it is
    # Hybrid models (Qwen3.5): each layer's token mixer, FULL_ATTENTION or LINEAR_ATTENTION (empty: all full), the
    # linear layers' shape, and the full attention's output gate (a sigmoid of a second half of q_proj per head).
    layer_types: tuple[str, ...] = ()
    linear: LinearAttention | None = None
    attention_gate: bool = False
    # Every layer's MLP a sparse mixture of experts (Qwen3.5-MoE); None: dense MLPs of ffn_dim.
    experts: Experts | None = None

    @property
    def head_dim(self) -> int:
        return self.explicit_head_dim or self.dim // self.n_heads

    @property
    def rotary_dim(self) -> int:
        """Dims of each head RoPE rotates (transformers: int(head_dim * partial_rotary_factor))."""
        return int(self.head_dim * self.partial_rotary)

    def mixer(self, layer: int) -> str:
        """Layer `layer`'s token mixer: FULL_ATTENTION or LINEAR_ATTENTION."""
        return self.layer_types[layer] if self.layer_types else FULL_ATTENTION


# Known shapes, used with seeded random weights where the real files cannot go (the GPU machine) and in tiny forms
# for fast tests. The real-size ones follow the published config.json of each model.
PRESETS: dict[str, ModelConfig] = {
    "smollm2-135m": ModelConfig(
        name="random-smollm2-135m", vocab_size=49152, dim=576, n_layers=30, n_heads=9, n_kv_heads=3,
        ffn_dim=1536, norm_eps=1e-5, rope_theta=100000.0, context_length=8192,
    ),
    "tiny": ModelConfig(
        name="random-tiny", vocab_size=512, dim=64, n_layers=2, n_heads=4, n_kv_heads=2,
        ffn_dim=128, norm_eps=1e-5, rope_theta=10000.0, context_length=4096,
    ),
    # meta-llama/Llama-3.1-8B
    "llama3-8b": ModelConfig(
        name="random-llama3-8b", vocab_size=128256, dim=4096, n_layers=32, n_heads=32, n_kv_heads=8,
        ffn_dim=14336, norm_eps=1e-5, rope_theta=500000.0, context_length=131072, tie_embeddings=False,
        rope_scaling=RopeScaling("llama3", factor=8.0, original_context=8192, low_freq_factor=1.0,
                                 high_freq_factor=4.0),
    ),
    # Qwen/Qwen2.5-7B
    "qwen2.5-7b": ModelConfig(
        name="random-qwen2.5-7b", vocab_size=152064, dim=3584, n_layers=28, n_heads=28, n_kv_heads=4,
        ffn_dim=18944, norm_eps=1e-6, rope_theta=1000000.0, context_length=131072, tie_embeddings=False,
        family="qwen2", qkv_bias=True,
    ),
    # Qwen/Qwen3-8B
    "qwen3-8b": ModelConfig(
        name="random-qwen3-8b", vocab_size=151936, dim=4096, n_layers=36, n_heads=32, n_kv_heads=8,
        ffn_dim=12288, norm_eps=1e-6, rope_theta=1000000.0, context_length=40960, tie_embeddings=False,
        family="qwen3", explicit_head_dim=128, qk_norm=True,
    ),
    # transformers' Qwen3_5TextConfig defaults (the Qwen3.5-9B shape): 3 gated DeltaNet layers to 1 of gated attention.
    "qwen3.5-9b": ModelConfig(
        name="random-qwen3.5-9b", vocab_size=248320, dim=4096, n_layers=32, n_heads=16, n_kv_heads=4,
        ffn_dim=12288, norm_eps=1e-6, rope_theta=10000.0, context_length=32768, tie_embeddings=False,
        family="qwen3_5", explicit_head_dim=256, qk_norm=True, partial_rotary=0.25,
        layer_types=(LINEAR_ATTENTION, LINEAR_ATTENTION, LINEAR_ATTENTION, FULL_ATTENTION) * 8,
        linear=LinearAttention(conv_kernel=4, key_heads=16, value_heads=32, key_dim=128, value_dim=128),
        attention_gate=True,
    ),
    # Qwen/Qwen3.5-35B-A3B: transformers' Qwen3_5MoeTextConfig defaults (its docstring's checkpoint) with the published
    # config.json's text_config where they differ (rope_theta 1e7, max_position_embeddings 262144): 40 layers, 3
    # gated DeltaNet to 1 gated attention, 256 experts of 512, top 8, a shared expert of 512.
    "qwen3.5-35b-a3b": ModelConfig(
        name="random-qwen3.5-35b-a3b", vocab_size=248320, dim=2048, n_layers=40, n_heads=16, n_kv_heads=2,
        ffn_dim=512, norm_eps=1e-6, rope_theta=10000000.0, context_length=262144, tie_embeddings=False,
        family="qwen3_5_moe", explicit_head_dim=256, qk_norm=True, partial_rotary=0.25,
        layer_types=(LINEAR_ATTENTION, LINEAR_ATTENTION, LINEAR_ATTENTION, FULL_ATTENTION) * 10,
        linear=LinearAttention(conv_kernel=4, key_heads=16, value_heads=32, key_dim=128, value_dim=128),
        attention_gate=True, experts=Experts(count=256, top_k=8, ffn_dim=512, shared_ffn_dim=512),
    ),
    # Tiny forms of each family, for tests.
    "tiny-qwen2": ModelConfig(
        name="random-tiny-qwen2", vocab_size=512, dim=64, n_layers=2, n_heads=4, n_kv_heads=2,
        ffn_dim=128, norm_eps=1e-6, rope_theta=10000.0, context_length=4096, family="qwen2", qkv_bias=True,
    ),
    "tiny-qwen3": ModelConfig(
        name="random-tiny-qwen3", vocab_size=512, dim=64, n_layers=2, n_heads=4, n_kv_heads=2,
        ffn_dim=128, norm_eps=1e-6, rope_theta=10000.0, context_length=4096, family="qwen3",
        explicit_head_dim=32, qk_norm=True,
    ),
    "tiny-qwen3.5": ModelConfig(
        name="random-tiny-qwen3.5", vocab_size=512, dim=64, n_layers=4, n_heads=4, n_kv_heads=2,
        ffn_dim=128, norm_eps=1e-6, rope_theta=10000.0, context_length=4096, tie_embeddings=False,
        family="qwen3_5", explicit_head_dim=32, qk_norm=True, partial_rotary=0.25,
        layer_types=(LINEAR_ATTENTION, LINEAR_ATTENTION, LINEAR_ATTENTION, FULL_ATTENTION),
        linear=LinearAttention(conv_kernel=4, key_heads=2, value_heads=4, key_dim=16, value_dim=16),
        attention_gate=True,
    ),
    "tiny-qwen3.5-moe": ModelConfig(
        name="random-tiny-qwen3.5-moe", vocab_size=512, dim=64, n_layers=4, n_heads=4, n_kv_heads=2,
        ffn_dim=32, norm_eps=1e-6, rope_theta=10000.0, context_length=4096, tie_embeddings=False,
        family="qwen3_5_moe", explicit_head_dim=32, qk_norm=True, partial_rotary=0.25,
        layer_types=(LINEAR_ATTENTION, LINEAR_ATTENTION, LINEAR_ATTENTION, FULL_ATTENTION),
        linear=LinearAttention(conv_kernel=4, key_heads=2, value_heads=4, key_dim=16, value_dim=16),
        attention_gate=True, experts=Experts(count=8, top_k=3, ffn_dim=32, shared_ffn_dim=48),
    ),
}
