"""Tokenizer loading through transformers' AutoTokenizer, from the model directory or another one."""
from __future__ import annotations

import json
import weakref
from collections.abc import Callable
from pathlib import Path

import tokenizers
import transformers
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from vllm.transformers_utils.checkpoint_errors import CheckpointError, CheckpointNotFoundError


def get_tokenizer(tokenizer_name: str | Path, *, tokenizer_mode: str = "auto", trust_remote_code: bool = False,
                  revision: str | None = None, **kwargs) -> PreTrainedTokenizerBase:
    """The tokenizer in a local directory. Upstream's keywords are taken so that callers of its get_tokenizer
    (lm-eval) run; those asking for what this loader does not do are refused by name. Other keywords go to
    AutoTokenizer.from_pretrained.

    With trust_remote_code the tokenizer's own code (tokenizer_config.json's auto_map, e.g. the published Kimi
    checkpoints' tokenization_kimi.py over tiktoken) is imported and run; without it such a tokenizer is refused
    here, by name, rather than left to transformers (which would ask [y/N] on a terminal, or convert tiktoken.model
    itself with its own guess of the pre-tokenizer pattern)."""
    if revision is not None:
        raise ValueError(f"revision={revision!r}: tokenizers load from local directories only")
    # "fast" is what "auto" loads; upstream's loader lets it through as the same (its tests pass it).
    if tokenizer_mode not in ("auto", "hf", "slow", "fast"):
        raise ValueError(f"tokenizer_mode={tokenizer_mode!r} is not supported; expected auto, hf, slow or fast")
    path = Path(tokenizer_name)
    if not (path / "tokenizer.json").is_file() and not (path / "tokenizer_config.json").is_file():
        raise CheckpointNotFoundError(f"no tokenizer in {path}: expected tokenizer.json or tokenizer_config.json "
                                      "(pass --tokenizer DIR to load it from elsewhere)")
    if not trust_remote_code and needs_remote_code(path):
        raise ValueError(_remote_code_message(path))
    if trust_remote_code:
        _restore_transformers4_names()
    # transformers does not know model_type 'kimi_k3' and warns while probing config.json; the
    # tokenizer files themselves are complete, so the warning is noise here.
    verbosity = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_error()
    try:
        # An explicit False, never None: None makes transformers prompt [y/N] on a terminal.
        return AutoTokenizer.from_pretrained(str(path), trust_remote_code=bool(trust_remote_code), **kwargs)
    except Exception as e:  # noqa: BLE001 - whatever the library raises, the message must name the files
        if not trust_remote_code and "trust_remote_code" in str(e):  # remote code asked for elsewhere (config)
            raise ValueError(_remote_code_message(path)) from None
        # The tokenizers library reports a corrupt file without naming it.
        files = [f.name for f in sorted(path.glob("tokenizer*.json")) + sorted(path.glob("special_tokens_map.json"))]
        raise CheckpointError(f"the tokenizer in {path} ({', '.join(files)}) could not be loaded: "
                              f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}") from None
    finally:
        transformers.logging.set_verbosity(verbosity)


def _restore_transformers4_names() -> None:
    """The published Kimi tokenization_kimi.py files import bytes_to_unicode from GPT-2's tokenizer module, where
    transformers 4 had it; transformers 5 keeps it only in convert_slow_tokenizer, so their import fails. Put it
    back where they look (the same function)."""
    from transformers.models.gpt2 import tokenization_gpt2
    if not hasattr(tokenization_gpt2, "bytes_to_unicode"):
        from transformers.convert_slow_tokenizer import bytes_to_unicode
        tokenization_gpt2.bytes_to_unicode = bytes_to_unicode


