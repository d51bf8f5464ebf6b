"""Tests for the checkpoint loader, its errors and config parsing, on tiny random checkpoints.

Every error test checks the error class and that the message names what was wrong and what was expected.
"""
import dataclasses
import functools
import hashlib
import json
import re
import shutil
from pathlib import Path

import pytest
import torch

from vllm.model_executor.model_loader import load_config, load_model, resolve_dtype
from vllm.tools.make_tiny_model import random_state_dict, tiny_text_config, wrap_k3, write_checkpoint
from vllm.transformers_utils.checkpoint_errors import (CheckpointError, CheckpointNotFoundError,
                                                       InconsistentLayersError, MissingTensorError, TensorShapeError,
                                                       UnexpectedTensorError, UnknownModelTypeError)
from vllm.transformers_utils.configs.kimi_k3 import KimiK3TextConfig

Q_PROJ = "model.layers.0.self_attn.q_proj.weight"  # a KDA layer in both tiny families


def family_config(family: str) -> dict:
    text = tiny_text_config(family)
    return wrap_k3(text) if family == "k3" else text


@functools.cache
def _cached_state_dict(family: str) -> dict[str, torch.Tensor]:
    return random_state_dict(family_config(family), seed=0)


def state_dict(family: str = "kimi_linear") -> dict[str, torch.Tensor]:
    """A fresh dict (safe to edit) over shared, never-mutated tensors."""
    return dict(_cached_state_dict(family))


def write(path: Path, config: dict | None = None, tensors: dict | None = None, **kw) -> Path:
    write_checkpoint(path, config or family_config("kimi_linear"), state_dict() if tensors is None else tensors,
                     **kw)
    return path


def params(model) -> dict[str, torch.Tensor]:
    return dict(model.named_parameters())


def assert_same_params(a, b) -> None:
    pa, pb = params(a), params(b)
    assert pa.keys() == pb.keys()
    for name in pa:
        assert torch.equal(pa[name], pb[name]), name


def raises(exc: type[Exception], *fragments: str):
    """pytest.raises(exc) whose message must contain every fragment (literally)."""
    return pytest.raises(exc, match="(?s)" + "".join(f"(?=.*{re.escape(f)})" for f in fragments))


def parse(**overrides) -> KimiK3TextConfig:
    return KimiK3TextConfig.from_dict(tiny_text_config("kimi_linear", **overrides))


def without_extra(cfg: KimiK3TextConfig) -> KimiK3TextConfig:
    return dataclasses.replace(cfg, extra={})


# ---- model directory errors ----------------------------------------------------------------------------------

def test_missing_model_directory(tmp_path):
    with raises(CheckpointNotFoundError, str(tmp_path / "nope"), "does not exist") as e:
        load_model(tmp_path / "nope")
    assert isinstance(e.value, FileNotFoundError)


def test_directory_without_config_json(tmp_path):
    with raises(CheckpointNotFoundError, "config.json", "is missing"):
        load_model(tmp_path)


def test_config_json_invalid(tmp_path):
    (tmp_path / "config.json").write_text('{"model_type": "kimi_linear",')
    with raises(CheckpointError, "config.json", "not valid JSON"):
        load_model(tmp_path)


def test_no_weight_files(tmp_path):
    write(tmp_path).joinpath("model.safetensors").unlink()
    with raises(CheckpointNotFoundError, "no weights", "model.safetensors", "model.safetensors.index.json"):
        load_model(tmp_path)


def test_index_names_missing_shard(tmp_path):
    write(tmp_path, shards=3).joinpath("model-00002-of-00003.safetensors").unlink()
    with raises(CheckpointNotFoundError, "model.safetensors.index.json", "model-00002-of-00003.safetensors"):
        load_model(tmp_path)


# ---- config errors -------------------------------------------------------------------------------------------

