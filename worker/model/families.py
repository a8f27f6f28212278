"""The model families, by the name a Hugging Face config.json gives (`model_type`): each one's config reader, its
extra tensor names, its model class, and how a random preset of it is drawn. A new family is a module beside
llama.py and a line here."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from worker.model import llama, qwen2, qwen3, qwen3_5, qwen3_5_moe
from worker.model.config import ModelConfig, ModelLoadError
from worker.model.draw import Draw


def _same_name(name: str) -> str | None:
    return name


def _ones(draw: Draw, n: int) -> torch.Tensor:
    return draw.ones(n)


def _zeros(draw: Draw, n: int) -> torch.Tensor:
    return draw.zeros(n)


@dataclass(frozen=True)
class Family:
    name: str  # ModelConfig.family
    read_hf_config: Callable[[Mapping[str, Any], str, str], ModelConfig]
    hf_layer_names: Mapping[str, str]  # Hugging Face tensor name within a layer -> ours
    model: type[llama.Llama]
    random_layer: Callable[[ModelConfig, int, Draw], Iterator[tuple[str, torch.Tensor]]] = llama.random_layer
    random_norm: Callable[[Draw, int], torch.Tensor] = _ones  # the final norm's weight in a random preset
    # A folder's tensor name as the one hf_layer_names and the loader know, or None for a tensor that is not part of
    # text generation (skipped).
    hf_name: Callable[[str], str | None] = _same_name
    # hf_layer_names for a given config, where they depend on it (a mixture of experts' experts by number)
    layer_names: Callable[[ModelConfig], Mapping[str, str]] | None = None

    def names(self, config: ModelConfig) -> Mapping[str, str]:
        """A layer's tensor names in a folder -> ours, for `config`."""
        return self.hf_layer_names if self.layer_names is None else self.layer_names(config)


LLAMA = Family("llama", llama.read_hf_config, llama.HF_LAYER_NAMES, llama.Llama)
QWEN2 = Family("qwen2", qwen2.read_hf_config, {**llama.HF_LAYER_NAMES, **qwen2.HF_LAYER_NAMES}, qwen2.Qwen2)
QWEN3 = Family("qwen3", qwen3.read_hf_config, {**llama.HF_LAYER_NAMES, **qwen3.HF_LAYER_NAMES}, qwen3.Qwen3)
QWEN3_5 = Family("qwen3_5", qwen3_5.read_hf_config, qwen3_5.HF_LAYER_NAMES, qwen3_5.Qwen3_5,
                 random_layer=qwen3_5.random_layer, random_norm=_zeros, hf_name=qwen3_5.hf_names)
QWEN3_5_MOE = Family("qwen3_5_moe", qwen3_5_moe.read_hf_config, qwen3_5_moe.BASE_NAMES, qwen3_5_moe.Qwen3_5Moe,
                     random_layer=qwen3_5_moe.random_layer, random_norm=_zeros, hf_name=qwen3_5.hf_names,
                     layer_names=qwen3_5_moe.hf_layer_names)

BY_MODEL_TYPE: dict[str, Family] = {"llama": LLAMA, "mistral": LLAMA, "qwen2": QWEN2, "qwen3": QWEN3,
                                    "qwen3_5": QWEN3_5, "qwen3_5_text": QWEN3_5, "qwen3_5_moe": QWEN3_5_MOE,
                                    "qwen3_5_moe_text": QWEN3_5_MOE}
BY_NAME: dict[str, Family] = {f.name: f for f in (LLAMA, QWEN2, QWEN3, QWEN3_5, QWEN3_5_MOE)}


def family_of(model_type: object, where: str) -> Family:
    family = BY_MODEL_TYPE.get(str(model_type))
    if family is None:
        raise ModelLoadError(f"{where}: model_type {model_type!r} is not supported (supported: "
                             f"{', '.join(sorted(BY_MODEL_TYPE))})")
    return family


def model_class(config: ModelConfig) -> type[llama.Llama]:
    """The class that builds `config`'s model."""
    return BY_NAME[config.family].model
