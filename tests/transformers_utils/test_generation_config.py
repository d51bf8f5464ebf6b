"""generation_config.json: which fields become sampling defaults, extra eos ids, and errors naming the file."""
from __future__ import annotations

import json

import pytest

from vllm.transformers_utils.checkpoint_errors import CheckpointError
from vllm.transformers_utils.generation_config import eos_token_ids, read_generation_config, sampling_defaults


def write(directory, fields) -> None:
    (directory / "generation_config.json").write_text(fields if isinstance(fields, str) else json.dumps(fields))


def test_sources(tmp_path):
    model, other = tmp_path / "model", tmp_path / "other"
    model.mkdir()
    other.mkdir()
    assert read_generation_config(model) == {}  # auto without a file
    write(model, {"temperature": 0.6})
    write(other, {"top_p": 0.5})
    assert read_generation_config(model) == {"temperature": 0.6}
    assert read_generation_config(model, "auto") == {"temperature": 0.6}
    assert read_generation_config(model, "vllm") == {}
    assert read_generation_config(model, str(other)) == {"top_p": 0.5}
    with pytest.raises(FileNotFoundError, match="neither auto, vllm nor a directory"):
        read_generation_config(model, str(tmp_path / "missing"))
    with pytest.raises(FileNotFoundError, match="generation_config.json does not exist"):
        read_generation_config(model, str(tmp_path))


def test_fields_to_sampling_params():
    fields = {"temperature": 0.6, "top_p": 0.9, "top_k": 40, "min_p": 0.1, "repetition_penalty": 1.1,
              "max_new_tokens": 5, "do_sample": True, "bos_token_id": 1, "top_a": None}
    assert sampling_defaults(fields) == {"temperature": 0.6, "top_p": 0.9, "top_k": 40, "min_p": 0.1,
                                         "repetition_penalty": 1.1, "max_tokens": 5}
    assert eos_token_ids({"eos_token_id": 7}) == [7]
    assert eos_token_ids({"eos_token_id": [7, 8]}) == [7, 8]
    assert eos_token_ids({}) == []


@pytest.mark.parametrize("content, fragment", [
    ("{not json", "is not valid JSON"),
    ("[1, 2]", "must hold a JSON object"),
    ({"temperature": "hot"}, "temperature='hot' is invalid: expected a number"),
    ({"max_new_tokens": 2.5}, "max_new_tokens=2.5 is invalid: expected an integer"),
    ({"eos_token_id": "</s>"}, "eos_token_id='</s>' is invalid"),
    ({"temperature": -1.0}, "temperature"),
])
def test_malformed_file_names_it(tmp_path, content, fragment):
    write(tmp_path, content)
    with pytest.raises(CheckpointError, match="generation_config.json") as e:
        read_generation_config(tmp_path)
    assert fragment in str(e.value) and str(tmp_path) in str(e.value)
