"""Bad model folders get clear errors; sharded safetensors load like single files."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

from paged_jax.errors import ModelLoadError
from paged_jax.models.loader import load_model


def copy(src, dst):
    shutil.copytree(src, dst)
    return dst


def test_missing_folder(tmp_path):
    with pytest.raises(ModelLoadError, match="not a directory"):
        load_model(tmp_path / "nope")


def test_missing_config(tmp_path, tiny_llama_dir):
    d = copy(tiny_llama_dir, tmp_path / "m")
    (d / "config.json").unlink()
    with pytest.raises(ModelLoadError, match="no config.json"):
        load_model(d)


def test_malformed_config(tmp_path, tiny_llama_dir):
    d = copy(tiny_llama_dir, tmp_path / "m")
    (d / "config.json").write_text("{not json")
    with pytest.raises(ModelLoadError, match="malformed JSON"):
        load_model(d)


def test_config_missing_field(tmp_path, tiny_llama_dir):
    d = copy(tiny_llama_dir, tmp_path / "m")
    cfg = json.loads((d / "config.json").read_text())
    del cfg["hidden_size"]
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError, match="hidden_size"):
        load_model(d)


def test_unknown_architecture(tmp_path, tiny_llama_dir):
    d = copy(tiny_llama_dir, tmp_path / "m")
    cfg = json.loads((d / "config.json").read_text())
    cfg["architectures"] = ["MambaForCausalLM"]
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError, match=r"MambaForCausalLM.*supported.*LlamaForCausalLM"):
        load_model(d)


def test_unsupported_rope_type(tmp_path, tiny_llama_dir):
    d = copy(tiny_llama_dir, tmp_path / "m")
    cfg = json.loads((d / "config.json").read_text())
    cfg["rope_scaling"] = {"rope_type": "mrope", "factor": 2.0}
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError, match="rope type 'mrope' is not supported; supported: .*'dynamic', .*'longrope'"):
        load_model(d)
    cfg["rope_scaling"] = {"rope_type": "yarn", "factor": 2.0}
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError, match="rope scaling 'yarn' needs 'original_max_position_embeddings'"):
        load_model(d)


def test_pickled_weights_refused_without_unpickling(tmp_path, tiny_llama_dir):
    d = copy(tiny_llama_dir, tmp_path / "m")
    (d / "model.safetensors").unlink()
    # A pickle that would run code if loaded: the loader must never open it.
    (d / "pytorch_model.bin").write_bytes(b"cos\nsystem\n(S'touch " + str(tmp_path / "pwned").encode() + b"'\ntR.")
    with pytest.raises(ModelLoadError, match="(?s)pickled.*safetensors"):
        load_model(d)
    assert not (tmp_path / "pwned").exists()


def test_no_weights(tmp_path, tiny_llama_dir):
    d = copy(tiny_llama_dir, tmp_path / "m")
    (d / "model.safetensors").unlink()
    with pytest.raises(ModelLoadError, match="no model.safetensors"):
        load_model(d)


def test_truncated_safetensors(tmp_path, tiny_llama_dir):
    d = copy(tiny_llama_dir, tmp_path / "m")
    data = (d / "model.safetensors").read_bytes()
    (d / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(ModelLoadError, match="model.safetensors"):
        load_model(d)


def test_wrong_shape(tmp_path, tiny_llama_dir):
    d = copy(tiny_llama_dir, tmp_path / "m")
    cfg = json.loads((d / "config.json").read_text())
    cfg["intermediate_size"] = 100
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError, match="shape"):
        load_model(d)


def test_sharded_checkpoint_loads_identically(tmp_path, tiny_llama_dir):
    from safetensors.numpy import load_file, save_file

    d = copy(tiny_llama_dir, tmp_path / "m")
    tensors = load_file(str(d / "model.safetensors"))
    (d / "model.safetensors").unlink()
    names = sorted(tensors)
    shards = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    weight_map = {}
    for fname, ns in shards.items():
        save_file({n: tensors[n] for n in ns}, str(d / fname))
        weight_map.update({n: fname for n in ns})
    (d / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    _, p_sharded = load_model(d)
    _, p_single = load_model(tiny_llama_dir)
    np.testing.assert_array_equal(np.asarray(p_sharded["layers"][1]["down"].w),
                                  np.asarray(p_single["layers"][1]["down"].w))
    # A missing shard is named.
    (d / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(ModelLoadError, match="model-00002-of-00002"):
        load_model(d)


def test_bad_dtype(tiny_llama_dir):
    with pytest.raises(ValueError, match="dtype"):
        load_model(tiny_llama_dir, dtype="int8")
