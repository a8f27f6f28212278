"""What each kind of launch costs a hybrid model's decode step: the step's CUDA graph with that kind left out.

    python -m worker.bench.marginal [--model random:qwen3.5-35b-a3b] [--sessions 1] [--replays 200] [--json FILE]

For Qwen3.5 models (dense or MoE) on the GPU. `--sessions` sessions decode a few steps; then, for each variant, the
decode graph of their bucket is captured again with some of the model's kernels making no launch (their output a
zero tensor made in the warm-up before the capture, or the residual for a product that adds one) and its replays are
timed with CUDA events (best of 3 rounds). What the step loses with a kind left out is what that kind costs in the
chain of launches: its bytes' time and the latency it adds. The products' bytes at the device's copy bandwidth are
printed beside them. The outputs are wrong (zeros flow on; with the MoE block's combining launch left out, the next
layer reads a norm nobody wrote): only the times mean anything, and the engine is not used for anything else
afterwards. With a mixture of experts only one session is measured: at several, which experts a step reads follows
the values, which the left-out launches upset (a zeroed router sends every token to the same 8 experts); a one-token
step always reads 8 routed experts and the shared one.

Kinds: the products by weight (delta_in, delta_out, attn_qkv, attn_o, router, head, and mlp: a dense MLP's gate|up
and down, or a shared expert computed apart), the MoE block's launches (moe: routing, gate|up, down and the combining
launch; experts: gate|up and down; combine: the combining launch), the DeltaNet's conv, delta and gated_norm, the
gated attention's rope_store, attention and attn_gate, and norm (every offset RMSNorm launch: the post-attention
norms, the first layer's input norm and a dense MLP's next norm; no figure a layer). `small` is every kind but the
products and the experts, the routing kept (what is left is the products streaming one after another). The last
variant is the whole step again, against drift.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import logging
from collections.abc import Callable
from typing import Any

import structlog
import torch

from worker.bench.matmul import copy_bandwidth, gpu_us
from worker.engine import Engine

PRODUCTS = ("delta_in", "delta_out", "attn_qkv", "attn_o", "router", "head", "mlp")
SMALL = ("conv", "delta", "gated_norm", "norm", "rope_store", "attention", "attn_gate", "combine")
VARIANTS: list[tuple[str, ...]] = [
    (), ("router",), ("moe",), ("experts",), ("combine",), ("delta_in",), ("delta_out",), ("attn_qkv",), ("attn_o",),
    ("head",), ("mlp",), ("conv",), ("delta",), ("gated_norm",), ("norm",), ("rope_store",), ("attention",), ("attn_gate",),
    ("conv", "delta", "gated_norm"), SMALL, (*SMALL, "moe"), (*PRODUCTS, "experts"), (*PRODUCTS, "moe"), (),
]


class Skipping:
    """The model's kernels, each kind of launch left out while its name is in `names`."""

    def __init__(self, engine: Engine) -> None:
        from worker.model.qwen3_5 import Attention

        self.model = engine.model
        self.names: set[str] = set()
        self._zeros: dict[Any, torch.Tensor] = {}
        self.original = self.model.kernels
        hybrid = self.original.hybrid
        if hybrid is None:
            raise SystemExit("worker.bench.marginal takes a Qwen3.5 model on the GPU")
        self.tags: dict[int, str] = {self.model.lm_head.weight.data_ptr(): "head"}
        self.weight_bytes: dict[str, int] = {"head": self.model.lm_head.weight.nbytes}
        blocks = self.model.blocks  # type: ignore[attr-defined]
        attention_layers = sum(isinstance(block.mixer, Attention) for block in blocks)
        self.layers: dict[str, int] = {"head": 1} | dict.fromkeys(("moe", "experts", "combine"), len(blocks))
        self.layers |= dict.fromkeys(("conv", "delta", "gated_norm"), len(blocks) - attention_layers)
        self.layers |= dict.fromkeys(("rope_store", "attention", "attn_gate"), attention_layers)
        for block in blocks:
            mixer = block.mixer
            if isinstance(mixer, Attention):
                named = {"attn_qkv": mixer.wqkv.fused.weight, "attn_o": mixer.wo.weight}
            else:
                named = {"delta_in": mixer.w_in.fused.weight, "delta_out": mixer.w_out.weight}
            mlp = block.mlp
            if hasattr(mlp, "w_route"):
                named["router"] = mlp.w_route.fused.weight
                if not mlp.shared_in_experts:  # a shared expert computed apart, by row products
                    named["mlp"] = mlp.shared_gate_up
                    named["mlp_down"] = mlp.shared_down
            else:
                named["mlp"] = mlp.w_gate_up.fused.weight
                named["mlp_down"] = mlp.w_down.weight
            for key, w in named.items():
                name = "mlp" if key == "mlp_down" else key  # one kind, two products a layer
                self.tags[w.data_ptr()] = name
                self.weight_bytes[name] = self.weight_bytes.get(name, 0) + w.nbytes
                if key != "mlp_down":
                    self.layers[name] = self.layers.get(name, 0) + 1
        wrap = self._wrap
        hybrid = dataclasses.replace(
            hybrid, conv_decode=wrap("conv", hybrid.conv_decode), delta_decode=wrap("delta", hybrid.delta_decode),
            gated_rms_norm=wrap("gated_norm", hybrid.gated_rms_norm), offset_rms_norm=wrap("norm", hybrid.offset_rms_norm),
            norm_rope_store=wrap("rope_store", hybrid.norm_rope_store), sigmoid_gate=wrap("attn_gate", hybrid.sigmoid_gate),
            row_matmul=self._row_matmul(hybrid.row_matmul),
            moe=self._moe(hybrid.moe) if hybrid.moe is not None else None)
        attention = self.original.decode_attention
        self.model.kernels = dataclasses.replace(
            self.original, hybrid=hybrid,
            decode_attention=wrap("attention", attention) if attention is not None else None)

    def restore(self) -> None:
        self.model.kernels = self.original

    def _zeros_of(self, key: Any, make: Callable[[], torch.Tensor]) -> torch.Tensor:
        """A zero tensor like `make()`'s result, made once (in a warm-up, before any capture)."""
        if key not in self._zeros:
            self._zeros[key] = torch.zeros_like(make())
        return self._zeros[key]

    def _wrap(self, name: str, fn: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
        @functools.wraps(fn)
        def run(*args: Any, **kw: Any) -> torch.Tensor:
            if name not in self.names:
                return fn(*args, **kw)
            shapes = tuple(tuple(a.shape) for a in args if isinstance(a, torch.Tensor))
            return self._zeros_of((name, shapes), lambda: fn(*args, **kw))
        return run

    def _row_matmul(self, fn: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
        @functools.wraps(fn)
        def run(x: torch.Tensor, weight: torch.Tensor, **kw: Any) -> torch.Tensor:
            name = self.tags.get(weight.data_ptr(), "")
            if name not in self.names:
                return fn(x, weight, **kw)
            for kept in ("out", "residual"):  # what the caller gets back from a product that writes or adds there
                if kw.get(kept) is not None:
                    return kw[kept]
            return self._zeros_of((name, tuple(x.shape)), lambda: fn(x, weight, **kw))
        return run

    def _moe(self, fn: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
        from worker.kernels import moe as moe_module

        @functools.wraps(fn)
        def run(h: torch.Tensor, x: torch.Tensor, *args: Any, **kw: Any) -> torch.Tensor:
            if kw.get("prefill"):
                return fn(h, x, *args, **kw)
            if "moe" in self.names:
                return h
            if "combine" in self.names:  # the routing and the experts, no sum
                logits, gate_up, down, top_k, scratch = args[:5]
                routing = moe_module.route_and_sort(logits, logits.shape[1] - 1, top_k, moe_module.DECODE_TILES,
                                                    scratch, shared=kw.get("shared") is None)
                if "experts" not in self.names:
                    moe_module.experts_forward(x, gate_up, down, routing, moe_module.DECODE_TILES)
                return h
            if "experts" not in self.names:
                return fn(h, x, *args, **kw)
            real = moe_module.experts_forward
            moe_module.experts_forward = lambda x, gate_up, down, routing, tiles: self._zeros_of(
                ("experts", tuple(x.shape)), lambda: real(x, gate_up, down, routing, tiles))
            try:
                return fn(h, x, *args, **kw)
            finally:
                moe_module.experts_forward = real
        return run


def replay_us(engine: Engine, bucket: int, replays: int) -> float:
    """The decode graph of `bucket` captured again and replayed: microseconds a replay (best of 3 rounds)."""
    executor: Any = engine.executor
    graph, _ = executor._capture(functools.partial(executor._decode_forward, bucket))
    for _ in range(20):
        graph.replay()
    best = gpu_us(graph.replay, calls=replays, rounds=3)
    del graph
    torch.cuda.synchronize()
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="random:qwen3.5-35b-a3b")
    ap.add_argument("--sessions", type=int, default=1)
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--replays", type=int, default=200)
    ap.add_argument("--json", default=None, help="also write the numbers to this file")
    args = ap.parse_args()
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
    from worker.bench.step_profile import _sessions
    from worker.engine.graphs import pick_bucket

    engine = Engine.load(args.model, device="cuda", max_sessions=max(args.sessions, 1), max_context=1024)
    if engine.model.config.experts is not None and args.sessions != 1:
        raise SystemExit("a mixture of experts is measured at one session (see the module docstring)")
    executor: Any = engine.executor
    if not getattr(executor, "use_graphs", False):
        raise SystemExit("worker.bench.marginal replays the decode graphs: run it on the GPU")
    _sessions(engine, args.sessions, args.prompt_tokens, 20)
    for _ in range(10):
        engine.step()  # the graphs' inputs now hold the sessions' rows, which every replay below runs again
    torch.cuda.synchronize()
    skipping = Skipping(engine)
    bandwidth = copy_bandwidth()
    bucket = pick_bucket(executor.buckets, args.sessions)
    print(f"model {engine.model_name}, {args.sessions} session(s) (bucket {bucket}), {torch.cuda.get_device_name()}, "
          f"copy bandwidth {bandwidth / 1e12:.2f} TB/s")
    print(f"{'left out':56s} {'step us':>9s} {'saved us':>9s} {'a layer':>8s} {'bytes us':>9s}")
    results = []
    whole = None
    for variant in VARIANTS:
        skipping.names = set(variant)
        us = replay_us(engine, bucket, args.replays)
        whole = us if whole is None else whole
        saved = whole - us
        layers = skipping.layers.get(variant[0], 0) if len(variant) == 1 else 0
        nbytes = sum(skipping.weight_bytes.get(name, 0) for name in variant)
        results.append({"left_out": list(variant), "step_us": us, "saved_us": saved, "weight_bytes": nbytes})
        per_layer = f"{saved / layers:8.2f}" if layers else " " * 8
        read = f"{nbytes / bandwidth * 1e6:9.1f}" if nbytes else " " * 9
        print(f"{'+'.join(variant) or '(nothing: the whole step)':56s} {us:9.1f} {saved:9.1f} {per_layer} {read}",
              flush=True)
    skipping.restore()
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"model": engine.model_name, "sessions": args.sessions, "bandwidth": bandwidth,
                       "device": torch.cuda.get_device_name(), "results": results}, f, indent=2)


if __name__ == "__main__":
    main()
