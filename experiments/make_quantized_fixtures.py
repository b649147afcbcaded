"""Make the GPTQ, AWQ and vLLM-fp8 test fixtures (tests/fixtures/quantized/), once.

GPTQ and AWQ: GPTQModel is the quantizer and its load-back is the oracle. vLLM's own fp8 format
(``quant_method: fp8``) has no CPU writer among the quantizers (GPTQModel's ``fp8`` method divides
by its ``weight_scale_inv``, the inverse of vLLM's layout), so it is written here in the documented
layout (e4m3 ``weight`` with ``weight_scale`` per tensor or ``weight_scale_inv`` per block, both
multipliers) and the oracle is transformers' own fp8 loading (on a CPU it dequantizes each weight
with its scales). Their dependencies (GPTQModel's numpy pin, torchao, accelerate) are too heavy for
the test extra, so this runs in an environment of its own and its outputs are committed:

    python3 -m venv /tmp/quant-venv
    /tmp/quant-venv/bin/pip install torch==2.13.0 gptqmodel==7.6.0 jax==0.10.2 jaxlib==0.10.2
    GPTQMODEL_CPU_WORKERS=2 /tmp/quant-venv/bin/python experiments/make_quantized_fixtures.py

(jax only because the tiny models' tokenizer comes from paged_jax.models.tiny.) About a minute per
fixture on 2 CPU cores. Each fixture folder holds the quantized checkpoint as GPTQModel saved it
(config.json, model.safetensors, tokenizer) and ``oracle.npz``, GPTQModel's own load-back of that
folder in float32 (its torch kernels, ``BACKEND.TORCH`` / ``BACKEND.AWQ_TORCH``; for fp8,
transformers'):

- ``tokens_<i>``: greedy continuation of ``PROMPTS[i]`` (``NEW_TOKENS`` tokens);
- ``logprobs_<i>``: teacher-forced log-probability of each token of prompt + continuation after
  the first, given those before it;
- ``<module>``: the float weight ``[in, out]`` the library dequantizes ``ORACLE_MODULE`` to.

``gptq-v1-zero-borrow.npz``: GPTQModel's v1 zeros where a zero of 0 borrows from its neighbour.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("GPTQMODEL_CPU_WORKERS", "2")

OUT = ROOT / "tests" / "fixtures" / "quantized"
PROMPTS = [[1, 5, 9, 33, 77, 100, 200], [1, 40, 41, 42], [1, 300, 301, 302, 303, 304, 305, 306, 307]]
NEW_TOKENS = 12
ORACLE_MODULE = "model.layers.0.mlp.down_proj"  # in 256: two groups of 128

# Wide enough for group size 128 (down_proj's input is 256), small enough to commit: 2 layers,
# hidden 128, vocabulary 512.
TINY = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=512, initializer_range=0.15)
VARIANTS = {"llama_q": ("LlamaConfig", dict(TINY, tie_word_embeddings=False)),
            "qwen2_q": ("Qwen2Config", dict(TINY, tie_word_embeddings=True))}

# name -> (variant, method, QuantizeConfig arguments)
FIXTURES = {
    # activation order with asymmetric zeros, the v1 "zeros minus one" format
    "gptq-llama-w4g128-act": ("llama_q", "gptq", dict(bits=4, group_size=128, desc_act=True, sym=False)),
    # 8 bits, one group per output channel, symmetric; another family (Q/K/V biases, tied embeddings)
    "gptq-qwen2-w8ch": ("qwen2_q", "gptq", dict(bits=8, group_size=-1, desc_act=False, sym=True)),
    # the v2 format (zeros as they are), groups of 64
    "gptq-llama-w4g64-v2": ("llama_q", "gptq", dict(bits=4, group_size=64, desc_act=False, sym=False,
                                                    format="gptq_v2")),
    # zero_point: true (GPTQModel writes AWQ's zero_point as "not sym")
    "awq-llama-w4g128": ("llama_q", "awq", dict(bits=4, group_size=128, sym=False)),
    # zero_point: false, its qzeros all the midpoint 8
    "awq-qwen2-w4g64": ("qwen2_q", "awq", dict(bits=4, group_size=64, sym=True)),
    # vLLM's fp8: 2-D blocks of 64 x 64 (transformers' dequantization needs blocks that divide the
    # weight; the tiny K/V projections are 64 rows), and one scale per tensor on the other family
    "fp8-llama-block64": ("llama_q", "fp8", dict(block=(64, 64))),
    "fp8-qwen2-tensor": ("qwen2_q", "fp8", dict(block=None)),
}


def calibration_data(src: Path, n: int = 64, chars: int = 400) -> list:
    """Windows of the bundled corpus, tokenized here (the tiny tokenizers, not GPTQModel's own)."""
    import transformers

    tok = transformers.AutoTokenizer.from_pretrained(src)
    import argparse as stdlib_source

    text = Path(stdlib_source.__file__).read_text()  # any plain text will do; this one ships with Python
    ids = [tok(text[i * chars:(i + 1) * chars])["input_ids"] for i in range(n)]
    return [{"input_ids": [x], "attention_mask": [[1] * len(x)]} for x in ids]


def float_model(variant: str, work: Path) -> Path:
    from tests import hf_models

    hf_models.HF_VARIANTS.update(VARIANTS)
    out = work / f"{variant}-float"
    if not out.exists():
        hf_models.make_hf_model(variant, out)
    return out


def quantize(src: Path, method: str, args: dict, out: Path) -> None:
    import torch
    from gptqmodel import BACKEND, GPTQModel, QuantizeConfig
    from gptqmodel.quantization import FORMAT, METHOD

    if method == "awq":
        qcfg = QuantizeConfig(method=METHOD.AWQ, format=FORMAT.GEMM, **args)
    else:
        # GPTQModel's group-aware reordering needs groups; -1 is one group per output channel
        qcfg = QuantizeConfig(**args, act_group_aware=args["group_size"] > 0 and not args["desc_act"])
    # float16 for the float tensors too: the torch kernels of the load-back take float16 or bfloat16,
    # and float16 holds float16 scales exactly
    model = GPTQModel.load(str(src), qcfg, device="cpu", dtype=torch.float16)
    # on a CPU, AWQ's packing needs its torch kernel named
    model.quantize(calibration_data(src), batch_size=8, backend=BACKEND.AWQ_TORCH if method == "awq" else BACKEND.AUTO)
    if out.exists():
        shutil.rmtree(out)
    model.save(str(out))
    for junk in ("quant_log.csv",):
        (out / junk).unlink(missing_ok=True)


def write_vllm_fp8(src: Path, out: Path, block) -> None:
    """The float folder ``src`` with every decoder linear in vLLM's fp8 layout: e4m3 values of
    ``w / s`` with ``s = max|w| / 448`` per tensor (``weight_scale``, a scalar) or per
    ``block`` of ``[out, in]`` (``weight_scale_inv``, ``[out / bo, in / bi]``); the rest float16."""
    import torch
    from safetensors.torch import load_file, save_file

    if out.exists():
        shutil.rmtree(out)
    shutil.copytree(src, out)
    tensors = {}
    for name, w in load_file(str(src / "model.safetensors")).items():
        if not (name.startswith("model.layers.") and name.endswith("_proj.weight")):
            tensors[name] = w.to(torch.float16)
            continue
        w = w.float()
        prefix = name[:-len("weight")]
        if block is None:
            s = w.abs().amax() / 448
            tensors[name] = (w / s).to(torch.float8_e4m3fn)
            tensors[prefix + "weight_scale"] = s.reshape(())
        else:
            (bo, bi), (o, i) = block, w.shape
            s = w.reshape(o // bo, bo, i // bi, bi).abs().amax((1, 3)) / 448
            tensors[name] = (w / s.repeat_interleave(bo, 0).repeat_interleave(bi, 1)).to(torch.float8_e4m3fn)
            tensors[prefix + "weight_scale_inv"] = s
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((out / "config.json").read_text())
    config["torch_dtype"] = "float16"
    config["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "dynamic",
                                     **({} if block is None else {"weight_block_size": list(block)})}
    (out / "config.json").write_text(json.dumps(config, indent=2))


def fp8_oracle(folder: Path) -> dict:
    """transformers' fp8 loading (on a CPU: each weight dequantized with its scales, in float32 here).
    It reads ``weight_scale_inv`` alone, so a per-tensor folder is read through a copy whose
    ``weight_scale`` tensors carry that name (the same multiplier)."""
    import tempfile

    import numpy as np
    import torch
    import transformers
    from safetensors.torch import load_file, save_file

    with tempfile.TemporaryDirectory() as tmp:
        view = Path(tmp) / "view"
        shutil.copytree(folder, view)
        state = load_file(str(view / "model.safetensors"))
        save_file({k[:-len("weight_scale")] + "weight_scale_inv" if k.endswith(".weight_scale") else k: v
                   for k, v in state.items()}, str(view / "model.safetensors"), metadata={"format": "pt"})
        model = transformers.AutoModelForCausalLM.from_pretrained(view, dtype=torch.float32).eval()
    module = model.get_submodule(ORACLE_MODULE)
    out = {"kernel": np.array(type(module).__name__), ORACLE_MODULE: module.weight.detach().float().T.numpy()}
    out.update(_greedy_and_logprobs(model))
    return out


def _greedy_and_logprobs(model, prefix: str = "") -> dict:
    import numpy as np
    import torch

    out = {}
    with torch.no_grad():
        for i, prompt in enumerate(PROMPTS):
            ids = list(prompt)
            for _ in range(NEW_TOKENS):  # greedy, the whole sequence each step (tiny model)
                ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
            logits = model(torch.tensor([ids])).logits[0, :-1].float()
            logp = torch.log_softmax(logits, -1)[torch.arange(len(ids) - 1), torch.tensor(ids[1:])]
            out[f"{prefix}tokens_{i}"] = np.array(ids[len(prompt):], dtype=np.int32)
            out[f"{prefix}logprobs_{i}"] = logp.numpy().astype(np.float32)
    return out


def oracle(folder: Path, method: str) -> dict:
    import numpy as np
    import torch
    from gptqmodel import BACKEND, GPTQModel
    from gptqmodel.quantization.awq.utils.packing_utils import dequantize_gemm

    backend = BACKEND.AWQ_TORCH if method == "awq" else BACKEND.TORCH
    # loaded as saved (float16: exact), then run in float32, as paged-jax's tests run
    wrapped = GPTQModel.load(str(folder), device="cpu", backend=backend, dtype=torch.float16)
    model = wrapped.model.float().eval()
    module = model.get_submodule(ORACLE_MODULE)
    out = {"kernel": np.array(type(module).__name__)}
    if method == "gptq":
        out.update(_greedy_and_logprobs(model))
        with torch.no_grad():
            out[ORACLE_MODULE] = module.dequantize_weight().float().numpy()  # [in, out]
        return out
    # AWQ's torch kernel computes in float16 whatever its input: its outputs are kept as
    # "fp16_kernel_*", and the float32 oracle runs each linear on the weight the library's own
    # dequantize_gemm makes, in float32
    out.update(_greedy_and_logprobs(model, "fp16_kernel_"))

    def float32_dequantized(m):
        def forward(x):
            w = dequantize_gemm(m.qweight, m.qzeros, m.scales.float(), m.bits, m.group_size)
            y = x.float() @ w
            return y if m.bias is None else y + m.bias.float()
        return forward

    quantized = [m for m in model.modules() if type(m).__name__ == out["kernel"]]
    for m in quantized:
        m.forward = float32_dequantized(m)
    out.update(_greedy_and_logprobs(model))
    out[ORACLE_MODULE] = dequantize_gemm(module.qweight, module.qzeros, module.scales.float(), module.bits,
                                         module.group_size).numpy()
    return out


def v1_zero_borrow_case() -> dict:
    """GPTQ v1's "minus one" applied by GPTQModel's own v2 -> v1 conversion to zeros of which some
    are 0 (the random fixtures have none: a zero of 0 needs a group with no negative weight), so
    that one nibble borrows from the next. From the v2 fixture's ``ORACLE_MODULE``: its tensors, the
    v1 ``qzeros`` GPTQModel writes for them, and the weight GPTQModel dequantizes (v2 zeros)."""
    import numpy as np
    import torch
    from gptqmodel import BACKEND, GPTQModel
    from gptqmodel.utils.model import convert_gptq_v1_to_v2_format_module, convert_gptq_v2_to_v1_format_module

    wrapped = GPTQModel.load(str(OUT / "gptq-llama-w4g64-v2"), device="cpu", backend=BACKEND.TORCH,
                             dtype=torch.float16)
    module = wrapped.model.float().get_submodule(ORACLE_MODULE)
    with torch.no_grad():
        module.qzeros[0] &= ~0xF  # the first zero of every word of group 0
        module.qzeros[1] &= ~0xF0F  # and two per word of group 1
        v2 = module.qzeros.clone()
        out = {"qweight": module.qweight.numpy().copy(), "scales": module.scales.float().numpy(),
               "g_idx": module.g_idx.numpy().copy(), "v2_qzeros": v2.numpy(),
               "dequantized": module.dequantize_weight().float().numpy()}
        convert_gptq_v2_to_v1_format_module(module, wrapped.quantize_config)
        out["v1_qzeros"] = module.qzeros.numpy().copy()
        convert_gptq_v1_to_v2_format_module(module, 4, torch.int32)
        assert torch.equal(module.qzeros, v2), "GPTQModel's own v1 -> v2 did not restore its zeros"
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", nargs="*", help="fixture names (default: all)")
    ap.add_argument("--work", default="/tmp/quantized-fixtures-work", help="where the float models go")
    a = ap.parse_args()
    import numpy as np
    import torch

    torch.set_num_threads(2)
    work = Path(a.work)
    work.mkdir(parents=True, exist_ok=True)
    os.chdir(work)  # GPTQModel writes its run logs into the working directory
    for name, (variant, method, args) in FIXTURES.items():
        if a.only and name not in a.only:
            continue
        t = time.time()
        folder = OUT / name
        if method == "fp8":
            write_vllm_fp8(float_model(variant, work), folder, args["block"])
            np.savez_compressed(folder / "oracle.npz", **fp8_oracle(folder))
        else:
            quantize(float_model(variant, work), method, args, folder)
            np.savez_compressed(folder / "oracle.npz", **oracle(folder, method))
        qc = json.loads((folder / "config.json").read_text())["quantization_config"]
        print(f"{name}: {time.time() - t:.0f} s, {sum(f.stat().st_size for f in folder.iterdir()) / 1e3:.0f} kB, "
              f"quant_method={qc.get('quant_method')} format={qc.get('checkpoint_format', qc.get('version'))}")
    if not a.only or "gptq-v1-zero-borrow" in a.only:
        np.savez_compressed(OUT / "gptq-v1-zero-borrow.npz", **v1_zero_borrow_case())


if __name__ == "__main__":
    main()
