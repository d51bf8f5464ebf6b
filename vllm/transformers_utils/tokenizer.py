"""Tokenizer loading through transformers' AutoTokenizer, from the model directory or another one."""
from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import transformers
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from vllm.model_executor.checkpoint_errors import CheckpointError, CheckpointNotFoundError


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
    except Exception as e:  # noqa: BLE001 - whatever the library raises, the message must name the files
        # The tokenizers library reports a corrupt file without naming it.
        files = [f.name for f in sorted(path.glob("tokenizer*.json")) + sorted(path.glob("special_tokens_map.json"))]
        raise CheckpointError(f"the tokenizer in {path} ({', '.join(files)}) could not be loaded: "
                              f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}") from None
    finally:
        transformers.logging.set_verbosity(verbosity)


def check_vocab(tokenizer: PreTrainedTokenizerBase, path: str | Path, model_vocab_size: int) -> None:
    """A tokenizer whose ids reach past the model's embedding rows would be refused prompt by prompt; refuse it
    once, at start-up."""
    size = len(tokenizer)
    if size > model_vocab_size:
        raise CheckpointError(f"the tokenizer in {path} has {size} tokens but the model's vocab_size is "
                              f"{model_vocab_size}: its ids would index past the embedding; use the model's own "
                              "tokenizer (--tokenizer DIR)")


def decoder_for(tokenizer) -> Callable[[list[int], bool], str]:
    """`decode(ids, skip_special_tokens)` giving exactly tokenizer.decode's text. For a fast tokenizer without
    clean-up of tokenization spaces that is its Rust backend's decode: transformers' wrapper around it cost 69 us
    a call against 8 us for the Rust call inside it (cProfile, 256 requests, benchmarks/bench_host_overhead.py on
    the CPU), and the detokenizer calls it for every request every step."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None and not getattr(tokenizer, "clean_up_tokenization_spaces", True):
        return lambda ids, skip_special_tokens: backend.decode(ids, skip_special_tokens=skip_special_tokens)
    return lambda ids, skip_special_tokens: tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)
