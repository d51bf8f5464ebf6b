"""Load a Kimi-Linear / Kimi-K3 checkpoint directory: config.json + safetensors (single file or sharded).

Checkpoint names follow the published checkpoints and transformers' `save_pretrained`; the mapping to our
parameters handles its quirks (dense layer 0 saved as `block_sparse_moe.*`, A_log saved as [1, 1, H, 1],
conv weights saved as [P, 1, W], an optional `language_model.` prefix). Every mismatch is an error naming
the tensor and what was expected.
"""
from __future__ import annotations

import json
import logging
import re
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from tqdm.auto import tqdm

from vllm.attention.backend import HybridBackends
from vllm.attention.selector import reference_backends
from vllm.config import LOAD_FORMATS
from vllm.distributed.parallel_state import get_tp_group
from vllm.model_executor.dummy_loader import initialize_dummy_weights
from vllm.model_executor.models.kimi_k3.model import FP32_PARAM_SUFFIXES, KimiK3ForCausalLM
from vllm.model_executor.tp_shard import check_divisible, rank_slice, split_dim, split_whole
from vllm.transformers_utils.checkpoint_errors import (CheckpointError, CheckpointNotFoundError, MissingTensorError,
                                                       TensorShapeError, UnexpectedTensorError)
from vllm.transformers_utils.configs.kimi_k3 import KimiK3TextConfig

logger = logging.getLogger(__name__)

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
IGNORED_PREFIXES = ("vision_tower.", "mm_projector.", "multi_modal_projector.")
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
           "fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16, "half": torch.float16,
           "float": torch.float32}


def resolve_dtype(dtype: str | torch.dtype, config_raw: dict | None = None) -> torch.dtype:
    """'auto' takes the checkpoint's dtype (float32 when it names none)."""
    if isinstance(dtype, torch.dtype):
        if dtype not in _DTYPES.values():
            raise ValueError(f"dtype={dtype} is not supported; expected float32, bfloat16 or float16")
        return dtype
    if dtype == "auto":
        raw = config_raw or {}
        text = raw.get("text_config") if isinstance(raw.get("text_config"), dict) else {}
        saved = next((c[k] for c in (raw, text) for k in ("dtype", "torch_dtype") if c.get(k)), "float32")
        if _parse_dtype(saved) is None:
            raise CheckpointError(f"config.json names dtype {saved!r}; expected float32, bfloat16 or float16 "
                                  "(or pass an explicit --dtype)")
        return _parse_dtype(saved)
    parsed = _parse_dtype(dtype)
    if parsed is None:
        raise ValueError(f"dtype={dtype!r} is not supported; expected one of auto, float32, bfloat16, float16")
    return parsed


def _parse_dtype(name: str) -> torch.dtype | None:
    return _DTYPES.get(str(name).lower().removeprefix("torch."))


def read_config_json(model_dir: str | Path) -> dict:
    model_dir = Path(model_dir)
    if not model_dir.is_dir():
        raise CheckpointNotFoundError(f"model directory {str(model_dir)!r} does not exist (or is not a directory)")
    path = model_dir / "config.json"
    if not path.is_file():
        raise CheckpointNotFoundError(f"{path} is missing: a model directory needs config.json")
    check_inside(path, model_dir)
    try:
        return json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as e:
        raise CheckpointError(f"{path} is not valid JSON: {e}") from None


def load_config(model_dir: str | Path, raw: dict | None = None) -> KimiK3TextConfig:
    """The parsed config.json (`raw` if the caller read it already); errors name the file."""
    try:
        return KimiK3TextConfig.from_dict(read_config_json(model_dir) if raw is None else raw)
    except CheckpointError as e:
        if str(e).startswith(str(Path(model_dir))):
            raise
        raise type(e)(f"{Path(model_dir) / 'config.json'}: {e}") from None
    except (ValueError, TypeError) as e:
        raise CheckpointError(f"{Path(model_dir) / 'config.json'}: {e}") from None


