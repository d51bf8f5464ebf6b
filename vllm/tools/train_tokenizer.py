"""Train a byte-level BPE tokenizer: the built-in model's, and the tiny one the tests' random models use.

The built-in model's tokenizer is trained on the standard-library corpus (``vllm.tools.prepare_corpus``,
a .jsonl of files); the tests' 512-token tokenizer on ``vllm/assets/corpus.txt``. Either way the package
ships its tokenizers with no third-party files or downloads. The output directory loads with
``transformers.AutoTokenizer.from_pretrained``.

Usage::

    python -m vllm.tools.train_tokenizer --corpus .train/corpus/train.jsonl \
        --vocab-size 4096 --out vllm/assets/default_model
    python -m vllm.tools.train_tokenizer --corpus vllm/assets/corpus.txt \
        --vocab-size 512 --out vllm/assets/tiny_tokenizer
"""

import argparse
import json
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

# Trainer special tokens take the first ids in list order, so this order pins
# <pad>=0, <bos>=1, <eos>=2, <|im_start|>=3, <|im_end|>=4.
PAD, BOS, EOS, IM_START, IM_END = "<pad>", "<bos>", "<eos>", "<|im_start|>", "<|im_end|>"
SPECIAL_TOKENS = [PAD, BOS, EOS, IM_START, IM_END]

# ChatML-style template; the generation prompt opens an assistant turn.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def corpus_texts(corpus_path: str | Path) -> list[str]:
    """The training texts: one per line of a .jsonl corpus ({"text": ...}), else the whole UTF-8 file."""
    path = Path(corpus_path)
    if path.suffix == ".jsonl":
        with open(path, encoding="utf-8") as f:
            return [json.loads(line)["text"] for line in f]
    return [path.read_text(encoding="utf-8")]


def train_tokenizer(corpus_path: str | Path, vocab_size: int) -> Tokenizer:
    """Train a byte-level BPE tokenizer on a UTF-8 text file or a .jsonl corpus."""
    # Byte-level BPE needs no unk token: every byte is in the base alphabet,
    # so any string round-trips through encode/decode.
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        # Seed all 256 bytes, not only those seen in the ASCII corpus.
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    # Whole files as sequences keep newline runs ("\n\n") intact for the pre-tokenizer.
    # Training is deterministic: ids come from the sorted alphabet and merge
    # ties are broken by pair id, not by hash-map order.
    tok.train_from_iterator(corpus_texts(corpus_path), trainer=trainer)
    # Same templates transformers builds from add_bos_token=True, so the raw
    # tokenizer and AutoTokenizer encode identically.
    bos_id = tok.token_to_id(BOS)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS}:0 $A:0",
        pair=f"{BOS}:0 $A:0 {BOS}:1 $B:1",
        special_tokens=[(BOS, bos_id)],
    )
    return tok


def _write_json(path: Path, obj: dict) -> None:
    # Fixed key order and indentation keep the files byte-stable across runs.
    path.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def save_tokenizer(tok: Tokenizer, out_dir: str | Path) -> None:
    """Write tokenizer.json plus the transformers config files to ``out_dir``."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    special_tokens_map = {
        "bos_token": BOS,
        "eos_token": EOS,
        "pad_token": PAD,
        # Listed so skip_special_tokens also drops the chat markers.
        "additional_special_tokens": [IM_START, IM_END],
    }
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        **special_tokens_map,
        # Records the intent for config readers; transformers v5 drops these
        # keys when tokenizer.json exists and uses its post-processor instead.
        "add_bos_token": True,
        "add_eos_token": False,
        # Byte-level decoding is already exact; the cleanup would turn
        # "a , b" into "a, b" and break round-tripping.
        "clean_up_tokenization_spaces": False,
        "chat_template": CHAT_TEMPLATE,
    }
    _write_json(out / "special_tokens_map.json", special_tokens_map)
    _write_json(out / "tokenizer_config.json", config)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--corpus", type=Path, required=True, help="UTF-8 training text")
    parser.add_argument("--vocab-size", type=int, default=512, help="total vocab incl. specials")
    parser.add_argument("--out", type=Path, required=True, help="output directory")
    args = parser.parse_args(argv)
    save_tokenizer(train_tokenizer(args.corpus, args.vocab_size), args.out)


if __name__ == "__main__":
    main()
