"""The model's recommended sampling (worker.serve.generation_config) against transformers' own reading of the same
generation_config.json files (GenerationConfig.from_pretrained), and every way a file can be refused."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from transformers import GenerationConfig

from broker.common import protocol as p
from worker.model.config import ModelLoadError
from worker.serve.generation_config import FILE, KEYS, read, sampling_defaults

# As the models' repositories publish them.
PUBLISHED = {
    "Qwen3-8B": {"bos_token_id": 151643, "do_sample": True, "eos_token_id": [151645, 151643], "pad_token_id": 151643,
                 "temperature": 0.6, "top_k": 20, "top_p": 0.95, "transformers_version": "4.51.0"},
    "Qwen2.5-7B-Instruct": {"bos_token_id": 151643, "pad_token_id": 151643, "do_sample": True,
                            "eos_token_id": [151645, 151643], "repetition_penalty": 1.05, "temperature": 0.7,
                            "top_p": 0.8, "top_k": 20, "transformers_version": "4.37.0"},
    "Llama-3.1-8B-Instruct": {"bos_token_id": 128000, "do_sample": True, "eos_token_id": [128001, 128008, 128009],
                              "temperature": 0.6, "top_p": 0.9, "transformers_version": "4.42.3"},
    "SmolLM2-135M-Instruct": {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 2,
                              "transformers_version": "4.42.3"},
    "with min_p and a length": {"temperature": 1.0, "min_p": 0.05, "max_new_tokens": 512},
}


def folder_with(tmp_path: Path, config: Any, name: str = "model") -> Path:
    folder = tmp_path / name
    folder.mkdir()
    (folder / FILE).write_text(json.dumps(config))
    return folder


@pytest.mark.parametrize("model", PUBLISHED)
def test_the_six_parameters_vllm_reads_are_transformers_values(tmp_path: Path, model: str) -> None:
    folder = folder_with(tmp_path, PUBLISHED[model])
    reference = GenerationConfig.from_pretrained(folder)
    expected = {ours: getattr(reference, theirs) for theirs, ours in KEYS.items() if getattr(reference, theirs) is not None}
    got = sampling_defaults("auto", str(folder))
    assert got.given() == expected
    assert got == read(folder / FILE) == sampling_defaults(str(folder), None) == sampling_defaults(str(folder / FILE), None)


def test_the_published_values_by_name(tmp_path: Path) -> None:
    """The same, spelled out: what a Qwen3 or a Qwen2.5 worker announces (do_sample and the special tokens are not
    sampling defaults)."""
    assert sampling_defaults("auto", str(folder_with(tmp_path, PUBLISHED["Qwen3-8B"], "a"))) == p.SamplingDefaults(
        temperature=0.6, top_p=0.95, top_k=20)
    assert sampling_defaults("auto", str(folder_with(tmp_path, PUBLISHED["Qwen2.5-7B-Instruct"], "b"))).given() == {
        "temperature": 0.7, "top_p": 0.8, "top_k": 20, "repetition_penalty": 1.05}


def test_none_and_models_without_a_file_recommend_nothing(tmp_path: Path) -> None:
    folder = folder_with(tmp_path, PUBLISHED["Qwen3-8B"])
    assert sampling_defaults("none", str(folder)) == p.SamplingDefaults()
    bare = tmp_path / "bare"
    bare.mkdir()
    for model in (None, "random:tiny", str(tmp_path / "model.gguf"), str(bare)):
        assert sampling_defaults("auto", model) == p.SamplingDefaults(), model
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF")
    assert sampling_defaults(str(folder), str(gguf)).given() == {"temperature": 0.6, "top_k": 20, "top_p": 0.95}


def test_top_k_minus_one_is_the_whole_vocabulary_as_in_vllm(tmp_path: Path) -> None:
    assert read(folder_with(tmp_path, {"top_k": -1}) / FILE).top_k == 0


@pytest.mark.parametrize(("config", "complaint"), [
    ({"temperature": "0.6"}, "temperature must be a number, got '0.6'"),
    ({"temperature": True}, "temperature must be a number, got True"),
    ({"temperature": 101}, "temperature must be in [0.0, 100.0], got 101"),
    ({"top_p": 0}, "top_p must be in (0, 1]"),
    ({"top_p": 1.5}, "top_p must be in [0.0, 1.0], got 1.5"),
    ({"top_k": 2.5}, "top_k must be an integer, got 2.5"),
    ({"top_k": -2}, "top_k must be in [0, 2147483647], got -2"),
    ({"min_p": -0.1}, "min_p must be in [0.0, 1.0], got -0.1"),
    ({"repetition_penalty": 0}, "repetition_penalty must be in [0.01, 10.0], got 0"),
    ({"max_new_tokens": 0}, "max_new_tokens must be in [1, 1048576], got 0"),
    ({"temperature": float("nan")}, "temperature must be a number, got nan"),
    ({"temperature": 10**400}, "temperature is out of range, got 1000000000"),  # (no float holds it)
    ({"max_new_tokens": 2**40}, "max_new_tokens is out of range"),
    ([0.6], "not a JSON object"),
])
def test_a_bad_value_refuses_the_file_naming_its_key(tmp_path: Path, config: Any, complaint: str) -> None:
    folder = folder_with(tmp_path, config)
    with pytest.raises(ModelLoadError) as e:
        sampling_defaults("auto", str(folder))
    assert str(e.value).startswith(str(folder / FILE)) and complaint in str(e.value), str(e.value)


def test_an_unreadable_or_missing_file_is_refused(tmp_path: Path) -> None:
    folder = tmp_path / "broken"
    folder.mkdir()
    (folder / FILE).write_text("{not json")
    with pytest.raises(ModelLoadError, match="not a readable JSON file"):
        sampling_defaults("auto", str(folder))
    (folder / FILE).write_text('{"top_k": ' + "9" * 5000 + "}")  # past Python's digits for an int
    with pytest.raises(ModelLoadError, match="not a readable JSON file"):
        sampling_defaults("auto", str(folder))
    with pytest.raises(ModelLoadError, match=r"--generation-config .*nowhere: no such file"):
        sampling_defaults(str(tmp_path / "nowhere"), None)
