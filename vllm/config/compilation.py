"""CompilationConfig: `--compilation-config` and `--enforce-eager` (CUDA graph modes and capture sizes)."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from vllm.config.utils import is_int, parse_json, require, short_repr

CUDAGRAPH_MODES = ("NONE", "FULL_DECODE_ONLY", "FULL", "PIECEWISE", "FULL_AND_PIECEWISE")
COMPILATION_CONFIG_KEYS = ("cudagraph_mode", "cudagraph_capture_sizes", "max_cudagraph_capture_size")


@dataclass(slots=True)
class CompilationConfig:
    """`--compilation-config '{"cudagraph_mode": ..., "cudagraph_capture_sizes": [...]}'` and `--enforce-eager`.

    cudagraph_mode: NONE (eager), FULL_DECODE_ONLY (graphs for decode/verify batches, eager for any batch with a
    prefill row), FULL (graphs for mixed batches too, only if every backend is ALWAYS), PIECEWISE (every step of up
    to 512 tokens replays graphs of the pieces between attention cores, which run eagerly: worker/piecewise.py) or
    FULL_AND_PIECEWISE (full graphs for decode/verify batches, pieces for the rest: upstream's default, and ours on
    CUDA). The graphs' memory pool is measured before the cache is sized and left out of it.
    Capture sizes are token counts; None picks 1, 2, 4, 8 and multiples of 8 up to max_cudagraph_capture_size
    (None: what a full decode batch can take, max_num_seqs x (1 + num_speculative_tokens), within the token
    budget), rounded to multiples of 1 + num_speculative_tokens by the runner. `enforce_eager` forces NONE.
    """
    enforce_eager: bool = False
    cudagraph_mode: str | None = None  # None: FULL_AND_PIECEWISE on CUDA, NONE elsewhere
    cudagraph_capture_sizes: list[int] | None = None
    max_cudagraph_capture_size: int | None = None

    def __post_init__(self) -> None:
        flag = "--compilation-config"
        require(self.cudagraph_mode is None or self.cudagraph_mode in CUDAGRAPH_MODES, f"{flag} cudagraph_mode",
                 self.cudagraph_mode, f"one of {', '.join(CUDAGRAPH_MODES)}")
        sizes = self.cudagraph_capture_sizes
        require(sizes is None or (isinstance(sizes, list) and all(is_int(n) and n >= 1 for n in sizes)),
                 f"{flag} cudagraph_capture_sizes", sizes, "a list of token counts >= 1")
        require(self.max_cudagraph_capture_size is None
                 or (is_int(self.max_cudagraph_capture_size) and self.max_cudagraph_capture_size >= 1),
                 f"{flag} max_cudagraph_capture_size", self.max_cudagraph_capture_size, "an integer >= 1")
        if sizes is not None:
            self.cudagraph_capture_sizes = sorted(set(sizes))

    @classmethod
    def from_json(cls, text_or_dict: str | dict | None, enforce_eager: bool = False) -> CompilationConfig:
        flag = "--compilation-config"
        data = text_or_dict or {}
        if isinstance(data, str):
            try:
                data = parse_json(data)
            except ValueError as e:
                raise ValueError(f"{flag}={short_repr(text_or_dict)} is not valid JSON: {e}") from None
        require(isinstance(data, dict), flag, text_or_dict, 'a JSON object such as {"cudagraph_mode": "FULL"}')
        unknown = sorted(k for k in data if k not in COMPILATION_CONFIG_KEYS)
        require(not unknown, f"{flag} keys", unknown, f"only the keys {', '.join(COMPILATION_CONFIG_KEYS)}")
        return cls(enforce_eager=enforce_eager, **data)

    def resolved_mode(self, device: torch.device) -> str:
        """The mode asked for: NONE under --enforce-eager or off CUDA, else the flag (FULL_AND_PIECEWISE when unset)."""
        if self.enforce_eager or device.type != "cuda":
            return "NONE"
        return self.cudagraph_mode or "FULL_AND_PIECEWISE"