def checkpoint_roots(model_dir: Path) -> tuple[Path, ...]:
    """Where the files of `model_dir` may lead: the directory itself and, for a snapshot in the Hugging Face cache
    (models--org--name/snapshots/<rev>/, whose files are symlinks into ../../blobs/), its models--* directory."""
    root = model_dir.resolve()
    repo = root.parent.parent
    if root.parent.name == "snapshots" and repo.name.startswith("models--") and (repo / "blobs").is_dir():
        return root, repo
    return (root,)


def check_inside(path: Path, model_dir: Path, named_by: Path | None = None) -> None:
    """Refuses a file (or the symlink chain it is) that leads outside the model directory and its cache root: a
    checkpoint must not make the engine open /etc/passwd or another model's files. `named_by`: the index."""
    target = path.resolve()
    if any(target.is_relative_to(root) for root in checkpoint_roots(model_dir)):
        return
    where = (f"{named_by} names shard {path.relative_to(model_dir).as_posix()!r}, which resolves to"
             if named_by else f"{path} is a symlink to")
    raise CheckpointError(f"{where} {target}, not a file inside {model_dir}; files must be within the model "
                          "directory (or, for a Hugging Face cache snapshot, its models--* directory)")


def _shard_path(model_dir: Path, index: Path, shard) -> Path:
    """The shard's path; only relative names that stay in the model directory, whatever the index says."""
    if not isinstance(shard, str) or Path(shard).is_absolute() or ".." in Path(shard).parts:
        raise CheckpointError(f"{index} names shard {shard!r}, which is not a file inside {model_dir}; "
                              "shards must be relative paths within the model directory")
    path = model_dir / shard
    check_inside(path, model_dir, named_by=index)
    return path


def weight_files(model_dir: Path) -> list[Path]:
    index = model_dir / INDEX_FILE
    if index.is_file():
        check_inside(index, model_dir)
        try:
            shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError, AttributeError, RecursionError) as e:
            raise CheckpointError(f"{index} must be JSON with a 'weight_map' object of tensor name -> shard "
                                  f"file ({type(e).__name__}: {e})") from e
        paths = [_shard_path(model_dir, index, shard) for shard in shards]
        missing = [s for s, path in zip(shards, paths) if not path.is_file()]
        if missing:
            raise CheckpointNotFoundError(f"{INDEX_FILE} in {model_dir} lists shards that are missing: {missing}")
        return paths
    if (model_dir / SINGLE_FILE).is_file():
        check_inside(model_dir / SINGLE_FILE, model_dir)
        return [model_dir / SINGLE_FILE]
    raise CheckpointNotFoundError(f"no weights in {model_dir}: expected {SINGLE_FILE} or {INDEX_FILE} with its shards")


def iter_checkpoint(files: list[Path]) -> Iterator[tuple[str, torch.Tensor]]:
    for name, part in iter_checkpoint_slices(files):
        yield name, part[...]


def iter_checkpoint_slices(files: list[Path]) -> Iterator[tuple[str, object]]:
    """(name, safetensors slice) of every tensor: `slice.get_shape()` costs nothing, `slice[index]` reads only
    what the index selects."""
    for path in tqdm(files, desc="Loading safetensors shards"):
        try:
            with safe_open(str(path), framework="pt") as f:
                for name in f.keys():
                    yield name, f.get_slice(name)
        except (SafetensorError, OSError, ValueError, RuntimeError) as e:
            if isinstance(e, CheckpointError):
                raise
            raise CheckpointError(f"{path} is not a readable safetensors file (truncated, empty or another "
                                  f"format?): {type(e).__name__}: {e}") from None


_DENSE_AS_MOE = re.compile(r"^(model\.layers\.(\d+)\.)block_sparse_moe\.((gate|up|down)_proj\.weight)$")


def map_name(name: str, config: KimiK3TextConfig) -> str | None:
    """Checkpoint name -> our parameter name; None for tensors this text-only engine ignores."""
    name = name.removeprefix("language_model.")
    if name.startswith(IGNORED_PREFIXES):
        return None
    m = _DENSE_AS_MOE.match(name)
    if m and not config.is_moe_layer(int(m.group(2))):
        return f"{m.group(1)}mlp.{m.group(3)}"
    return name


