"""Remote-code tokenizers (the published Kimi checkpoints' TikToken ones): loaded with trust_remote_code, refused
by name without it, and encoding and decoding through tiktoken."""
from __future__ import annotations

import builtins
import json

import pytest
import tiktoken
from kimi_checkpoint import bpe_ranks, write_kimi_checkpoint, write_kimi_tokenizer

from vllm.transformers_utils.tokenizer import check_vocab, get_tokenizer, needs_remote_code

PATTERN = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""


@pytest.fixture(scope="module", params=["kimi_linear", "k3"])
def kimi_dir(request, tmp_path_factory) -> str:
    return write_kimi_checkpoint(tmp_path_factory.mktemp(request.param), request.param)


@pytest.fixture(autouse=True)
def no_prompt(monkeypatch):
    """transformers asks [y/N] on a terminal when trust_remote_code is None; the loader must never get there."""
    def refuse(*_):
        raise AssertionError("the tokenizer loader prompted for input")
    monkeypatch.setattr(builtins, "input", refuse)


def test_without_the_flag_the_error_names_it(kimi_dir):
    with pytest.raises(ValueError, match="--trust-remote-code") as e:
        get_tokenizer(kimi_dir)
    assert kimi_dir in str(e.value) and "tokenization_kimi.py" in str(e.value)


def test_encodes_and_decodes_through_tiktoken(kimi_dir):
    tok = get_tokenizer(kimi_dir, trust_remote_code=True)
    assert type(tok).__name__ == "TikTokenTokenizer" and isinstance(tok.model, tiktoken.Encoding)
    check_vocab(tok, kimi_dir, 512)  # the reserved tokens fill the vocabulary exactly
    assert len(tok) == 512
    ranks = {t: r for r, t in enumerate(bpe_ranks())}
    reference = tiktoken.Encoding("reference", pat_str=PATTERN, mergeable_ranks=ranks, special_tokens={})
    text = "hello world, the answer is 42. é日本"
    ids = tok.encode(text)
    assert ids == reference.encode_ordinary(text)
    assert any(i >= 256 for i in ids)  # merges are used, not only bytes
    assert tok.decode(ids) == text
    end = tok.convert_tokens_to_ids("<|im_end|>")
    with_special = tok.encode("hi<|im_end|>")
    assert with_special == reference.encode_ordinary("hi") + [end]
    assert tok.decode(with_special) == "hi<|im_end|>"
    assert tok.decode(with_special, skip_special_tokens=True) == "hi"
    assert tok.eos_token == "[EOS]" and tok.eos_token_id == tok.convert_tokens_to_ids("[EOS]")


def test_chat_template_comes_from_chat_template_jinja(kimi_dir):
    tok = get_tokenizer(kimi_dir, trust_remote_code=True)
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert text == "<|im_user|>user<|im_middle|>hi<|im_end|><|im_assistant|>assistant<|im_middle|>"


def test_needs_remote_code(tmp_path):
    write_kimi_tokenizer(tmp_path, 512)
    assert needs_remote_code(tmp_path)
    (tmp_path / "tokenizer.json").write_text("{}")  # a tokenizer transformers can load itself
    assert not needs_remote_code(tmp_path)
    (tmp_path / "tokenizer.json").unlink()
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    del config["auto_map"]
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    assert not needs_remote_code(tmp_path)
