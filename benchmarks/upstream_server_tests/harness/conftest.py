"""Stands in for upstream's tests/conftest.py: the fixtures its server tests use, without downloads, and the
selection of the cases counted.

Hub model names the tests load tokenizers for map to the tokenizer of the model actually served (the engine's
built-in one), so tokenizer-based expectations are computed with the tokenizer in use. LoRA's snapshot_download
returns an empty folder (the LoRA cases are not run)."""
import os
import tempfile

import huggingface_hub
import pytest


def _builtin_tokenizer_dir():
    import vllm
    return os.path.join(os.path.dirname(vllm.__file__), "assets", "default_model")


HUB_NAMES = {"HuggingFaceH4/zephyr-7b-beta", "TinyLlama/TinyLlama-1.1B-Chat-v1.0", "Qwen/Qwen2-1.5B-Instruct",
             "gpt2", "meta-llama/Llama-3.2-1B"}


def _patch():
    """Runs when pytest loads this conftest, before the test modules import get_tokenizer by name."""
    import transformers
    import vllm.transformers_utils.tokenizer as vt

    orig_get = vt.get_tokenizer
    orig_auto = transformers.AutoTokenizer.from_pretrained.__func__

    def get_tokenizer(tokenizer_name, *a, **kw):
        if tokenizer_name in HUB_NAMES:
            tokenizer_name = _builtin_tokenizer_dir()
        return orig_get(tokenizer_name, *a, **kw)

    def from_pretrained(cls, name, *a, **kw):
        if name in HUB_NAMES:
            name = _builtin_tokenizer_dir()
        return orig_auto(cls, name, *a, **kw)

    vt.get_tokenizer = get_tokenizer
    transformers.AutoTokenizer.from_pretrained = classmethod(from_pretrained)
    huggingface_hub.snapshot_download = lambda *a, **kw: tempfile.mkdtemp(prefix="no_lora_")


_patch()


class LocalAssetServer:  # only the multimodal metrics case uses it, and that case is left out
    def url_for(self, name):
        raise RuntimeError("multimodal assets are out of scope")


@pytest.fixture(scope="session")
def local_asset_server():
    return LocalAssetServer()


@pytest.fixture
def sample_json_schema():
    return {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
            "required": ["name", "age"]}


# Cases left out as not applicable to this engine, and why (everything else in the files is counted).
NOT_APPLICABLE_IDS = {"zephyr-lora": "LoRA", "multimodal": "multimodal"}
NOT_APPLICABLE_TESTS = {
    "test_named_tool_use": "guided decoding (a named tool's arguments are schema-constrained)",
    "test_response_format_json_object": "structured output", "test_response_format_json_schema": "structured output",
    "test_metrics_exist_run_batch": "pooling (an embeddings batch)",
    "test_load_prompt_embeds": "prompt embeddings (a unit test of upstream's OpenAIServing, not a server case)",
}


def not_applicable(item) -> str | None:
    name = item.originalname if hasattr(item, "originalname") else item.name
    if name.startswith("test_guided_"):
        return "guided decoding"
    if name in NOT_APPLICABLE_TESTS:
        return NOT_APPLICABLE_TESTS[name]
    for fragment, why in NOT_APPLICABLE_IDS.items():
        if fragment in item.name:
            return why
    return None


def pytest_collection_modifyitems(config, items):
    keep, dropped = [], []
    for item in items:
        (dropped if not_applicable(item) else keep).append(item)
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = keep
