"""worker.bench.read_floor: the bytes a decode step must read, for a dense model and a hybrid one (a mixture of
experts' experts touched are counted on the GPU only: the count rides in its kernels)."""

from __future__ import annotations

import torch

from worker.bench.read_floor import floor_bytes
from worker.engine import Engine


def test_a_dense_models_floor_is_its_weights_less_the_embedding_plus_the_sessions_kv() -> None:
    engine = Engine.load("random:tiny", device="cpu", max_sessions=2, max_context=64)
    try:
        c = engine.model.config
        item = torch.empty((), dtype=engine.model.dtype).element_size()
        floor = floor_bytes(engine, 2, 10)
        kv_per_token = c.n_layers * 2 * c.n_kv_heads * c.head_dim * item
        embedding = 0 if c.tie_embeddings else c.vocab_size * c.dim * item
        assert floor["weights"] == engine.model.weight_bytes() - embedding + 2 * c.dim * item
        assert floor["experts"] == 0 and floor["experts_per_layer"] == 0
        assert floor["state"] == 2 * 10 * kv_per_token
        assert floor["total"] == floor["weights"] + floor["state"]
    finally:
        engine.unload()


def test_a_hybrid_models_floor_reads_and_writes_its_fixed_state() -> None:
    """tiny-qwen3.5: three DeltaNet layers (conv state 128 x 3, recurrent state 4 value heads x 16 x 16, fp32 on the
    CPU) and one attention layer (2 KV heads of 32)."""
    engine = Engine.load("random:tiny-qwen3.5", device="cpu", max_sessions=2, max_context=64)
    try:
        fixed = 3 * (128 * 3 * 4 + 4 * 16 * 16 * 4)
        per_token = 2 * 2 * 32 * 4
        assert floor_bytes(engine, 2, 10)["state"] == 2 * (2 * fixed + 10 * per_token)
    finally:
        engine.unload()