def test_unknown_model_type(tmp_path):
    write(tmp_path, tiny_text_config("kimi_linear", model_type="llama"))
    with raises(UnknownModelTypeError, "model_type='llama'", "kimi_linear", "kimi_k3"):
        load_model(tmp_path)


def test_kimi_k3_without_text_config():
    with raises(CheckpointError, "kimi_k3", "'text_config'"):
        KimiK3TextConfig.from_dict({"model_type": "kimi_k3", "vision_config": {}})


@pytest.mark.parametrize("kda, full, fragment", [
    ([1, 2, 3], [3, 4], "in both kda_layers and full_attn_layers: [3]"),
    ([1, 2], [4], "in neither list: [3]"),
    ([1, 2, 3], [4, 5], "out of range: [5]"),
])
def test_inconsistent_layer_lists(kda, full, fragment):
    lac = {"kda_layers": kda, "full_attn_layers": full, "num_heads": 4, "head_dim": 16}
    with raises(InconsistentLayersError, fragment, "num_hidden_layers=4", "kda_layers", "full_attn_layers"):
        parse(linear_attn_config=lac)


def test_layer_types_wrong_length():
    with raises(InconsistentLayersError, "layer_types has 3 entries", "num_hidden_layers=4"):
        parse(linear_attn_config=None, layer_types=["linear_attention"] * 2 + ["full_attention"])


# ---- tensor errors -------------------------------------------------------------------------------------------

def test_missing_tensor(tmp_path):
    tensors = state_dict()
    del tensors[Q_PROJ]
    with raises(MissingTensorError, Q_PROJ, "[64, 64]", "expected shape"):
        load_model(write(tmp_path, tensors=tensors))


def test_unexpected_tensor(tmp_path):
    tensors = state_dict() | {"model.layers.0.self_attn.bogus.weight": torch.zeros(4, 4)}
    with raises(UnexpectedTensorError, "model.layers.0.self_attn.bogus.weight"):
        load_model(write(tmp_path, tensors=tensors))


def test_shape_mismatch(tmp_path):
    tensors = state_dict() | {Q_PROJ: torch.zeros(32, 64)}
    with raises(TensorShapeError, Q_PROJ, "[32, 64]", "expects [64, 64]"):
        load_model(write(tmp_path, tensors=tensors))


# ---- successful loads ----------------------------------------------------------------------------------------

def test_single_file_and_sharded_load_identically(tmp_path):
    single = load_model(write(tmp_path / "single"))
    sharded_dir = write(tmp_path / "sharded", shards=3)
    assert len(list(sharded_dir.glob("*.safetensors"))) == 3
    sharded = load_model(sharded_dir)
    assert_same_params(single, sharded)
    assert torch.equal(params(single)[Q_PROJ], state_dict()[Q_PROJ])


def test_language_model_prefix_and_vision_tensors(tmp_path):
    config = family_config("k3")
    prefixed = {f"language_model.{n}": t for n, t in state_dict("k3").items()}
    prefixed |= {"vision_tower.x.weight": torch.zeros(3, 3), "mm_projector.proj.weight": torch.zeros(2, 2)}
    plain = load_model(write(tmp_path / "plain", config, state_dict("k3")))
    assert plain.config.model_type == "kimi_k3"
    assert_same_params(plain, load_model(write(tmp_path / "prefixed", config, prefixed)))


def test_dense_layer_saved_as_block_sparse_moe(tmp_path):
    tensors = state_dict()
    for proj in ("gate_proj", "up_proj", "down_proj"):
        tensors[f"model.layers.0.block_sparse_moe.{proj}.weight"] = tensors.pop(f"model.layers.0.mlp.{proj}.weight")
    loaded = params(load_model(write(tmp_path, tensors=tensors)))
    for proj in ("gate_proj", "up_proj", "down_proj"):
        expected = tensors[f"model.layers.0.block_sparse_moe.{proj}.weight"]
        assert torch.equal(loaded[f"model.layers.0.mlp.{proj}.weight"], expected)


