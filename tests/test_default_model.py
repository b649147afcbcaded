"""The bundled default model: trained (not random), equal to transformers, and its training
script writes a folder both load the same way (a smoke run, not the real training)."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from paged_jax import LLM, SamplingParams
from paged_jax.models.tiny import default_model_path

ROOT = Path(__file__).resolve().parent.parent

PROMPTS = ["def __init__(self, ", "import os\nimport sys\n", "    def __repr__(self):\n        return "]


def _greedy_hf(folder, prompts, n):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    out = []
    for p in prompts:
        ids = tok(p, return_tensors="pt").input_ids
        gen = model.generate(ids, max_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0)
        out.append(gen[0, ids.shape[1]:].tolist())
    return out


def _greedy_engine(folder, prompts, n):
    llm = LLM(str(folder), max_model_len=256)
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
    return [list(o.outputs[0].token_ids) for o in outs]


def test_default_model_is_bundled_and_equal_to_transformers():
    folder = default_model_path()
    assert (folder / "model.safetensors").is_file() and (folder / "README.md").is_file()
    assert _greedy_engine(folder, PROMPTS, 24) == _greedy_hf(folder, PROMPTS, 24)


def test_default_model_perplexity_equals_transformers_and_stays_near_its_measured_value():
    """Teacher-forced logprobs of held-out text through the engine's prompt logprobs against
    transformers' (torch, float32) on the same windows, and the perplexity near what the trained
    model measures (a random model's is about its vocabulary size, 4096)."""
    import numpy as np
    import torch
    from transformers import AutoModelForCausalLM

    folder = str(default_model_path())
    windows = json.loads((ROOT / "tests" / "fixtures" / "default_model_heldout_windows.json").read_text())["windows"]
    llm = LLM(folder, dtype="float32", max_model_len=len(windows[0]) + 1)
    outs = llm.generate(prompt_token_ids=windows, use_tqdm=False,
                        sampling_params=SamplingParams(max_tokens=1, prompt_logprobs=0))
    got = np.array([[entry[t] for t, entry in zip(w[1:], o.prompt_logprobs[1:])] for w, o in zip(windows, outs)])
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        ids = torch.tensor(windows)
        want = torch.log_softmax(hf(ids).logits[:, :-1], -1).gather(-1, ids[:, 1:, None])[..., 0].numpy()
    ppl, hf_ppl = math.exp(-got.mean()), math.exp(-want.mean())
    # Both float32 over 256 positions: measured 1.5e-5 apart per token at most, perplexities 3e-7
    # apart (relative); 1e-3 leaves room for other CPUs' kernels and still catches one wrong layer.
    worst = float(np.abs(got - want).max())
    assert worst < 1e-3, worst
    assert abs(ppl / hf_ppl - 1) < 1e-3, (ppl, hf_ppl)
    # Measured 20.146 on these 8 x 256 held-out tokens (the model card's 64 windows: 20.45).
    assert 20.146 * 0.85 < ppl < 20.146 * 1.15, ppl


# trains for 18 s: -m slow; the bundled folder's agreement with transformers is checked above
@pytest.mark.slow
def test_training_script_writes_a_folder_the_engine_and_transformers_agree_on(tmp_path):
    out = tmp_path / "model"
    cmd = [sys.executable, str(ROOT / "experiments" / "train_default_model.py"), "--out", str(out), "--steps", "3",
           "--batch-size", "2", "--seq-len", "32", "--vocab-size", "300", "--max-files", "4", "--eval-every", "2",
           "--eval-windows", "2", "--set", "hidden_size=32", "intermediate_size=64", "num_hidden_layers=1",
           "num_attention_heads=2", "num_key_value_heads=1"]
    subprocess.run(cmd, check=True, capture_output=True, timeout=600)
    record = json.loads((out / "training.json").read_text())
    assert len(record["eval_loss"]) == 2 and all(math.isfinite(v) for _, v in record["eval_loss"])
    assert (out / "training_loss.png").stat().st_size > 0
    assert _greedy_engine(out, PROMPTS[:2], 8) == _greedy_hf(out, PROMPTS[:2], 8)
