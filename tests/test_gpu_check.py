"""experiments/gpu_check.sh run as a GPU session would run it, here on the CPU and without the packages
the GPU machine lacks (the server's, compressed-tensors, the notebooks'): it finishes, names every
step (each GPU step "skipped: no GPU", with its small CPU run beside it), leaves at most 8 files under
$OUT (what comes back from a lent GPU machine) with the report among them, keeps models and builds
outside $OUT, and exits non-zero when a step fails."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
GPU_STEPS = ["nvidia-smi", "gpu-tests", "bench-kernel", "engine", "throughput", "hf-throughput", "profile-step"]
# What the GPU machine lacks (DESIGN.md, "The GPU machine"); the dry run makes them unimportable.
NOT_ON_THE_GPU_MACHINE = ("fastapi", "uvicorn", "starlette", "openai", "compressed_tensors", "nbformat", "nbclient",
                          "ipykernel")


def run_check(tmp_path, **env):
    out = tmp_path / "out"
    site = tmp_path / "gpu-machine-site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(
        "import sys\n" + "".join(f"sys.modules[{name!r}] = None\n" for name in NOT_ON_THE_GPU_MACHINE))
    env = {**os.environ, "OUT": str(out), "PYTHON": sys.executable, "PAGED_JAX_HOME": str(tmp_path / "home"),
           "PYTHONPATH": os.pathsep.join([str(site), *filter(None, [os.environ.get("PYTHONPATH")])]), **env}
    env.pop("JAX_PLATFORMS", None)  # as on the GPU machine: nothing forces the CPU
    proc = subprocess.run(["bash", str(ROOT / "experiments" / "gpu_check.sh")], env=env, capture_output=True,
                          text=True, timeout=600)
    return proc, out


@pytest.mark.slow
def test_gpu_check_runs_end_to_end_on_the_cpu(tmp_path):
    proc, out = run_check(tmp_path)
    report = (out / "gpu_report.md").read_text()
    assert proc.returncode == 0, report[-6000:]
    files = [p for p in out.rglob("*") if p.is_file()]
    assert len(files) <= 8 and (out / "gpu_report.md") in files, files
    for name in GPU_STEPS:
        assert f"## {name}: skipped: no GPU" in report
    for name in ["versions", "gpu-tests-collect", "bench-kernel-cpu", "engine-cpu", "throughput-cpu", "hf-throughput-cpu",
                 "profile-step-cpu"]:
        assert f"## {name} (exit 0, " in report
    assert "greedy equal to reference float32: 4/4 requests" in report
    # profile_gpu_step.py: the greedy batches take the step's argmax, the sampled ones the sampler's call
    assert "the sampler's own call in 0.00 of a step's batches" in report
    assert "the sampler's own call in 1.00 of a step's batches" in report
    # The profile step runs the throughput step's workload: its warm-up loads that step's compiled programs
    # (on a GPU a fresh compile of them takes 90 s of the check's 9 minutes).
    loaded = re.search(r"## profile-step-cpu .*?(\d+) loaded from the compile cache", report, re.S)
    assert loaded and int(loaded.group(1)) > 0, report[report.find("## profile-step-cpu"):][:3000]
    assert report.rstrip().splitlines()[-1].startswith("**all steps passed**")
    assert "== engine-cpu" in (out / "gpu_check.log").read_text()  # the whole output, beside the report
    assert (tmp_path / "home").is_dir()


def test_gpu_check_exits_nonzero_and_says_which_step_failed(tmp_path):
    proc, out = run_check(tmp_path, PYTHON="false")  # every Python step fails at once
    assert proc.returncode == 1
    report = (out / "gpu_report.md").read_text()
    assert "## versions (exit 1, " in report
    assert report.rstrip().splitlines()[-1].startswith("**FAILED")


def test_the_offline_engine_runs_without_the_servers_packages_or_torch(tiny_llama_dir):
    """The GPU machine has no fastapi, uvicorn, openai, compressed-tensors or nbformat: importing
    paged_jax and generating must need none of them, nor torch (a test-only dependency). Each is made
    unimportable in a fresh interpreter (``sys.modules[name] = None``, which transformers also reads
    as "not installed")."""
    code = f"""
import sys
for name in ("torch", "fastapi", "uvicorn", "starlette", "openai", "compressed_tensors", "nbformat", "httpx"):
    sys.modules[name] = None
from paged_jax import LLM, SamplingParams
llm = LLM({str(tiny_llama_dir)!r}, max_model_len=64, num_kv_blocks=16)
out = llm.generate(["def f(x):"], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
assert len(out[0].outputs[0].token_ids) == 4, out
print("ok")
"""
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300,
                          cwd=ROOT)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stderr[-3000:]
