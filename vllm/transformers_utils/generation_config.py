"""generation_config.json, as upstream reads it: its sampling fields become the defaults of requests that leave them
unset, and its eos_token_id adds to the ids that end a sequence. `--generation-config auto` reads the model
directory's file, `vllm` ignores any, and a directory reads that directory's."""
from __future__ import annotations

import json
import logging
import math
from pathlib import Path
from typing import Any

from vllm.sampling_params import SamplingParams
from vllm.transformers_utils.checkpoint_errors import CheckpointError, CheckpointNotFoundError

logger = logging.getLogger(__name__)

FILE = "generation_config.json"
# The file's sampling fields and the SamplingParams field each one defaults (upstream's list).
SAMPLING_FIELDS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
                   "repetition_penalty": "repetition_penalty", "max_new_tokens": "max_tokens"}
_INT_FIELDS = ("top_k", "max_new_tokens")


def read_generation_config(model: str | Path, source: str = "auto") -> dict[str, Any]:
    """The file's fields ({} for `vllm`, or for `auto` when the model has no file); errors name the file."""
    if source == "vllm":
        return {}
    if source == "auto":
        path = Path(model) / FILE
        if not path.is_file():
            return {}
    else:
        if not Path(source).is_dir():
            raise CheckpointNotFoundError(f"--generation-config={source!r} is neither auto, vllm nor a directory")
        path = Path(source) / FILE
        if not path.is_file():
            raise CheckpointNotFoundError(f"--generation-config={source!r}: {path} does not exist")
    try:
        fields = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as e:
        raise CheckpointError(f"{path} is not valid JSON: {e}") from None
    if not isinstance(fields, dict):
        raise CheckpointError(f"{path} must hold a JSON object, got {type(fields).__name__}")
    _check(path, fields)
    try:  # the ranges, as a request's would be checked
        SamplingParams(**sampling_defaults(fields))
    except ValueError as e:
        raise CheckpointError(f"{path}: {e}") from None
    return fields


def _check(path: Path, fields: dict[str, Any]) -> None:
    """Types checked at start-up, so that a bad file is refused once rather than in every request."""
    for name in SAMPLING_FIELDS:
        v = fields.get(name)
        if v is None:
            continue
        is_int = isinstance(v, int) and not isinstance(v, bool)
        ok = is_int if name in _INT_FIELDS else (is_int or isinstance(v, float)) and math.isfinite(v)
        if not ok:
            raise CheckpointError(f"{path}: {name}={v!r} is invalid: expected "
                                  f"{'an integer' if name in _INT_FIELDS else 'a number'}")
    if eos_token_ids(fields) is None:
        raise CheckpointError(f"{path}: eos_token_id={fields['eos_token_id']!r} is invalid: expected a token id "
                              "or a list of token ids")


def sampling_defaults(fields: dict[str, Any]) -> dict[str, Any]:
    """SamplingParams keywords for the fields the file sets (upstream's get_diff_sampling_param)."""
    return {param: fields[name] for name, param in SAMPLING_FIELDS.items() if fields.get(name) is not None}


def eos_token_ids(fields: dict[str, Any]) -> list[int] | None:
    """The file's eos_token_id as a list ([] if unset); None if it is neither an id nor a list of ids."""
    eos = fields.get("eos_token_id")
    ids = [] if eos is None else [eos] if not isinstance(eos, list) else eos
    if not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids):
        return None
    return list(ids)


def log_defaults(source: str, defaults: dict[str, Any], extra_eos: list[int]) -> None:
    if defaults:
        logger.info("Default sampling parameters have been overridden by the model's Hugging Face generation "
                    "config (%s): %s; pass --generation-config vllm to use vLLM's defaults", source, defaults)
    if extra_eos:
        logger.info("generation_config.json adds end-of-sequence token ids %s", extra_eos)