def fit_shape(name: str, tensor: torch.Tensor, expected: torch.Size) -> torch.Tensor:
    """Accept the published alternative layouts of the same values, else raise naming the tensor."""
    if tensor.shape == expected:
        return tensor
    alt_ok = ((name.endswith("A_log") and tensor.numel() == expected.numel() and tensor.dim() == 4)
              or (name.endswith("_conv1d.weight") and tensor.dim() == 3 and tensor.shape[1] == 1))
    if alt_ok and tensor.numel() == expected.numel():
        return tensor.reshape(expected)
    raise TensorShapeError(f"checkpoint tensor {name!r} has shape {list(tensor.shape)}; the model config "
                           f"expects {list(expected)}")


def build_model(config: KimiK3TextConfig, dtype: torch.dtype, device: torch.device | str,
                backends: HybridBackends) -> KimiK3ForCausalLM:
    """The model with uninitialised storage on `device`, in `dtype` except the float32 gate/router params."""
    with torch.device("meta"):
        model = KimiK3ForCausalLM(config, backends).to(dtype)
        for name, p in model.named_parameters():
            if name.endswith(FP32_PARAM_SUFFIXES):
                p.data = p.data.float()
    return model.to_empty(device=device).eval().requires_grad_(False)


def load_weights(model: KimiK3ForCausalLM, model_dir: str | Path) -> None:
    config = model.config
    params = dict(model.named_parameters())
    loaded: set[str] = set()
    unexpected: list[str] = []
    ignored = 0
    tp = get_tp_group()
    for ckpt_name, part in iter_checkpoint_slices(weight_files(Path(model_dir))):
        name = map_name(ckpt_name, config)
        if name is None:
            ignored += 1
            continue
        name = model.local_param_name(name)
        if name is None:
            continue  # an expert another rank holds (expert parallelism)
        if name == "lm_head.weight" and config.tie_word_embeddings:
            continue  # some writers store the tied head too
        shape = part.get_shape()
        if name not in params:
            # transformers writes 0-width shared experts for n_shared_experts=0; they hold nothing.
            if not (0 in shape and ".shared_experts." in name):
                unexpected.append(ckpt_name)
            continue
        param = params[name]
        dim = split_dim(ckpt_name, param.shape, shape, tp.world_size)
        if dim is None:
            tensor = split_whole(ckpt_name, part[...], param.shape, tp.rank, tp.world_size, fit_shape)
        else:
            tensor = part[rank_slice(shape, dim, tp.rank, tp.world_size)]
        param.data.copy_(tensor)
        loaded.add(name)
    if ignored:
        logger.info("ignored %d vision tensors (this engine serves the text model only)", ignored)
    if unexpected:
        raise UnexpectedTensorError(f"checkpoint holds {len(unexpected)} tensors the model config has no place "
                                    f"for, e.g. {unexpected[:5]}")
    missing = [n for n in params if n not in loaded]
    if missing:
        shapes = {n: list(params[n].shape) for n in missing[:5]}
        raise MissingTensorError(f"checkpoint lacks {len(missing)} tensors the model config needs, "
                                 f"e.g. {shapes} (name: expected shape)")
    model.process_weights_after_loading()


def load_model(model_dir: str | Path, dtype: str | torch.dtype = "auto", device: torch.device | str = "cpu",
               backends: HybridBackends | None = None, config: KimiK3TextConfig | None = None,
               load_format: str = "auto", seed: int = 0) -> KimiK3ForCausalLM:
    """`config`, when the caller parsed it already, saves parsing config.json again. `load_format` "dummy":
    random weights from `seed` (dummy_loader), no safetensors read."""
    if load_format not in LOAD_FORMATS:
        raise ValueError(f"load_format={load_format!r} is not supported; expected one of {', '.join(LOAD_FORMATS)}")
    raw = read_config_json(model_dir)
    config = config or load_config(model_dir, raw)
    check_divisible(config, get_tp_group().world_size)
    model = build_model(config, resolve_dtype(dtype, raw), device, backends or reference_backends())
    if load_format == "dummy":
        initialize_dummy_weights(model, seed)
    else:
        load_weights(model, model_dir)
    return model
