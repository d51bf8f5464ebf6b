"""Tests for the default model's tokenizer and the script that trains it."""

from pathlib import Path

import pytest
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from vllm.tools import train_tokenizer as tt

ASSETS = Path(tt.__file__).resolve().parents[1] / "assets"
CORPUS = ASSETS / "corpus.txt"
SHIPPED = ASSETS / "tiny_tokenizer"
DEFAULT_MODEL = ASSETS / "default_model"  # its tokenizer: 4096 tokens trained on the stdlib corpus
FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
CHATML = "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


@pytest.fixture(scope="module")
def trained_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # A small vocab keeps training fast; the behaviour under test is the same.
    out = tmp_path_factory.mktemp("tok")
    tt.save_tokenizer(tt.train_tokenizer(CORPUS, vocab_size=300), out)
    return out


@pytest.fixture(params=["trained", "shipped", "default_model"])
def hf_tok(request: pytest.FixtureRequest, trained_dir: Path) -> PreTrainedTokenizerFast:
    path = {"trained": trained_dir, "shipped": SHIPPED, "default_model": DEFAULT_MODEL}[request.param]
    return AutoTokenizer.from_pretrained(path)


def test_special_token_ids_are_fixed(hf_tok: PreTrainedTokenizerFast) -> None:
    assert isinstance(hf_tok, PreTrainedTokenizerFast)
    ids = hf_tok.convert_tokens_to_ids(tt.SPECIAL_TOKENS)
    assert ids == [0, 1, 2, 3, 4]
    assert (hf_tok.pad_token_id, hf_tok.bos_token_id, hf_tok.eos_token_id) == (0, 1, 2)


def test_bos_prepended(hf_tok: PreTrainedTokenizerFast) -> None:
    ids = hf_tok("Hello world")["input_ids"]
    assert ids[0] == hf_tok.bos_token_id == 1
    assert hf_tok.bos_token_id not in ids[1:]


ROUNDTRIP_TEXTS = ["Hello world", "café ☕", "Capital of France?", "a , b  \n\n\tx", "日本語 🙂"]


@pytest.mark.parametrize("text", ROUNDTRIP_TEXTS)
def test_decode_roundtrip(hf_tok: PreTrainedTokenizerFast, text: str) -> None:
    assert hf_tok.decode(hf_tok.encode(text), skip_special_tokens=True) == text


def test_chat_template(hf_tok: PreTrainedTokenizerFast) -> None:
    messages = [{"role": "user", "content": "hi"}]
    text = hf_tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert text == CHATML
    no_prompt = hf_tok.apply_chat_template(messages, add_generation_prompt=False, tokenize=False)
    assert no_prompt == "<|im_start|>user\nhi<|im_end|>\n"


def test_training_is_deterministic(trained_dir: Path, tmp_path: Path) -> None:
    tt.save_tokenizer(tt.train_tokenizer(CORPUS, vocab_size=300), tmp_path)
    for name in FILES:
        assert (tmp_path / name).read_bytes() == (trained_dir / name).read_bytes()


def test_shipped_matches_retrain(tmp_path: Path) -> None:
    # Guards against the corpus or script changing without regenerating assets.
    tt.main(["--corpus", str(CORPUS), "--vocab-size", "512", "--out", str(tmp_path)])
    for name in FILES:
        assert (tmp_path / name).read_bytes() == (SHIPPED / name).read_bytes()
    assert len(AutoTokenizer.from_pretrained(SHIPPED)) == 512