def needs_remote_code(path: Path) -> bool:
    """A tokenizer that only its own code can build: tokenizer_config.json maps AutoTokenizer to a class shipped
    with the checkpoint, and there is no tokenizer.json that transformers could load instead."""
    if (path / "tokenizer.json").is_file():
        return False
    try:
        auto_map = json.loads((path / "tokenizer_config.json").read_text()).get("auto_map")
    except (OSError, ValueError, AttributeError):
        return False  # unreadable or malformed: the load below reports it, naming the file
    if isinstance(auto_map, (list, tuple)):  # the legacy form: [slow class, fast class]
        return any(auto_map)
    return isinstance(auto_map, dict) and bool(auto_map.get("AutoTokenizer"))


def _remote_code_message(path: Path) -> str:
    return (f"the tokenizer in {path} needs remote code (tokenizer_config.json's auto_map names a class in a "
            "Python file of the checkpoint, as the published Kimi checkpoints' tokenization_kimi.py): pass "
            "--trust-remote-code (LLM(..., trust_remote_code=True)) to run it, after reading that file")


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


def _byte_of_char() -> dict[str, int]:
    """Byte-level BPE's alphabet (GPT-2's): the printable bytes stand for themselves, the other 68 bytes take the
    code points from 256 up, in byte order; a token's string is its bytes spelt in this alphabet."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    codes = dict(zip(printable, printable))
    extra = 256
    for b in range(256):
        if b not in codes:
            codes[b], extra = extra, extra + 1
    return {chr(c): b for b, c in codes.items()}


_BYTE_PIECES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def byte_level_pieces(tokenizer, skip_special_tokens: bool) -> tuple[bytes, ...] | None:
    """Each token id's bytes, when the tokenizer decodes any ids to the UTF-8 decode (errors replaced) of their
    pieces joined: a fast byte-level BPE tokenizer without clean-up of spaces, like the built-in model's and
    tiktoken-style ones converted to tokenizers. None for any other tokenizer.

    Then incremental detokenization is a table lookup per token instead of a decode call over a window of ids
    (that window grows for as long as the ids decode to no text: past the tokenizer's vocabulary, or special
    tokens being skipped). Every piece is checked against the tokenizer's own decode of its id; one mismatch
    (an added token the decoder spells otherwise) and the tokenizer keeps the generic path. Built once per
    tokenizer and flag; the output processor builds the default flag's at start-up, off the first request."""
    try:
        per_tokenizer = _BYTE_PIECES.setdefault(tokenizer, {})
    except TypeError:  # a tokenizer object that cannot be weakly referenced or hashed: not cached
        return _build_byte_level_pieces(tokenizer, skip_special_tokens)
    if skip_special_tokens not in per_tokenizer:
        per_tokenizer[skip_special_tokens] = _build_byte_level_pieces(tokenizer, skip_special_tokens)
    return per_tokenizer[skip_special_tokens]


def _build_byte_level_pieces(tokenizer, skip_special_tokens: bool) -> tuple[bytes, ...] | None:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if (backend is None or getattr(tokenizer, "clean_up_tokenization_spaces", True)
            or not isinstance(backend.decoder, tokenizers.decoders.ByteLevel)):
        return None
    byte_of = _byte_of_char()
    added = backend.get_added_tokens_decoder()
    size = backend.get_vocab_size(with_added_tokens=True)
    pieces = []
    for i in range(size):
        token = added.get(i)
        if token is not None:
            piece = b"" if skip_special_tokens and token.special else token.content.encode()
        else:
            spelt = backend.id_to_token(i)
            try:
                piece = b"" if spelt is None else bytes(byte_of[c] for c in spelt)
            except KeyError:  # outside the alphabet: the decoder takes the string's own UTF-8
                piece = spelt.encode()
        pieces.append(piece)
    # One batched decode (in Rust) checks every piece against the tokenizer's own text for its id.
    decoded = backend.decode_batch([[i] for i in range(size)], skip_special_tokens=skip_special_tokens)
    if any(p.decode("utf-8", "replace") != text for p, text in zip(pieces, decoded)):
        return None
    return tuple(pieces)
