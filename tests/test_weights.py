"""The weights package's extension points: a weight class is sharded by what it declares, a
checkpoint method is one reader and one registry line, and :func:`prepare` is the one step that
readies weights for a platform (the engine's ``native_kernels`` switch included)."""

import dataclasses
import json
import shutil
from typing import Any, Optional

import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from paged_jax import LLM, SamplingParams, native
from paged_jax.parallel.rules import weight_specs
from paged_jax.weights import (CHECKPOINT_METHODS, DenseEmbedding, DenseLinear, PanelLinear, QuantizedLinear,
                               is_weight, prepare, weight_class)
from paged_jax.weights.methods.on_load import quantize_weight

TP = 2


def _spec_fields(weight, tp=TP, **kw) -> dict:
    specs = weight_specs(weight, tp, **kw)
    return {f.name: getattr(specs, f.name) for f in dataclasses.fields(specs) if isinstance(getattr(specs, f.name), P)}


@pytest.mark.parametrize("role, w, b", [("column", P(None, "tp"), P("tp")), ("kv", P(None, "tp"), P("tp")),
                                        ("row", P("tp", None), P()), (None, P(), P())])
def test_dense_and_quantized_linears_shard_as_megatron_says(role, w, b):
    """Column-parallel weights split their outputs (bias too), row-parallel ones their inputs (bias
    whole, added once after the all-reduce); quantized values, scales and zero points alike."""
    dense = DenseLinear(np.zeros((4, 6)), np.zeros(6), parallel=role)
    assert _spec_fields(dense) == {"w": w, "b": b}
    q = QuantizedLinear(np.zeros((4, 6), np.int8), np.zeros((2, 6)), zero=np.zeros((2, 6), np.int8),
                        g_idx=np.zeros(4, np.int32), b=np.zeros(6), in_features_=4, parallel=role)
    assert _spec_fields(q) == {"values": w, "scale": w, "zero": w, "g_idx": P(), "b": b}


def test_a_dimension_the_mesh_does_not_divide_stays_whole_and_kv_can_load_replicated():
    assert _spec_fields(DenseEmbedding(np.zeros((7, 4))))["table"] == P(None, None)  # 7 rows over 2 devices
    assert _spec_fields(DenseEmbedding(np.zeros((8, 4))))["table"] == P("tp", None)
    assert _spec_fields(DenseLinear(np.zeros((4, 6)), parallel="kv"), replicate_kv=True) == {"w": P()}


@weight_class
class ScaledLinear:
    """A format of our own: ``(x @ w) * s``, one scale per output column."""

    STATIC = ("parallel",)
    AXES = {"w": ("in", "out"), "s": ("out",)}
    w: Any
    s: Any
    parallel: Optional[str] = None

    def __call__(self, x):
        return (x @ self.w) * self.s


def test_a_new_weight_class_is_sharded_and_mapped_by_its_declaration_alone():
    layer = ScaledLinear(np.ones((4, 6), np.float32), np.full(6, 2.0, np.float32), parallel="column")
    assert is_weight(layer)
    assert _spec_fields(layer) == {"w": P(None, "tp"), "s": P("tp")}
    assert _spec_fields(dataclasses.replace(layer, parallel="row")) == {"w": P("tp", None), "s": P()}
    np.testing.assert_array_equal(np.asarray(layer(jnp.ones((1, 4)))), np.full((1, 6), 8.0))


def test_a_weight_class_must_declare_fields_it_has():
    with pytest.raises(TypeError, match=r"unknown: \['v'\]"):
        @weight_class
        class Broken:
            STATIC = ("parallel",)
            AXES = {"v": ("in", "out")}
            w: Any
            parallel: Optional[str] = None
    with pytest.raises(TypeError, match="AXES use"):
        @weight_class
        class BadAxis:
            STATIC = ("parallel",)
            AXES = {"w": ("rows", "out")}
            w: Any
            parallel: Optional[str] = None


def test_prepare_stores_panels_only_on_one_cpu_device_with_native_kernels():
    def fresh():  # quantization on load replaces each float weight in place (so each can go as its copy comes)
        return {"layers": [{"up": DenseLinear(jnp.ones((16, 48), jnp.float32))}]}

    quantized = prepare(fresh(), "cpu", quantization="int8", native_kernels=False)
    assert isinstance(quantized["layers"][0]["up"], QuantizedLinear)
    params = fresh()
    assert prepare(params, "cpu", tensor_parallel=True)["layers"][0]["up"] is params["layers"][0]["up"]
    assert prepare(params, "gpu")["layers"][0]["up"] is params["layers"][0]["up"]
    packed = prepare(params, "cpu")["layers"][0]["up"]
    assert isinstance(packed, PanelLinear) == native.packs_weights()


