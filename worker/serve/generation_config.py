"""The model's recommended sampling, which the worker announces in its READY (protocol.SamplingDefaults): the OpenAI
gateway gives it to a request that leaves a parameter out, as vLLM's server does (its `--generation-config auto`).

Read from a Hugging Face folder's generation_config.json: temperature, top_p, top_k, min_p, repetition_penalty and
max_new_tokens (as max_tokens), the six vLLM reads; the other keys (do_sample, the special tokens) are not sampling
defaults. Each value is checked: one out of range, or not a number, refuses to start the worker with an error naming
the file and the key, rather than be served in part. `worker start --generation-config`: `auto` (the model folder's
file, if it has one; a GGUF file or a random preset has none), `none` (the API's own defaults), or the path of a
generation_config.json (or of a folder holding one), for a GGUF model say.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from broker.common import protocol as p
from worker.model.config import ModelLoadError

FILE = "generation_config.json"
# generation_config.json's keys (transformers' GenerationConfig) -> protocol.SamplingDefaults' fields
KEYS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
        "repetition_penalty": "repetition_penalty", "max_new_tokens": "max_tokens"}
INTEGERS = frozenset({"top_k", "max_new_tokens"})


def sampling_defaults(choice: str, model: str | None) -> p.SamplingDefaults:
    """What `--generation-config CHOICE` gives the worker of `model` (its --model: None is the bundled GGUF)."""
    if choice == "none":
        return p.SamplingDefaults()
    if choice == "auto":
        if model is None or model.startswith("random:") or not Path(model).is_dir():
            return p.SamplingDefaults()
        path = Path(model) / FILE
        return read(path) if path.is_file() else p.SamplingDefaults()
    path = Path(choice)
    if path.is_dir():
        path = path / FILE
    if not path.is_file():
        raise ModelLoadError(f"--generation-config {choice}: no such file (auto, none, or a {FILE} or its folder)")
    return read(path)


def read(path: Path) -> p.SamplingDefaults:
    """The sampling defaults of one generation_config.json (ModelLoadError naming the key for a bad value)."""
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:  # (ValueError: a decoding error, an integer of too many digits)
        raise ModelLoadError(f"{path}: not a readable JSON file: {e}") from e
    if not isinstance(config, dict):
        raise ModelLoadError(f"{path}: not a JSON object")
    values: dict[str, Any] = {}
    for key, name in KEYS.items():
        value = config.get(key)
        if value is None:
            continue
        values[name] = _value(path, key, value)
    try:
        return p.SamplingDefaults(**values)
    except p.ProtocolError as e:  # a value out of the protocol's range: name the file's key
        raise ModelLoadError(f"{path}: {_key_named(e.message)}: not a sampling default this worker can apply") from e


def _value(path: Path, key: str, value: Any) -> float | int:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or (isinstance(value, float)
                                                                           and not math.isfinite(value)):
        raise ModelLoadError(f"{path}: {key} must be a number, got {value!r}")
    if isinstance(value, int) and abs(value) > 2**31:  # (every key's range is within it; a float of it overflows)
        raise ModelLoadError(f"{path}: {key} is out of range, got {str(value)[:40]}")
    if key in INTEGERS:
        if value != int(value):
            raise ModelLoadError(f"{path}: {key} must be an integer, got {value!r}")
        value = int(value)
        if key == "top_k" and value == -1:
            return 0  # vLLM's "whole vocabulary", as 0 is transformers'
    return value


def _key_named(message: str) -> str:
    """A protocol field's error with the file's key for the field (max_new_tokens, not max_tokens)."""
    return message.replace("max_tokens", "max_new_tokens", 1) if message.startswith("max_tokens") else message
