"""Build the built-in model's training corpus from the running Python's standard-library sources (PSF licence).

The data exists on any machine that runs the engine, so the corpus needs no download. Files are read in sorted
path order; a file goes to the held-out split when the first bytes of the sha256 of its relative path fall below
`--heldout-percent` (stable across runs and machines, independent of the file's content). Writes:

    OUT/manifest.json     Python version, stdlib root, split rule, and per file: path, bytes, sha256, split
    OUT/train.jsonl       {"path", "text"} per line, one line per training file
    OUT/heldout.jsonl     the same for held-out files

With `--tokenizer DIR` it also writes OUT/{train,heldout}_tokens.npy: every file as <bos> text <eos>, uint16.

    python -m vllm.tools.prepare_corpus --out .train/corpus [--tokenizer vllm/assets/default_model]
"""
from __future__ import annotations

import argparse
import hashlib
import json
import platform
import sysconfig
from dataclasses import asdict, dataclass
from pathlib import Path

from vllm.tools.train_tokenizer import corpus_texts

# Byte-compiled caches and third-party installs are not the standard library.
EXCLUDED_PARTS = frozenset({"site-packages", "dist-packages", "__pycache__"})


@dataclass(frozen=True, slots=True)
class CorpusFile:
    path: str  # relative to the stdlib root, with forward slashes
    bytes: int
    sha256: str
    split: str  # "train" or "heldout"


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def split_of(rel_path: str, heldout_percent: float) -> str:
    bucket = int.from_bytes(hashlib.sha256(rel_path.encode()).digest()[:4], "big") / 2**32 * 100
    return "heldout" if bucket < heldout_percent else "train"


def collect(root: Path, heldout_percent: float) -> list[tuple[CorpusFile, str]]:
    """(record, text) for every UTF-8 .py file under root, sorted by path; undecodable files are left out."""
    out = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root)
        if EXCLUDED_PARTS.intersection(rel.parts) or not path.is_file():
            continue
        raw = path.read_bytes()
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError:
            continue
        if not text.strip():
            continue
        key = rel.as_posix()
        out.append((CorpusFile(key, len(raw), hashlib.sha256(raw).hexdigest(), split_of(key, heldout_percent)),
                    text))
    return out


def heldout_code_windows(tokenizer, lengths: list[int], heldout_percent: float = 3.0) -> list[list[int]]:
    """Token windows of the given lengths from standard-library files outside the training split (3% is the
    split the built-in model was trained with), one file after another; test files are left out. The split is by
    path hash, so the same files are held out on every Python."""
    out = []
    for path in sorted(stdlib_root().rglob("*.py")):
        rel = path.relative_to(stdlib_root()).as_posix()
        if "test" in rel or split_of(rel, heldout_percent) != "heldout":
            continue
        ids = tokenizer(path.read_text(errors="replace"))["input_ids"]
        while len(out) < len(lengths) and len(ids) >= lengths[len(out)]:
            n = lengths[len(out)]
            out.append(ids[:n])
            ids = ids[n:]
        if len(out) == len(lengths):
            return out
    raise ValueError(f"not enough held-out standard-library code for {len(lengths)} windows of these lengths")


def write_corpus(out_dir: Path, heldout_percent: float = 3.0, root: Path | None = None) -> dict:
    root = root or stdlib_root()
    files = collect(root, heldout_percent)
    if not files:
        raise ValueError(f"no UTF-8 .py files under {root}: is this Python's standard library installed?")
    out_dir.mkdir(parents=True, exist_ok=True)
    for split in ("train", "heldout"):
        with open(out_dir / f"{split}.jsonl", "w", encoding="utf-8") as f:
            for rec, text in files:
                if rec.split == split:
                    f.write(json.dumps({"path": rec.path, "text": text}, ensure_ascii=False) + "\n")
    manifest = {
        "source": "Python standard library sources (PSF License)",
        "python_version": platform.python_version(),
        "stdlib_root": str(root),
        "split_rule": f"heldout if sha256(path)[:4] / 2**32 * 100 < {heldout_percent}",
        "totals": {s: {"files": sum(r.split == s for r, _ in files), "bytes": sum(r.bytes for r, _ in files
                                                                                   if r.split == s)}
                   for s in ("train", "heldout")},
        "files": [asdict(r) for r, _ in files],
    }
    (out_dir / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
    return manifest


def tokenize_split(jsonl: Path, tokenizer_dir: Path, out_npy: Path) -> int:
    """Writes the split's files as one uint16 stream of <bos> text <eos> documents; returns its length."""
    import numpy as np
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))
    if tok.get_vocab_size() > 2**16:
        raise ValueError(f"a vocabulary of {tok.get_vocab_size()} does not fit uint16 token files")
    eos = tok.token_to_id("<eos>")
    ids = []
    for enc in tok.encode_batch(corpus_texts(jsonl)):  # the post-processor prepends <bos>
        ids.extend(enc.ids)
        ids.append(eos)
    np.save(out_npy, np.asarray(ids, dtype=np.uint16))
    return len(ids)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True, help="output directory")
    ap.add_argument("--heldout-percent", type=float, default=3.0)
    ap.add_argument("--tokenizer", type=Path, help="also tokenize both splits with this tokenizer directory")
    args = ap.parse_args(argv)
    manifest = write_corpus(args.out, args.heldout_percent)
    print(f"python {manifest['python_version']}: {json.dumps(manifest['totals'])} -> {args.out}")
    if args.tokenizer:
        for split in ("train", "heldout"):
            n = tokenize_split(args.out / f"{split}.jsonl", args.tokenizer, args.out / f"{split}_tokens.npy")
            print(f"{split}: {n} tokens")


if __name__ == "__main__":
    main()
