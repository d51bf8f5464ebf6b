"""LoRARequest under upstream's name and fields, so that code passing `lora_request=None` (lm-eval, most
scripts) runs. This engine serves no LoRA adapters: `LLM.generate` refuses a request that names one."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class LoRARequest:
    lora_name: str
    lora_int_id: int
    lora_path: str = ""