def test_a_log_and_conv_alternative_layouts(tmp_path):
    tensors = state_dict()  # written as transformers does: A_log [1, 1, H, 1], conv [P, 1, W]
    assert tensors["model.layers.0.self_attn.A_log"].shape == (1, 1, 4, 1)
    assert tensors["model.layers.0.self_attn.q_conv1d.weight"].shape == (64, 1, 4)
    flat = {n: t.reshape(-1) if n.endswith("A_log") else t.squeeze(1) if n.endswith("_conv1d.weight") else t
            for n, t in tensors.items()}
    published = load_model(write(tmp_path / "published", tensors=tensors))
    assert_same_params(published, load_model(write(tmp_path / "flat", tensors=flat)))
    loaded, conv = params(published), "model.layers.0.self_attn.q_conv1d.weight"
    assert loaded["model.layers.0.self_attn.A_log"].shape == (4,)
    assert torch.equal(loaded[conv], flat[conv])


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_dtype_cast_keeps_fp32_params(tmp_path, dtype):
    want = getattr(torch, dtype)
    loaded = params(load_model(write(tmp_path, family_config("k3"), state_dict("k3")), dtype=dtype))
    fp32 = ("A_log", "dt_bias", "_conv1d.weight", "block_sparse_moe.gate.weight", "gate.e_score_correction_bias")
    for suffix in fp32:
        assert any(n.endswith(suffix) for n in loaded), suffix
    for name, p in loaded.items():
        assert p.dtype == (torch.float32 if name.endswith(fp32) else want), name
    assert loaded[Q_PROJ].dtype == want and loaded["model.embed_tokens.weight"].dtype == want


def test_resolve_dtype():
    with raises(ValueError, "'int8'", "auto", "float32", "bfloat16", "float16"):
        resolve_dtype("int8")
    assert resolve_dtype("auto", {"dtype": "bfloat16"}) == torch.bfloat16
    assert resolve_dtype("auto", {"torch_dtype": "float16"}) == torch.float16
    assert resolve_dtype("auto", {}) == torch.float32
    assert resolve_dtype("bfloat16") == torch.bfloat16


def test_auto_dtype_follows_checkpoint_config(tmp_path):
    model = load_model(write(tmp_path, tiny_text_config("kimi_linear", dtype="bfloat16")))
    assert params(model)[Q_PROJ].dtype == torch.bfloat16


# ---- config parsing ------------------------------------------------------------------------------------------

def test_config_alias_names():
    ours = dict(num_experts=6, num_experts_per_token=3, num_shared_experts=2, num_expert_group=2,
                moe_renormalize=False)
    hf = dict(num_local_experts=6, num_experts_per_tok=3, n_shared_experts=2, n_group=2, norm_topk_prob=False)
    base = {k: v for k, v in tiny_text_config("kimi_linear").items() if k not in ours}
    a = KimiK3TextConfig.from_dict(base | ours)
    b = KimiK3TextConfig.from_dict(base | hf)
    assert (a.num_experts, a.num_experts_per_token, a.num_shared_experts, a.num_expert_group) == (6, 3, 2, 2)
    assert a.moe_renormalize is False
    assert without_extra(a) == without_extra(b)


def test_linear_attn_config_vs_hf_layer_types():
    lac = {"kda_layers": [1, 2, 4], "full_attn_layers": [3], "num_heads": 2, "head_dim": 8,
           "short_conv_kernel_size": 3}
    ours = parse(linear_attn_config=lac)
    hf = parse(linear_attn_config=None, linear_num_heads=2, linear_head_dim=8, linear_conv_kernel_dim=3,
               layer_types=["linear_attention", "linear_attention", "full_attention", "linear_attention"])
    assert (ours.kda_layers, ours.mla_layers) == ([0, 1, 3], [2])
    assert (ours.kda_num_heads, ours.kda_head_dim, ours.conv_kernel_size) == (2, 8, 3)
    assert without_extra(ours) == without_extra(hf)


