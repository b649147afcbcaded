"""The native library's build across processes: started together on a fresh machine (test workers,
servers), processes build it once; the others wait for it and load that file."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from paged_jax import native

# A process that "builds" where the library is missing (a stand-in for the compiler: a second's work,
# then the file, written as the real build writes it) and logs its pid if it did.
BUILD_ONCE = """
import os, sys, time
from pathlib import Path
from paged_jax.native import build

out, log = Path(sys.argv[1]), Path(sys.argv[2])

def fake_build(path):
    time.sleep(1.0)
    with open(log, "a") as f:
        f.write(f"{os.getpid()}\\n")
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{os.getpid()}.tmp")
    tmp.write_bytes(b"library")
    os.replace(tmp, path)  # as the real build: atomic

build._build = fake_build
build._ensure_built(out)
assert out.read_bytes() == b"library"
"""


def test_processes_started_together_build_the_library_once(tmp_path):
    out, log = tmp_path / "native" / "lib.so", tmp_path / "builds.log"
    root = str(Path(__file__).resolve().parents[1])
    procs = [subprocess.Popen([sys.executable, "-c", BUILD_ONCE, str(out), str(log)], cwd=root) for _ in range(3)]
    assert [p.wait(timeout=60) for p in procs] == [0, 0, 0]
    assert len(log.read_text().split()) == 1, log.read_text()


@pytest.mark.skipif(not native.available(), reason=f"native kernels not built: {native.status()}")
def test_the_paths_report_of_parallel_workers_reaches_the_controller():
    """Under pytest-xdist the tests run in workers: the "native kernel paths" section, printed by the
    controller, lists their build and the kernels they ran."""
    root = str(Path(__file__).resolve().parents[1])
    res = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", "2", "--dist", "load",
                          "tests/test_native_norm.py", "-k", "matches_numpy"],
                         cwd=root, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout[-3000:]
    section = res.stdout[res.stdout.index("native kernel paths"):]
    build = next(line for line in section.splitlines() if " build (" in line)  # this run's one build
    assert "worker gw0" in build and "worker gw1" in build, section
    assert "ran: rms norm float32" in section, section