class ToyQuantization:
    """A checkpoint method of our own, as a new format's file would hold it: linears stored as
    ``toy_weight`` (the float weight, HF layout), read as int8 per output channel."""

    @classmethod
    def from_config(cls, qc, where):
        return cls()

    def stores_quantized(self, module, files):
        return module + ".toy_weight" in files

    def scheme_for(self, module):
        return self

    def tensor_shapes(self, module, out, inp, available):
        return {module + ".toy_weight": (out, inp)}

    def linear(self, module, tensors, out, inp, bias, parallel):
        w = jnp.asarray(np.ascontiguousarray(tensors[module + ".toy_weight"].T))
        return quantize_weight(DenseLinear(w, bias, parallel), "int8")


def test_a_checkpoint_method_is_one_reader_and_one_registry_line(tiny_llama_dir, tmp_path, monkeypatch):
    """A checkpoint whose layers' linears are stored under the toy method loads through the
    registry and generates what the same model quantized to int8 on load generates."""
    from safetensors.numpy import load_file, save_file

    folder = tmp_path / "toy"
    shutil.copytree(tiny_llama_dir, folder)
    tensors = load_file(str(folder / "model.safetensors"))
    renamed = {(k[:-len(".weight")] + ".toy_weight" if ".layers." in k and k.endswith("_proj.weight") else k): v
               for k, v in tensors.items()}
    assert sum(k.endswith(".toy_weight") for k in renamed) >= 7
    save_file(renamed, str(folder / "model.safetensors"))
    cfg = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**cfg, "quantization_config": {"quant_method": "toy"}}))

    with pytest.raises(Exception, match="quant_method 'toy' is not supported"):
        LLM(str(folder), dtype="float32", num_kv_blocks=16, max_model_len=64)
    monkeypatch.setitem(CHECKPOINT_METHODS, "toy", ToyQuantization)  # the registry line
    params = SamplingParams(temperature=0, max_tokens=8)
    prompts = ["def add(a, b):", "import os"]
    toy = LLM(str(folder), dtype="float32", num_kv_blocks=16, max_model_len=64)
    got = [o.outputs[0].token_ids for o in toy.generate(prompts, params, use_tqdm=False)]
    on_load = LLM(str(tiny_llama_dir), dtype="float32", num_kv_blocks=16, max_model_len=64, quantization="int8")
    assert got == [o.outputs[0].token_ids for o in on_load.generate(prompts, params, use_tqdm=False)]


def test_native_kernels_false_keeps_plain_weights_and_the_jnp_attention(tiny_llama_dir):
    llm = LLM(str(tiny_llama_dir), dtype="float32", num_kv_blocks=16, max_model_len=64, native_kernels=False)
    runner = llm.llm_engine.runner
    assert runner.attention_backend == "reference"
    assert all(isinstance(w, DenseLinear) for w in runner.params["layers"][0].values() if is_weight(w))
    with pytest.raises(ValueError, match="native_kernels=False"):
        LLM(str(tiny_llama_dir), num_kv_blocks=16, native_kernels=False, attention_backend="native")
    with pytest.raises(ValueError, match="native_kernels must be None, True or False, got 'no'"):
        LLM(str(tiny_llama_dir), native_kernels="no")


def test_the_command_line_passes_native_kernels_and_the_compile_cache_to_the_engine(monkeypatch, tmp_path):
    import paged_jax
    from paged_jax.cli import _llm, build_parser

    seen = {}
    monkeypatch.setattr(paged_jax, "LLM", lambda **kw: seen.update(kw))
    _llm(build_parser().parse_args(["generate", "--no-native-kernels", "--compile-cache-dir", str(tmp_path)]))
    assert seen["native_kernels"] is False and seen["compile_cache_dir"] == str(tmp_path)
    _llm(build_parser().parse_args(["serve"]))
    assert seen["native_kernels"] is None and seen["compile_cache_dir"] is None


def test_compile_cache_dir_puts_the_compiled_steps_in_the_engine_s_folder(tiny_llama_dir, tmp_path, monkeypatch):
    monkeypatch.delenv("PAGED_JAX_NO_COMPILE_CACHE", raising=False)
    monkeypatch.delenv("PAGED_JAX_NO_EXECUTABLE_CACHE", raising=False)
    llm = LLM(str(tiny_llama_dir), dtype="float32", num_kv_blocks=16, max_model_len=64, compile_cache_dir=str(tmp_path))
    llm.generate(["x"], SamplingParams(max_tokens=2), use_tqdm=False)
    assert llm.llm_engine.runner.executable_cache.directory == tmp_path / "executables"
    assert any((tmp_path / "executables").iterdir())
