"""A checkpoint laid out as the published Kimi ones (tests/kimi_checkpoint.py) offline: its remote-code TikToken
tokenizer with trust_remote_code, its chat_template.jinja, and its generation_config.json's defaults and eos ids."""
from __future__ import annotations

import pytest
from kimi_checkpoint import write_generation_config, write_kimi_checkpoint

from vllm import LLM, SamplingParams
from vllm.engine.arg_utils import EngineArgs
from vllm.transformers_utils.checkpoint_errors import CheckpointError

GENERATION = {"temperature": 0.0, "max_new_tokens": 5, "eos_token_id": [305, 308]}  # [EOS], <|im_end|>


@pytest.fixture(scope="module")
def kimi_dir(tmp_path_factory) -> str:
    return write_kimi_checkpoint(tmp_path_factory.mktemp("kimi"), generation_config=GENERATION)


@pytest.fixture(scope="module")
def llm(kimi_dir) -> LLM:
    return LLM(model=kimi_dir, trust_remote_code=True, max_model_len=256)


def test_without_trust_remote_code_the_error_names_the_flag(kimi_dir):
    with pytest.raises(ValueError, match="pass --trust-remote-code"):
        LLM(model=kimi_dir, max_model_len=256)


def test_generates_and_decodes_through_the_remote_tokenizer(llm):
    tok = llm.get_tokenizer()
    assert type(tok).__name__ == "TikTokenTokenizer"
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    out = llm.generate(["hello world", "the answer is"], params, use_tqdm=False)
    for o, prompt in zip(out, ["hello world", "the answer is"]):
        assert o.prompt_token_ids == tok.model.encode_ordinary(prompt)
        assert len(o.outputs[0].token_ids) == 8
        assert o.outputs[0].text == tok.decode(o.outputs[0].token_ids, skip_special_tokens=True)


def test_chat_applies_chat_template_jinja_and_its_override(llm):
    tok = llm.get_tokenizer()
    messages = [{"role": "user", "content": "hi"}]
    out = llm.chat(messages, SamplingParams(max_tokens=2), use_tqdm=False)[0]
    assert out.prompt_token_ids == tok.encode("<|im_user|>user<|im_middle|>hi<|im_end|>"
                                              "<|im_assistant|>assistant<|im_middle|>")
    out = llm.chat(messages, SamplingParams(max_tokens=2), use_tqdm=False,
                   chat_template="{% for m in messages %}[BOS]{{ m['content'] }}{% endfor %}")[0]
    assert out.prompt_token_ids == tok.encode("[BOS]hi")


def test_generation_config_gives_the_defaults(llm):
    assert llm.get_default_sampling_params() == SamplingParams(temperature=0.0, max_tokens=5)
    assert {305, 308} <= llm.llm_engine.eos_token_ids
    greedy = llm.generate("hello world", SamplingParams(temperature=0.0, max_tokens=5), use_tqdm=False)[0]
    default = llm.generate("hello world", use_tqdm=False)[0]  # no SamplingParams: the file's
    assert default.outputs[0].token_ids == greedy.outputs[0].token_ids
    chat = llm.chat([{"role": "user", "content": "hi"}], use_tqdm=False)[0]
    assert len(chat.outputs[0].token_ids) <= 5


def test_generation_config_vllm_ignores_the_file(kimi_dir):
    llm = LLM(model=kimi_dir, trust_remote_code=True, max_model_len=256, generation_config="vllm")
    assert llm.get_default_sampling_params() == SamplingParams()
    assert 308 not in llm.llm_engine.eos_token_ids


def test_eos_token_id_from_a_generation_config_dir_ends_sequences(kimi_dir, tmp_path):
    """The first token greedy decoding picks, made an eos id by a generation_config.json in another directory
    (--generation-config DIR), ends the sequence right there."""
    plain = LLM(model=kimi_dir, trust_remote_code=True, max_model_len=256, generation_config="vllm")
    params = SamplingParams(temperature=0.0, max_tokens=6)
    first = plain.generate("the answer is", params, use_tqdm=False)[0].outputs[0]
    assert first.finish_reason == "length", "the random model stopped by itself; pick another prompt"
    del plain
    write_generation_config(tmp_path, {"eos_token_id": first.token_ids[0]})
    llm = LLM(model=kimi_dir, trust_remote_code=True, max_model_len=256, generation_config=str(tmp_path))
    assert llm.get_default_sampling_params() == SamplingParams()
    out = llm.generate("the answer is", params, use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "stop" and list(out.token_ids) == [first.token_ids[0]]


def test_malformed_generation_config_names_the_file(kimi_dir, tmp_path):
    write_generation_config(tmp_path, {"top_k": "many"})
    with pytest.raises(CheckpointError, match=f"{tmp_path}/generation_config.json: top_k='many' is invalid"):
        EngineArgs(model=kimi_dir, generation_config=str(tmp_path)).create_engine_config()


def test_engine_args_take_the_flags():
    args = EngineArgs.from_kwargs({"trust_remote_code": True, "generation_config": "vllm"})
    assert args.trust_remote_code and args.generation_config == "vllm"
