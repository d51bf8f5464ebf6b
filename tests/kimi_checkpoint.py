"""Tiny checkpoints laid out as the published Kimi-Linear and Kimi-K3 ones: random weights and config.json from
vllm/tools/make_tiny_model.py, plus a remote-code TikToken tokenizer (our own tokenization_kimi.py, BPE ranks
trained here on a small corpus, special tokens numbered after them up to the model's vocab_size as Kimi's
reserved tokens are), a chat_template.jinja and, when asked, a generation_config.json."""
from __future__ import annotations

import base64
import json
import re
import shutil
from collections import Counter
from pathlib import Path

from vllm.tools.make_tiny_model import write_tiny_model

FILES = Path(__file__).parent / "kimi_checkpoint_files"
NAMED_SPECIALS = ["[BOS]", "[EOS]", "[UNK]", "[PAD]", "<|im_end|>", "<|im_user|>", "<|im_assistant|>",
                  "<|im_system|>", "<|im_middle|>",
                  # Kimi's tool-call and thinking markers, special tokens as in the published tokenizers
                  "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>", "<|tool_call_begin|>",
                  "<|tool_call_argument_begin|>", "<|tool_call_end|>", "<think>", "</think>"]
CORPUS = ("the quick brown fox jumps over the lazy dog. hello world, hello there! the cat sat on the mat; "
          "one two three four five six seven eight nine ten. what is the answer? the answer is 42.")
NUM_MERGES = 48


def bpe_ranks(corpus: str = CORPUS, num_merges: int = NUM_MERGES) -> list[bytes]:
    """Tokens in rank order: the 256 bytes, then merges of the most frequent adjacent pair (ties: the first
    seen), so every merged token is reachable by tiktoken from the tokens ranked before it."""
    words = [[bytes([b]) for b in w.encode()] for w in re.findall(r" ?\w+| ?[^\w\s]+|\s+", corpus)]
    tokens = [bytes([b]) for b in range(256)]
    for _ in range(num_merges):
        pairs = Counter((a, b) for w in words for a, b in zip(w, w[1:]))
        if not pairs:
            break
        (a, b), _ = pairs.most_common(1)[0]
        tokens.append(a + b)
        words = [_merge(w, a, b) for w in words]
    return tokens


def _merge(word: list[bytes], a: bytes, b: bytes) -> list[bytes]:
    out, i = [], 0
    while i < len(word):
        if i + 1 < len(word) and word[i] == a and word[i + 1] == b:
            out.append(a + b)
            i += 2
        else:
            out.append(word[i])
            i += 1
    return out


def write_kimi_tokenizer(out_dir: str | Path, vocab_size: int) -> dict[str, int]:
    """tiktoken.model, tokenization_kimi.py, chat_template.jinja and tokenizer_config.json; returns the special
    tokens' ids."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    ranks = bpe_ranks()
    (out / "tiktoken.model").write_text("".join(f"{base64.b64encode(t).decode()} {r}\n" for r, t in enumerate(ranks)))
    reserved = [f"<|reserved_token_{i}|>" for i in range(vocab_size - len(ranks) - len(NAMED_SPECIALS))]
    specials = {t: len(ranks) + i for i, t in enumerate(NAMED_SPECIALS + reserved)}
    for f in ("tokenization_kimi.py", "chat_template.jinja"):
        shutil.copy(FILES / f, out / f)
    config = {
        "auto_map": {"AutoTokenizer": ["tokenization_kimi.TikTokenTokenizer", None]},
        "tokenizer_class": "TikTokenTokenizer",
        "bos_token": "[BOS]", "eos_token": "[EOS]", "unk_token": "[UNK]", "pad_token": "[PAD]",
        "added_tokens_decoder": {str(i): {"content": t, "lstrip": False, "normalized": False, "rstrip": False,
                                          "single_word": False, "special": True} for t, i in specials.items()},
        "clean_up_tokenization_spaces": False,
        "model_max_length": 1048576,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    return specials


def write_kimi_checkpoint(out_dir: str | Path, family: str = "kimi_linear", generation_config: dict | None = None,
                          vocab_size: int = 512, **overrides) -> str:
    """The whole checkpoint; config.json's token ids are the tokenizer's, and config.json carries the published
    checkpoints' auto_map (the engine reads config.json itself and needs no remote code for it)."""
    out = Path(out_dir)
    specials = write_kimi_tokenizer(out, vocab_size)
    write_tiny_model(out, family, vocab_size=vocab_size, bos_token_id=specials["[BOS]"],
                     eos_token_id=specials["[EOS]"], pad_token_id=specials["[PAD]"], **overrides)
    config = json.loads((out / "config.json").read_text())
    config["auto_map"] = {"AutoConfig": "configuration_kimi.KimiLinearConfig",
                          "AutoModelForCausalLM": "modeling_kimi.KimiLinearForCausalLM"}
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    if generation_config is not None:
        write_generation_config(out, generation_config)
    return str(out)


def write_generation_config(out_dir: str | Path, fields: dict) -> None:
    (Path(out_dir) / "generation_config.json").write_text(json.dumps(fields, indent=2) + "\n")
