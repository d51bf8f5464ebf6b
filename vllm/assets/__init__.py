"""Files shipped inside the package: the built-in model (trained on the standard library, see
vllm/tools/train_model.py), the 512-token tokenizer the tests' tiny random models use, and its text."""
from pathlib import Path

ASSETS_DIR = Path(__file__).parent
DEFAULT_MODEL_DIR = ASSETS_DIR / "default_model"
TINY_TOKENIZER_DIR = ASSETS_DIR / "tiny_tokenizer"
CORPUS_PATH = ASSETS_DIR / "corpus.txt"