def test_kimi_k3_config_with_vision_config(tmp_path):
    text = tiny_text_config("k3")
    config = wrap_k3(text)
    assert "vision_config" in config
    (tmp_path / "config.json").write_text(json.dumps(config))
    k3 = load_config(tmp_path)
    assert k3.model_type == "kimi_k3"
    assert k3.q_lora_rank == 32 and k3.attn_res_block_size == 2 and k3.use_full_rank_gate
    assert dataclasses.replace(k3, model_type="kimi_linear") == KimiK3TextConfig.from_dict(text)


def test_layer_listed_twice():
    lac = {"kda_layers": [1, 1, 2, 3], "full_attn_layers": [4], "num_heads": 4, "head_dim": 16}
    with raises(InconsistentLayersError, "kda_layers lists layers [1] more than once"):
        parse(linear_attn_config=lac)


@pytest.mark.parametrize("content, fragment", [
    ("[1, 2]", "must hold a JSON object"),
    ('{"model_type": "kimi_k3", "text_config": null}', "'text_config'"),
    ('{"model_type": "kimi_linear", "vocab_size": 8, "num_hidden_layers": 1}', "'hidden_size'"),
])
def test_malformed_config_json(tmp_path, content, fragment):
    (tmp_path / "config.json").write_text(content)
    with raises(CheckpointError, fragment):
        load_model(tmp_path)


def test_malformed_index_json(tmp_path):
    write(tmp_path, shards=2)
    (tmp_path / "model.safetensors.index.json").write_text('{"metadata": {}}')
    with raises(CheckpointError, "model.safetensors.index.json", "weight_map"):
        load_model(tmp_path)


# ---- hostile or broken files -----------------------------------------------------------------------------------

def test_index_cannot_reach_outside_the_model_directory(tmp_path):
    model = write(tmp_path / "model", shards=2)
    secret = tmp_path / "secret.safetensors"
    secret.write_bytes((model / next(p.name for p in model.glob("*.safetensors"))).read_bytes())
    index = model / "model.safetensors.index.json"
    data = json.loads(index.read_text())
    data["weight_map"] = {k: "../secret.safetensors" for k in data["weight_map"]}
    index.write_text(json.dumps(data))
    with raises(CheckpointError, "'../secret.safetensors'", "inside"):
        load_model(model)


def hf_cache_snapshot(src: Path, hub: Path, name: str = "models--org--tiny") -> Path:
    """`src`'s files as the Hugging Face cache keeps them: the bytes in models--org--name/blobs/<sha256>, and
    snapshots/<rev>/<file> a relative symlink to ../../blobs/<sha256>."""
    repo, snapshot = hub / name, hub / name / "snapshots" / "0123abcd"
    (repo / "blobs").mkdir(parents=True)
    snapshot.mkdir(parents=True)
    for f in src.iterdir():
        digest = hashlib.sha256(f.read_bytes()).hexdigest()
        shutil.copy(f, repo / "blobs" / digest)
        (snapshot / f.name).symlink_to(Path("..", "..", "blobs", digest))
    return snapshot


def test_sharded_checkpoint_in_the_hugging_face_cache_layout_loads(tmp_path):
    src = write(tmp_path / "src", shards=2)
    snapshot = hf_cache_snapshot(src, tmp_path / "hub")
    assert (snapshot / "config.json").is_symlink() and (snapshot / "model.safetensors.index.json").is_symlink()
    assert_same_params(load_model(snapshot), load_model(src))


@pytest.mark.parametrize("victim", ["model-00001-of-00002.safetensors", "config.json"])
def test_symlinks_leading_out_of_the_cache_root_are_refused(tmp_path, victim):
    src = write(tmp_path / "src", shards=2)
    snapshot = hf_cache_snapshot(src, tmp_path / "hub")
    other = hf_cache_snapshot(src, tmp_path / "hub", "models--someone--else")  # another model's blobs: outside
    (snapshot / victim).unlink()
    (snapshot / victim).symlink_to(Path("..", "..", "..", "models--someone--else", "snapshots", other.name, victim))
    with raises(CheckpointError, victim, "not a file inside", str(snapshot)):
        load_model(snapshot)


