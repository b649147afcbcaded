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
from paged_jax.models.config import ModelConfig, model_config_from_hf
from paged_jax.models.weights import DenseLinear

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


def load_tensors(folder: Path, names: dict[str, tuple]) -> dict[str, np.ndarray]:
    """Read the named tensors, checking presence and shape."""
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
                    out[n] = h.get_tensor(n)
        except ModelLoadError:
            raise
        except Exception as e:
            raise ModelLoadError(f"{f}: cannot read tensors (truncated or corrupt?): {e}") from e
    for n, shape in names.items():
        if tuple(out[n].shape) != tuple(shape):
            raise ModelLoadError(f"{files[n]}: tensor {n!r} has shape {tuple(out[n].shape)}, config implies {tuple(shape)}")
    return out


def params_from_tensors(config: ModelConfig, tensors: dict[str, np.ndarray], to_array: Optional[Callable] = None):
    """Build the family's params pytree from HF-named tensors, cast to the config's dtype."""
    import jax.numpy as jnp

    dtype = jnp.dtype(config.dtype)
    to_array = to_array or (lambda x: jnp.asarray(np.asarray(x).astype(dtype)))

    def get(name):
        return to_array(tensors[name])

    def lin(prefix, parallel):  # HF Linear is [out, in]; we keep [in, out]
        w = to_array(np.ascontiguousarray(tensors[prefix + ".weight"].T))
        return DenseLinear(w, get(prefix + ".bias") if prefix + ".bias" in tensors else None, parallel)

    return FAMILIES[config.family].params_from_hf(config, get, lin)


def load_model(path, dtype: str = "auto"):
    """Return (ModelConfig, params) for a model folder."""
    folder = Path(path)
    config = load_config(folder, dtype)
    names = FAMILIES[config.family].hf_tensor_shapes(config)
    tensors = load_tensors(folder, names)
    return config, params_from_tensors(config, tensors)
