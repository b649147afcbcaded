"""Weights straight into their shards: from safetensors (read per shard) or an orbax checkpoint.

Both paths start from the *abstract* params of a family: the same pytree that
``params_from_hf`` builds, with an :class:`HFTensor` (name, shape, transposed?) at
each leaf instead of an array. The rule table turns it into shardings; then

- safetensors: ``jax.make_array_from_callback`` asks for each device's slice, which is
  read with safetensors' ``get_slice`` (only that slice leaves the file; no device
  ever holds a full copy of a sharded tensor);
- orbax: ``StandardCheckpointer.restore`` with a target of ``ShapeDtypeStruct``s
  carrying the shardings, so each device restores its own slice.

``paged-jax convert --model DIR --out CKPT`` writes CKPT/params (orbax), the
config and tokenizer files of DIR, and a marker file ``paged_jax_checkpoint.json``
by which ``LLM(model=CKPT)`` recognises it.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from contextlib import ExitStack
from pathlib import Path

import numpy as np

from paged_jax.errors import ModelLoadError
from paged_jax.models import FAMILIES
from paged_jax.models.config import ModelConfig
from paged_jax.models.loader import load_config, load_tensors, params_from_tensors, weight_files
from paged_jax.weights import DenseLinear, map_weights
from paged_jax.parallel.rules import param_shardings

MARKER = "paged_jax_checkpoint.json"
FORMAT = "paged-jax-orbax"


@dataclasses.dataclass(frozen=True)
class HFTensor:
    """A leaf of the abstract params: HF tensor ``name``, in paged-jax layout ``shape``."""

    name: str
    shape: tuple
    transpose: bool = False
    first_row: int = 0  # a part of a fused HF tensor: the HF row it starts at

    @property
    def T(self) -> "HFTensor":  # params_from_hf writes ``get("lm_head.weight").T``
        return HFTensor(self.name, self.shape[::-1], not self.transpose, self.first_row)

    def __getitem__(self, key) -> "HFTensor":
        """``get(name).T[:, a:b]``: columns a..b of the transposed tensor, rows a..b of the HF one
        (how a family splits a fused projection, e.g. Phi-3's ``qkv_proj``)."""
        if not (self.transpose and isinstance(key, tuple) and len(key) == 2 and key[0] == slice(None)
                and isinstance(key[1], slice) and key[1].step in (None, 1)):
            raise TypeError(f"{self.name}: a weight can be split only as .T[:, a:b], got {key!r}")
        start, stop, _ = key[1].indices(self.shape[1])
        return HFTensor(self.name, (self.shape[0], stop - start), True, self.first_row + start)

    @staticmethod
    def stacked(parts) -> "HFStack":  # how paged_jax.weights.stack_experts stacks abstract tensors
        return HFStack(tuple(parts))


@dataclasses.dataclass(frozen=True)
class HFStack:
    """A leaf of the abstract params: one :class:`HFTensor` per expert, stacked on a new leading axis."""

    parts: tuple

    @property
    def shape(self) -> tuple:
        return (len(self.parts), *self.parts[0].shape)


def abstract_params(config: ModelConfig):
    hf = FAMILIES[config.family].hf_tensor_shapes(config)

    def get(name):
        return HFTensor(name, tuple(hf[name]))

    def lin(prefix, parallel):
        return DenseLinear(get(prefix + ".weight").T, get(prefix + ".bias") if prefix + ".bias" in hf else None,
                           parallel)

    return FAMILIES[config.family].params_from_hf(config, get, lin)


def is_orbax_checkpoint(path) -> bool:
    return (Path(path) / MARKER).is_file()


def _marker(path) -> dict:
    try:
        info = json.loads((Path(path) / MARKER).read_text())
    except json.JSONDecodeError as e:
        raise ModelLoadError(f"{Path(path) / MARKER}: malformed JSON: {e}") from e
    if info.get("format") != FORMAT:
        raise ModelLoadError(f"{Path(path) / MARKER}: format {info.get('format')!r}, expected {FORMAT!r}")
    return info


def load_config_any(path, dtype: str = "auto") -> ModelConfig:
    """The ModelConfig of a HF folder or of a checkpoint (``auto``: the dtype it was saved in)."""
    if is_orbax_checkpoint(path) and dtype in (None, "auto"):
        dtype = _marker(path)["dtype"]
    return load_config(path, dtype)


def load_sharded(path, config: ModelConfig, mesh, kv_replication: int = 1):
    """Params with their shardings on ``mesh``; ``config`` is the model's own (unreplicated) config."""
    abstract = abstract_params(config)
    shardings = param_shardings(abstract, mesh, replicate_kv=kv_replication > 1)
    if is_orbax_checkpoint(path):
        params = _restore_orbax(Path(path), config, abstract, shardings)
    else:
        params = _load_safetensors(Path(path), config, abstract, shardings)
    if kv_replication > 1:
        params = replicate_kv_heads(params, config, kv_replication, mesh)
    return params


def _load_safetensors(folder: Path, config, abstract, shardings):
    import jax
    from safetensors import safe_open

    dtype = np.dtype(jax.numpy.dtype(config.dtype))
    expected = FAMILIES[config.family].hf_tensor_shapes(config)
    files = weight_files(folder)
    missing = [n for n in expected if n not in files]
    if missing:
        raise ModelLoadError(f"{folder}: weights lack {len(missing)} tensors, e.g. {missing[:3]}")
    with ExitStack() as stack:
        try:
            handles = {f: stack.enter_context(safe_open(str(f), framework="numpy")) for f in set(files.values())}
        except Exception as e:
            raise ModelLoadError(f"{folder}: cannot read safetensors files (truncated or corrupt?): {e}") from e
        for n, shape in expected.items():
            got = tuple(handles[files[n]].get_slice(n).get_shape())
            if got != tuple(shape):
                raise ModelLoadError(f"{files[n]}: tensor {n!r} has shape {got}, config implies {tuple(shape)}")

        def part(t: HFTensor, index: tuple):  # this device's slices of t, in paged-jax layout
            view = handles[files[t.name]].get_slice(t.name)
            if t.transpose:  # 2-D: paged-jax [in, out] is the HF [out, in] transposed
                inputs, outputs = index or (slice(None), slice(None))
                start, stop, _ = outputs.indices(t.shape[1])  # this part's columns: HF rows from first_row
                hf_rows = slice(t.first_row + start, t.first_row + stop)
                return np.ascontiguousarray(view[hf_rows, inputs].T, dtype=dtype)
            return np.ascontiguousarray(view[index] if index else view[:], dtype=dtype)

        def make(t, sharding):
            def read(index):
                index = tuple(index)
                if isinstance(t, HFStack):  # this device's experts, each read as its own tensor
                    experts, rest = (index[0], index[1:]) if index else (slice(None), ())
                    return np.stack([part(t.parts[e], rest) for e in range(len(t.parts))[experts]])
                return part(t, index)

            return jax.make_array_from_callback(t.shape, sharding, read)

        return jax.tree_util.tree_map(make, abstract, shardings)


def _restore_orbax(path: Path, config, abstract, shardings):
    import jax
    import orbax.checkpoint as ocp

    _marker(path)
    dtype = jax.numpy.dtype(config.dtype)
    target = jax.tree_util.tree_map(lambda t, s: jax.ShapeDtypeStruct(t.shape, dtype, sharding=s),
                                    abstract, shardings)
    try:
        return ocp.StandardCheckpointer().restore((path / "params").absolute(), target)
    except Exception as e:
        raise ModelLoadError(f"{path}: cannot restore the orbax checkpoint into the model's params: {e}") from e


def replicate_kv_heads(params, config: ModelConfig, rep: int, mesh):
    """Repeat each KV head ``rep`` times in the ``"kv"`` weights (loaded replicated), then split over heads."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec

    from paged_jax.parallel.rules import AXIS

    COL, COL_BIAS = PartitionSpec(None, AXIS), PartitionSpec(AXIS)  # a "kv" weight's split (its declared out axis)

    kvh, d = config.num_kv_heads, config.head_dim

    def rep_w(w):  # [in, kvh * d] -> [in, kvh * rep * d]; kv head j of the result is original head j // rep
        return jnp.repeat(w.reshape(w.shape[0], kvh, d), rep, axis=1).reshape(w.shape[0], kvh * rep * d)

    def rep_b(b):
        return jnp.repeat(b.reshape(kvh, d), rep, axis=0).reshape(kvh * rep * d)

    fw = jax.jit(rep_w, out_shardings=NamedSharding(mesh, COL))
    fb = jax.jit(rep_b, out_shardings=NamedSharding(mesh, COL_BIAS))

    def repeat_heads(x):
        if isinstance(x, DenseLinear) and x.parallel == "kv":
            return dataclasses.replace(x, w=fw(x.w), b=None if x.b is None else fb(x.b))
        return x

    return map_weights(repeat_heads, params)


def convert(model_dir, out, dtype: str = "auto") -> Path:
    """Write the HF model folder ``model_dir`` as a paged-jax orbax checkpoint at ``out``."""
    import jax.numpy as jnp
    import orbax.checkpoint as ocp

    src, out = Path(model_dir), Path(out).absolute()
    config = load_config(src, dtype)
    if out.exists() and any(out.iterdir()):
        raise ValueError(f"--out {str(out)!r} exists and is not empty; give a new folder")
    names = FAMILIES[config.family].hf_tensor_shapes(config)
    tensors = load_tensors(src, names)
    np_dtype = np.dtype(jnp.dtype(config.dtype))
    params = params_from_tensors(config, tensors, to_array=lambda x: np.asarray(x).astype(np_dtype))
    out.mkdir(parents=True, exist_ok=True)
    ckptr = ocp.StandardCheckpointer()
    ckptr.save(out / "params", params)
    ckptr.wait_until_finished()
    weights = set(weight_files(src).values())
    for f in src.iterdir():  # config, tokenizer and generation files travel with the checkpoint
        if f.is_file() and f not in weights and f.name != "model.safetensors.index.json":
            shutil.copy2(f, out / f.name)
    (out / MARKER).write_text(json.dumps({"format": FORMAT, "version": 1, "family": config.family,
                                          "dtype": config.dtype}, indent=1))
    return out