@pytest.mark.parametrize("damage", ["truncated", "empty", "garbage"])
def test_broken_safetensors_name_the_file(tmp_path, damage):
    write(tmp_path)
    path = tmp_path / "model.safetensors"
    data = path.read_bytes()
    path.write_bytes({"truncated": data[:len(data) // 2], "empty": b"", "garbage": b"\x00not a checkpoint" * 9}
                     [damage])
    with raises(CheckpointError, str(path), "not a readable safetensors file"):
        load_model(tmp_path)


@pytest.mark.parametrize("field, value, fragment", [
    ("hidden_size", -64, "hidden_size must be a positive integer, got -64"),
    ("hidden_size", "64", "hidden_size must be a positive integer, got '64'"),
    ("rms_norm_eps", "tiny", "rms_norm_eps must be a positive number, got 'tiny'"),
    ("num_experts", 0, "num_experts must be a positive integer"),
    ("tie_word_embeddings", "no", "tie_word_embeddings must be true or false"),
    ("eos_token_id", "2", "eos_token_id must be a token id"),
])
def test_wrong_typed_config_fields_name_the_file_and_field(tmp_path, field, value, fragment):
    write(tmp_path, config=tiny_text_config("kimi_linear", **{field: value}))
    with raises(CheckpointError, str(tmp_path / "config.json"), fragment):
        load_config(tmp_path)


# ---- --load-format dummy ---------------------------------------------------------------------------------------
def config_only(path: Path, config: dict | None = None) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config or family_config("kimi_linear")))
    return path


def test_dummy_weights_need_only_config_json(tmp_path):
    """A directory with config.json and no safetensors loads with load_format='dummy': every parameter filled
    (no NaN, no uninitialised storage), the same per seed and different across seeds; a forward runs finite."""
    d = config_only(tmp_path / "m")
    a, b = load_model(d, "float32", load_format="dummy", seed=1), load_model(d, "float32", load_format="dummy", seed=1)
    assert_same_params(a, b)
    c = load_model(d, "float32", load_format="dummy", seed=2)
    assert not torch.equal(params(a)[Q_PROJ], params(c)[Q_PROJ])
    for name, p in params(a).items():
        assert torch.isfinite(p).all(), name
    assert (params(a)["model.norm.weight"] == 1).all(), "norm gains start at one"
    with raises(CheckpointNotFoundError, "no weights"):
        load_model(d, "float32")  # the default format still wants the checkpoint


def test_dummy_routing_spreads_over_the_experts(tmp_path):
    """The reason dummy weights are not upstream's U(-1e-3, 1e-3): tokens must pick many different experts, as a
    trained model's do, or a MoE benchmark would read a handful of experts per step."""
    cfg = family_config("kimi_linear")
    model = load_model(config_only(tmp_path / "m", cfg), "float32", load_format="dummy", seed=0)
    moe = next(layer.block_sparse_moe for layer in model.model.layers if hasattr(layer, "block_sparse_moe"))
    x = model.model.embed_tokens(torch.randint(0, cfg["vocab_size"], (64,), generator=torch.Generator().manual_seed(0)))
    _, ids = moe.gate(x)
    E, k = moe.gate.weight.shape[0], ids.shape[1]
    assert ids.unique().numel() >= min(E, 4 * k), (ids.unique().numel(), E, k)
    first = ids[:, 0]
    assert first.unique().numel() > 1, "different tokens choose different top experts"


def test_unknown_load_format_is_refused_by_name(tmp_path):
    with raises(ValueError, "load_format='pt'", "auto, safetensors, dummy"):
        load_model(config_only(tmp_path / "m"), "float32", load_format="pt")
