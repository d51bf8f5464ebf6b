"""Files shipped inside the package: the built-in tiny model and the text its tokenizer was trained on."""
from pathlib import Path

ASSETS_DIR = Path(__file__).parent
DEFAULT_MODEL_DIR = ASSETS_DIR / "default_model"
CORPUS_PATH = ASSETS_DIR / "corpus.txt"
