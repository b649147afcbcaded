"""Load a Hugging Face model folder (config.json + safetensors) into a params pytree.

Only safetensors are read. Pickled ``.bin``/``.pt`` checkpoints are refused:
unpickling runs arbitrary code.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Callable, Optional

import numpy as np

from paged_jax.errors import ModelLoadError
from paged_jax.models import FAMILIES
from paged_jax.models import ModelConfig, model_config_from_hf
from paged_jax.weights import DenseLinear, checkpoint_quantization

PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")


def read_config(path: str | os.PathLike) -> dict:
    folder = Path(path)
    if not folder.is_dir():
        raise ModelLoadError(f"model path {str(folder)!r} is not a directory (expected a Hugging Face model folder)")
    cfg_file = folder / "config.json"
    if not cfg_file.is_file():
        raise ModelLoadError(f"{folder}: no config.json found (files: {sorted(p.name for p in folder.iterdir())[:20]})")
    try:
        return json.loads(cfg_file.read_text())
    except json.JSONDecodeError as e:
        raise ModelLoadError(f"{cfg_file}: malformed JSON: {e}") from e


def load_config(path, dtype: str = "auto") -> ModelConfig:
    return model_config_from_hf(read_config(path), dtype=dtype, where=str(path))


def weight_files(folder: Path) -> dict[str, Path]:
    """Map tensor name -> safetensors file that holds it (sharded or single file)."""
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise ModelLoadError(f"{index}: malformed index (expected a 'weight_map' object): {e}") from e
        files = {name: folder / fname for name, fname in weight_map.items()}
        for f in set(files.values()):
            if not f.is_file():
                raise ModelLoadError(f"{index} names shard {f.name!r}, which is missing")
        return files
    singles = sorted(folder.glob("*.safetensors"))
    if not singles:
        pickled = sorted(p.name for p in folder.iterdir() if p.suffix in PICKLE_SUFFIXES)
        if pickled:
            raise ModelLoadError(
                f"{folder}: found only pickled weights {pickled}; paged-jax never unpickles checkpoints. "
                "Convert them to safetensors first, e.g. in Python with transformers: "
                "AutoModelForCausalLM.from_pretrained(dir).save_pretrained(dir, safe_serialization=True)")
        raise ModelLoadError(f"{folder}: no model.safetensors or model.safetensors.index.json found")
    return {name: f for f in singles for name in _safe_keys(f)}


def _safe_keys(f: Path) -> list[str]:
    from safetensors import safe_open

    try:
        with safe_open(str(f), framework="numpy") as h:
            return list(h.keys())
    except Exception as e:  # safetensors raises its own error types for truncated/corrupt headers
        raise ModelLoadError(f"{f}: cannot read safetensors file (truncated or corrupt?): {e}") from e


FLOAT8 = {"F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2"}  # numpy itself has no float8


def _read_float8(f: Path, name: str, dtype: str) -> np.ndarray:
    """A float8 tensor straight from the file (safetensors' numpy reader refuses them): an
    8-byte header size, a JSON header with each tensor's byte range, then the data."""
    import ml_dtypes

    with open(f, "rb") as fh:
        size = int.from_bytes(fh.read(8), "little")
        info = json.loads(fh.read(size))[name]
    start, end = info["data_offsets"]
    data = np.fromfile(f, dtype=np.uint8, count=end - start, offset=8 + size + start)
    return data.view(getattr(ml_dtypes, FLOAT8[dtype])).reshape(info["shape"])


def load_tensors(folder: Path, names: dict[str, tuple]) -> dict[str, np.ndarray]:
    """Read the named tensors, checking presence and shape (a shape None: any)."""
    from safetensors import safe_open

    files = weight_files(folder)
    missing = [n for n in names if n not in files]
    if missing:
        raise ModelLoadError(f"{folder}: weights lack {len(missing)} tensors, e.g. {missing[:3]}")
    by_file: dict[Path, list[str]] = {}
    for n in names:
        by_file.setdefault(files[n], []).append(n)
    out = {}
    for f, ns in by_file.items():
        try:
            with safe_open(str(f), framework="numpy") as h:
                for n in ns:
                    dt = h.get_slice(n).get_dtype()
                    out[n] = _read_float8(f, n, dt) if dt in FLOAT8 else h.get_tensor(n)
        except ModelLoadError:
            raise
        except Exception as e:
            raise ModelLoadError(f"{f}: cannot read tensors (truncated or corrupt?): {e}") from e
    for n, shape in names.items():
        if shape is not None and tuple(out[n].shape) != tuple(shape):
            raise ModelLoadError(f"{files[n]}: tensor {n!r} has shape {tuple(out[n].shape)}, config implies {tuple(shape)}")
    return out


def params_from_tensors(config: ModelConfig, tensors: dict[str, np.ndarray], to_array: Optional[Callable] = None,
                       quantized_linear: Optional[Callable] = None):
    """Build the family's params pytree from HF-named tensors, cast to the config's dtype.
    ``quantized_linear(prefix, bias, parallel)``: the weight object of a linear the checkpoint
    holds quantized, or None for a float one."""
    import jax.numpy as jnp

    dtype = jnp.dtype(config.dtype)
    to_array = to_array or (lambda x: jnp.asarray(np.asarray(x).astype(dtype)))

    def get(name):
        return to_array(tensors[name])

    def lin(prefix, parallel):  # HF Linear is [out, in]; we keep [in, out]
        bias = get(prefix + ".bias") if prefix + ".bias" in tensors else None
        if quantized_linear is not None:
            q = quantized_linear(prefix, bias, parallel)
            if q is not None:
                return q
        return DenseLinear(to_array(np.ascontiguousarray(tensors[prefix + ".weight"].T)), bias, parallel)

    return FAMILIES[config.family].params_from_hf(config, get, lin)


def load_model(path, dtype: str = "auto"):
    """Return (ModelConfig, params) for a model folder (float, or quantized:
    :mod:`paged_jax.weights.methods`)."""
    folder = Path(path)
    raw = read_config(folder)
    config = model_config_from_hf(raw, dtype=dtype, where=str(folder))
    quant = checkpoint_quantization(raw, str(folder))  # refuses an unsupported format up front
    names = FAMILIES[config.family].hf_tensor_shapes(config)
    if quant is None:
        return config, params_from_tensors(config, load_tensors(folder, names))
    files = weight_files(folder)
    # linear modules stored quantized: their .weight is replaced by the format's tensors
    pending = {n[:-len(".weight")]: shape for n, shape in names.items()
               if n.endswith(".weight") and len(shape) == 2 and quant.stores_quantized(n[:-len(".weight")], files)}
    for module in pending:
        if quant.scheme_for(module) is None:
            raise ModelLoadError(f"{folder}: {module} is stored quantized, but no config group of its "
                                 f"quantization_config targets it (or it is in 'ignore')")
    tensors = load_tensors(folder, {n: s for n, s in names.items() if n[:-len(".weight")] not in pending})

    def quantized_linear(prefix, bias, parallel):
        if prefix not in pending:
            return None
        out, inp = pending.pop(prefix)
        own = load_tensors(folder, quant.tensor_shapes(prefix, out, inp, files))
        return quant.linear(prefix, own, out, inp, bias, parallel)

    def read_as_float(modules):
        return ModelLoadError(f"{folder}: the {config.family} family reads {sorted(modules)[:3]} as float weights "
                              "(fused or embedding tensors), but the checkpoint stores them quantized; "
                              "quantize it with those modules in the quantization_config's 'ignore' list")

    quantized = set(pending)
    try:
        params = params_from_tensors(config, tensors, quantized_linear=quantized_linear)
    except KeyError as e:  # the family asked for the float .weight of a module stored quantized
        module = str(e.args[0]).removesuffix(".weight") if e.args else None
        if module in quantized:
            raise read_as_float([module]) from None
        raise
    if pending:
        raise read_as_float(pending)
    return config, params
