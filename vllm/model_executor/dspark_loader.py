"""Loading a DSpark draft checkpoint: config.json (DSparkConfig) and safetensors under the module names of
dspark/model.py. The draft's own copies of the embedding and lm_head are dropped: it uses the target's."""
from __future__ import annotations

import logging
from pathlib import Path

import torch

from vllm.model_executor.model_loader import iter_checkpoint, weight_files
from vllm.model_executor.models.dspark.model import DSparkDraftModel
from vllm.transformers_utils.checkpoint_errors import MissingTensorError, UnexpectedTensorError
from vllm.transformers_utils.configs.dspark import read_dspark_config
from vllm.transformers_utils.configs.kimi_k3 import KimiK3TextConfig

logger = logging.getLogger(__name__)
SHARED_WITH_TARGET = ("embed_tokens.", "model.embed_tokens.", "lm_head.")


def load_dspark_draft(model_dir: str | Path, target: KimiK3TextConfig, dtype: torch.dtype,
                      device: torch.device | str) -> DSparkDraftModel:
    config = read_dspark_config(model_dir)
    config.check_fits(target, f"--speculative-config model={str(model_dir)!r}")
    with torch.device("meta"):
        model = DSparkDraftModel(config)
    model = model.to_empty(device=device).to(dtype)
    params = dict(model.named_parameters())
    loaded, unexpected, dropped = set(), [], 0
    for name, tensor in iter_checkpoint(weight_files(Path(model_dir))):
        if name.startswith(SHARED_WITH_TARGET):
            dropped += 1
            continue
        if name not in params or params[name].shape != tensor.shape:
            unexpected.append(f"{name} {list(tensor.shape)}")
            continue
        params[name].data.copy_(tensor)
        loaded.add(name)
    if unexpected:
        raise UnexpectedTensorError(f"DSpark checkpoint {model_dir}: {len(unexpected)} tensors have no place (or "
                                    f"another shape) in the draft its config describes, e.g. {unexpected[:5]}")
    missing = [n for n in params if n not in loaded]
    if missing:
        raise MissingTensorError(f"DSpark checkpoint {model_dir} lacks {len(missing)} tensors, e.g. "
                                 f"{ {n: list(params[n].shape) for n in missing[:5]} } (name: expected shape)")
    if dropped:
        logger.info("DSpark draft: dropped %d tensors it shares with the target (embedding, lm_head)", dropped)
    model.process_weights_after_loading()
    return model.eval().requires_grad_(False)
