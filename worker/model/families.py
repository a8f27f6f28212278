"""The model families, by the name a Hugging Face config.json gives (`model_type`): each one's config reader, its
extra tensor names, and its model class. A new family is a module beside llama.py and a line here."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from worker.model import llama, qwen2, qwen3
from worker.model.config import ModelConfig, ModelLoadError


@dataclass(frozen=True)
class Family:
    name: str  # ModelConfig.family
    read_hf_config: Callable[[Mapping[str, Any], str, str], ModelConfig]
    hf_layer_names: Mapping[str, str]  # Hugging Face tensor name within a layer -> ours
    model: type[llama.Llama]


LLAMA = Family("llama", llama.read_hf_config, llama.HF_LAYER_NAMES, llama.Llama)
QWEN2 = Family("qwen2", qwen2.read_hf_config, {**llama.HF_LAYER_NAMES, **qwen2.HF_LAYER_NAMES}, qwen2.Qwen2)
QWEN3 = Family("qwen3", qwen3.read_hf_config, {**llama.HF_LAYER_NAMES, **qwen3.HF_LAYER_NAMES}, qwen3.Qwen3)

BY_MODEL_TYPE: dict[str, Family] = {"llama": LLAMA, "mistral": LLAMA, "qwen2": QWEN2, "qwen3": QWEN3}
BY_NAME: dict[str, Family] = {f.name: f for f in (LLAMA, QWEN2, QWEN3)}


def family_of(model_type: object, where: str) -> Family:
    family = BY_MODEL_TYPE.get(str(model_type))
    if family is None:
        raise ModelLoadError(f"{where}: model_type {model_type!r} is not supported (supported: "
                             f"{', '.join(sorted(BY_MODEL_TYPE))})")
    return family


def model_class(config: ModelConfig) -> type[llama.Llama]:
    """The class that builds `config`'s model."""
    return BY_NAME[config.family].model
