"""LLM: offline batched generation, as upstream: `LLM(model=...).generate(prompts, sampling_params)`."""
from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Sequence

from tqdm.auto import tqdm

from vllm.beam_search import BeamSearchOutput, beam_search
from vllm.engine.arg_utils import EngineArgs
from vllm.engine.input_processor import checked_max_tokens
from vllm.engine.llm_engine import LLMEngine
from vllm.inputs import PromptType
from vllm.inputs.validation import text_problem
from vllm.lora.request import LoRARequest
from vllm.outputs import RequestOutput
from vllm.sampling_params import BeamSearchParams, RequestOutputKind, SamplingParams


class LLM:
    def __init__(self, model: str | None = None, **kwargs) -> None:
        if model is not None:
            kwargs["model"] = model
        self.llm_engine = LLMEngine.from_engine_args(EngineArgs.from_kwargs(kwargs))
        self._counter = itertools.count()

    def get_tokenizer(self):
        return self.llm_engine.tokenizer

    def generate(self, prompts: PromptType | Sequence[PromptType],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True, lora_request: LoRARequest | None = None) -> list[RequestOutput]:
        """Outputs in the order of `prompts`. A single prompt may be passed bare (string, dict or token ids).

        A prompt whose step fails (an engine bug its input triggers) comes back with finish_reason "error" and
        `error` set; the other prompts of the call are unaffected."""
        if lora_request is not None:
            raise ValueError(f"lora_request={lora_request!r}: this engine serves no LoRA adapters")
        if isinstance(prompts, (str, dict)) or (isinstance(prompts, list) and prompts
                                                and isinstance(prompts[0], int)):
            prompts = [prompts]
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        if isinstance(sampling_params, SamplingParams):
            sampling_params = [sampling_params] * len(prompts)
        if not isinstance(sampling_params, (list, tuple)) or not all(
                isinstance(p, SamplingParams) for p in sampling_params):
            raise ValueError(f"sampling_params must be a SamplingParams or a list of them, got "
                             f"{type(sampling_params).__name__}; build one with SamplingParams(**your_dict)")
        if len(sampling_params) != len(prompts):
            raise ValueError(f"got {len(sampling_params)} SamplingParams for {len(prompts)} prompts; pass one, "
                             "or one per prompt")
        # Only the final outputs are returned, so the engine builds no others (upstream does the same).
        final = {id(p): dataclasses.replace(p, output_kind=RequestOutputKind.FINAL_ONLY) for p in sampling_params}
        return self._run(prompts, [final[id(p)] for p in sampling_params], use_tqdm)

    def beam_search(self, prompts: Sequence[PromptType], params: BeamSearchParams,
                    lora_request: LoRARequest | None = None, use_tqdm: bool = False) -> list[BeamSearchOutput]:
        """Beam search per prompt (vllm/beam_search.py); each output's sequences are best first and hold the
        prompt's tokens, then the generated ones."""
        if lora_request is not None:
            raise ValueError(f"lora_request={lora_request!r}: this engine serves no LoRA adapters")
        engine = self.llm_engine
        ids = [engine.process_prompt(p)[1] for p in prompts]
        for p in ids:  # what add_request checks of a plain request, for the whole search
            checked_max_tokens(len(p), params.max_tokens, engine.model_config.max_model_len)
        tok = self.get_tokenizer()
        return beam_search(lambda batch, sp: self.generate(batch, sp, use_tqdm=use_tqdm), tok.decode, ids, params,
                           engine.eos_token_ids)

    def get_default_sampling_params(self) -> SamplingParams:
        """The SamplingParams a call without any uses: vLLM's defaults, overridden by the fields the model's
        generation_config.json sets (unless --generation-config vllm)."""
        return SamplingParams(**self.llm_engine.config.model_config.get_diff_sampling_param())

    def reset_prefix_cache(self) -> bool:
        """Forgets every cached prompt prefix, so the next prompts are computed in full (e.g. between benchmark
        runs); True once done, as upstream's."""
        return self.llm_engine.reset_prefix_cache()

    def chat(self, messages: list[dict] | list[list[dict]], sampling_params: SamplingParams | None = None,
             use_tqdm: bool = True, add_generation_prompt: bool = True, continue_final_message: bool = False,
             chat_template: str | None = None, chat_template_kwargs: dict | None = None) -> list[RequestOutput]:
        """Applies the tokenizer's chat template to one conversation (or a list of them) and generates. Content
        may be a string or OpenAI's list of {"type": "text", "text": ...} parts."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        tok = self.get_tokenizer()
        prompts = []
        for conv in conversations:
            ids = tok.apply_chat_template([text_content(m) for m in conv], add_generation_prompt=add_generation_prompt,
                                          continue_final_message=continue_final_message, tokenize=True,
                                          chat_template=chat_template, **(chat_template_kwargs or {}))
            ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
            prompts.append({"prompt_token_ids": list(ids)})
        return self.generate(prompts, sampling_params, use_tqdm)

    def _run(self, prompts: Sequence[PromptType], params: Sequence[SamplingParams],
             use_tqdm: bool) -> list[RequestOutput]:
        engine = self.llm_engine
        check_prompt_texts(prompts)
        ids = []
        try:
            for prompt, p in zip(prompts, params):
                rid = str(next(self._counter))
                engine.add_request(rid, prompt, p)
                ids.append(rid)
        except Exception:
            engine.abort_request(ids)  # a bad prompt rejects the whole call and leaves nothing behind
            raise
        finished: dict[str, RequestOutput] = {}
        with tqdm(total=len(ids), desc="Processed prompts", disable=not use_tqdm) as bar:
            try:
                while engine.has_unfinished_requests():
                    for out in engine.step():
                        if out.finished:
                            finished[out.request_id] = out
                            bar.update(1)
            except BaseException:
                engine.abort_request([i for i in ids if i not in finished])
                raise
        return [finished[i] for i in ids]


def check_prompt_texts(prompts: Sequence[PromptType]) -> None:
    """Refuses text the tokenizer cannot take (a lone surrogate), naming the prompt, before any request starts."""
    for i, prompt in enumerate(prompts):
        text = prompt.get("prompt") if isinstance(prompt, dict) else prompt
        if (problem := text_problem(text)) is not None:
            raise ValueError(f"prompts[{i}]: {problem}")


def text_content(message: dict) -> dict:
    """The message with list-of-parts content joined into one string (chat templates render strings); a null or
    absent content (an assistant turn that only called tools) is "", as upstream renders it, so templates that
    concatenate message['content'] do not fail on it."""
    content = message.get("content")
    if content is None:
        return {**message, "content": ""}
    if not isinstance(content, list):
        return message
    texts = []
    for part in content:
        if not (isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)):
            raise ValueError(f"message content parts must be {{'type': 'text', 'text': ...}} (the model is text-only), "
                             f"got {part!r}")
        texts.append(part["text"])
    return {**message, "content": "".join(texts)}
