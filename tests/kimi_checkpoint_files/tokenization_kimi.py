"""A Kimi-style TikToken tokenizer, as the published Kimi-Linear and Kimi-K3 checkpoints ship theirs: BPE ranks in
`tiktoken.model` (one `base64(token) rank` line per token), special tokens numbered after them, loaded by
transformers as remote code (tokenizer_config.json's auto_map). Written for this repository's tests; the
checkpoint writer (tests/kimi_checkpoint.py) copies it next to the weights."""
from __future__ import annotations

import base64
from pathlib import Path

import tiktoken
# The published tokenization_kimi.py files import these two from here (transformers 4's layout), so ours does too:
# the engine must make them importable under transformers 5.
from transformers.models.gpt2.tokenization_gpt2 import bytes_to_unicode
from transformers.tokenization_utils import PreTrainedTokenizer

# GPT-2's pre-tokenizer split (words with their leading space, numbers, punctuation runs, spaces).
PATTERN = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""


def load_ranks(path: str | Path) -> dict[bytes, int]:
    ranks = {}
    for line in Path(path).read_text().splitlines():
        if line:
            token, rank = line.split()
            ranks[base64.b64decode(token)] = int(rank)
    return ranks


class TikTokenTokenizer(PreTrainedTokenizer):
    vocab_files_names = {"vocab_file": "tiktoken.model"}
    model_input_names = ["input_ids", "attention_mask"]

    def __init__(self, vocab_file: str, bos_token: str = "[BOS]", eos_token: str = "[EOS]", unk_token=None,
                 pad_token=None, added_tokens_decoder: dict | None = None, **kwargs) -> None:
        added_tokens_decoder = added_tokens_decoder or {}
        ranks = load_ranks(vocab_file)
        specials = {getattr(t, "content", str(t)): int(i) for i, t in added_tokens_decoder.items()}
        self.vocab_file = vocab_file
        self.model = tiktoken.Encoding(name=Path(vocab_file).stem, pat_str=PATTERN, mergeable_ranks=ranks,
                                       special_tokens=specials)
        alphabet = bytes_to_unicode()  # a printable character per byte: every token has a string spelling
        self._byte_of = {c: b for b, c in alphabet.items()}
        self._spelt = {rank: "".join(alphabet[b] for b in token) for token, rank in ranks.items()}
        self._ids = {s: i for i, s in self._spelt.items()}
        super().__init__(bos_token=bos_token, eos_token=eos_token, unk_token=unk_token, pad_token=pad_token,
                         added_tokens_decoder=added_tokens_decoder, **kwargs)

    @property
    def vocab_size(self) -> int:
        return self.model.n_vocab

    def get_vocab(self) -> dict[str, int]:
        return {**self._ids, **self.added_tokens_encoder}

    def _tokenize(self, text: str, **kwargs) -> list[str]:
        # Special tokens were split off by the base class; the rest is ordinary text for tiktoken.
        return [self._spelt[i] for i in self.model.encode_ordinary(text)]

    def _convert_token_to_id(self, token: str) -> int | None:
        return self._ids.get(token)

    def _convert_id_to_token(self, index: int) -> str | None:
        return self._spelt.get(index)

    def convert_tokens_to_string(self, tokens: list[str]) -> str:
        data = b"".join(bytes(self._byte_of[c] for c in t) if t in self._ids else t.encode() for t in tokens)
        return data.decode("utf-8", "replace")

    def _decode(self, token_ids: int | list[int], skip_special_tokens: bool = False, **kwargs) -> str:
        ids = [token_ids] if isinstance(token_ids, int) else list(token_ids)
        special = {i for i, t in self.added_tokens_decoder.items() if t.special} if skip_special_tokens else set()
        known = [i for i in ids if 0 <= i < self.model.n_vocab and i not in special]
        return self.model.decode(known, errors="replace")

    def save_vocabulary(self, save_directory: str, filename_prefix: str | None = None) -> tuple[str]:
        out = Path(save_directory) / f"{filename_prefix + '-' if filename_prefix else ''}tiktoken.model"
        out.write_bytes(Path(self.vocab_file).read_bytes())
        return (str(out),)
