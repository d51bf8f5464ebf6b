"""Files shipped inside the package: the built-in model (trained on the standard library, see
vllm/tools/train_model.py), its DSpark draft (vllm/tools/train_dspark.py), the 512-token tokenizer the tests'
tiny random models use, and its text."""
from pathlib import Path

ASSETS_DIR = Path(__file__).parent
DEFAULT_MODEL_DIR = ASSETS_DIR / "default_model"
DEFAULT_DSPARK_DIR = ASSETS_DIR / "default_model_dspark"
TINY_TOKENIZER_DIR = ASSETS_DIR / "tiny_tokenizer"
CORPUS_PATH = ASSETS_DIR / "corpus.txt"
