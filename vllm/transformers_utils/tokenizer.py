"""Tokenizer loading through transformers' AutoTokenizer, from the model directory or another one."""
from __future__ import annotations

from pathlib import Path

import transformers
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from vllm.model_executor.checkpoint_errors import CheckpointNotFoundError


def get_tokenizer(path: str | Path) -> PreTrainedTokenizerBase:
    path = Path(path)
    if not (path / "tokenizer.json").is_file() and not (path / "tokenizer_config.json").is_file():
        raise CheckpointNotFoundError(f"no tokenizer in {path}: expected tokenizer.json or tokenizer_config.json "
                                      "(pass --tokenizer DIR to load it from elsewhere)")
    # transformers does not know model_type 'kimi_k3' and warns while probing config.json; the
    # tokenizer files themselves are complete, so the warning is noise here.
    verbosity = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_error()
    try:
        return AutoTokenizer.from_pretrained(str(path))
    finally:
        transformers.logging.set_verbosity(verbosity)
