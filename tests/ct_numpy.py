"""An oracle for compressed-tensors checkpoints that shares no code with paged_jax's loader or
compressed-tensors' decompressors: the stored integers / fp8 values, scales and zero points read
from the safetensors bytes and dequantized with numpy here, loaded as float weights into the
transformers torch model; activations quantized per token, as the checkpoint's config says, by
forward hooks written here. The format (compressed-tensors' documented layout): ``w = (q - zero) *
scale``, the scale per tensor, output channel, group of inputs or 2-D block; ``pack-quantized``
values and zero points densely packed in int32 words, value i at bit i * bits of the
little-endian bit stream, stored plus 2 ** (bits - 1).
"""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path

import ml_dtypes
import numpy as np

_DTYPES = {"F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16, "I64": np.int64, "I32": np.int32,
           "I8": np.int8, "U8": np.uint8, "F8_E4M3": ml_dtypes.float8_e4m3fn}


def read_safetensors(path) -> dict[str, np.ndarray]:
    """Every tensor of a ``.safetensors`` file (8-byte header length, JSON header, raw little-endian data)."""
    raw = Path(path).read_bytes()
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8:8 + n])
    header.pop("__metadata__", None)
    data = raw[8 + n:]
    return {name: np.frombuffer(data[t["data_offsets"][0]:t["data_offsets"][1]], _DTYPES[t["dtype"]])
            .reshape(t["shape"]) for name, t in header.items()}


def unpack_int32(packed: np.ndarray, bits: int, count: int, axis: int) -> np.ndarray:
    """``count`` signed ``bits``-bit values along ``axis`` of ``packed`` (int32 words)."""
    words = np.ascontiguousarray(np.moveaxis(packed, axis, -1).astype("<i4"))
    stream = np.unpackbits(words.view(np.uint8), axis=-1, bitorder="little")[..., :count * bits]
    fields = stream.reshape(*words.shape[:-1], count, bits).astype(np.int64)
    values = (fields << np.arange(bits)).sum(-1) - (1 << (bits - 1))
    return np.moveaxis(values, -1, axis)


def _expand(per: np.ndarray, shape, args: dict) -> np.ndarray:
    """A scale or zero point of ``args``' strategy spread over a weight of ``shape`` (out, in)."""
    out_f, in_f = shape
    strategy = args["strategy"]
    if strategy == "tensor":
        return np.broadcast_to(per.reshape(1, 1), shape)
    if strategy == "channel":
        return np.broadcast_to(per.reshape(out_f, 1), shape)
    if strategy == "group":
        return np.repeat(per, args["group_size"], axis=1)[:, :in_f]
    if strategy == "block":
        bo, bi = args["block_structure"]
        return np.repeat(np.repeat(per, bo, axis=0), bi, axis=1)[:out_f, :in_f]
    raise AssertionError(f"strategy {strategy!r}")


def dequantize(stored: dict[str, np.ndarray], args: dict) -> np.ndarray:
    """One module's float32 weight (out, in) from its stored tensors (``weight`` or ``weight_packed``,
    ``weight_scale``, optional ``weight_zero_point``, ``weight_shape``) and its weight args."""
    assert "weight_g_idx" not in stored, "activation order is not read here"
    bits = args["num_bits"]
    if "weight_packed" in stored:
        out_f, in_f = (int(v) for v in stored["weight_shape"])
        q = unpack_int32(stored["weight_packed"], bits, in_f, axis=1)
    else:
        q = stored["weight"]
        out_f, in_f = q.shape
    q = q.astype(np.float64)
    zero = stored.get("weight_zero_point")
    if zero is not None and zero.dtype == np.int32 and "weight_packed" in stored:  # packed along the outputs
        zero = unpack_int32(zero, bits, out_f, axis=0)
    scale = _expand(stored["weight_scale"].astype(np.float64), (out_f, in_f), args)
    zero = 0.0 if zero is None else _expand(zero.astype(np.float64), (out_f, in_f), args)
    return ((q - zero) * scale).astype(np.float32)


def quantize_per_token(x, args: dict):
    """``x`` (torch, float32) through dynamic symmetric per-token quantization and back: the scale
    is each token's largest magnitude over half the type's range ((127 + 128) / 2 for int8, 448
    for fp8 e4m3)."""
    import torch

    assert args["strategy"] == "token" and args["dynamic"] and args["symmetric"] and args["num_bits"] == 8, args
    top = 127.5 if args["type"] == "int" else 448.0
    scale = x.abs().amax(-1, keepdim=True) / top
    scale = torch.where(scale == 0, torch.ones_like(scale), scale)
    if args["type"] == "int":
        q = torch.clamp(torch.round(x / scale), -128, 127)
    else:
        q = torch.clamp(x / scale, -448, 448).to(torch.float8_e4m3fn).float()
    return q * scale


def numpy_dequantized_model(path):
    """The transformers float32 model of the quantized folder ``path``, its quantized weights
    dequantized by :func:`dequantize` and its quantized layers' inputs through
    :func:`quantize_per_token` where the checkpoint quantizes activations."""
    import torch

    from tests.hf_models import float_model

    path = Path(path)
    qc = json.loads((path / "config.json").read_text())["quantization_config"]
    (group,) = qc["config_groups"].values()
    state = read_safetensors(path / "model.safetensors")
    modules = defaultdict(dict)
    floats = {}
    for name, value in state.items():
        module, _, leaf = name.rpartition(".")
        if leaf.startswith("weight_") or (leaf == "weight" and module + ".weight_scale" in state):
            modules[module][leaf] = value
        else:
            floats[name] = torch.from_numpy(value.astype(np.float32))
    for module, stored in modules.items():
        floats[module + ".weight"] = torch.from_numpy(dequantize(stored, group["weights"]))
    model = float_model(path, floats)
    acts = group.get("input_activations")
    if acts:
        for name, m in model.named_modules():
            if name in modules:
                m.register_forward_pre_hook(lambda mod, inputs: (quantize_per_token(inputs[0], acts),))
    return model, sorted(modules)


def without_activation_quantization(path, out) -> Path:
    """A copy of the quantized folder ``path`` in ``out`` whose config quantizes weights alone: the
    same stored values, read with float activations."""
    import shutil

    out = Path(out)
    shutil.copytree(path, out)
    config = json.loads((out / "config.json").read_text())
    for group in config["quantization_config"]["config_groups"].values():
        group["input_activations"] = None
    (out / "config.json").write_text(json.dumps(config))
    return out
