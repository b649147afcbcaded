"""Which instruction-set paths of the native kernels a test run built and ran, in a section at the
end of pytest's output ("native kernel paths").

The same native tests exercise different C++ code by the CPU they land on: the AVX-512, VNNI and
AVX2 branches compile out without those extensions. Where the CPU has AVX-512, the AVX2 paths are
built by the checks without it (-mno-avx512f, in a subprocess, in the default test set) and the
portable loops by the slow checks (-mno-avx512f -mno-avx2 -mno-fma). The section lists each build
the run checked (its extra flags, each kernel's path, the kernels that ran on it) and the paths no
build of this run compiled, so a green run says what it covered.

conftest registers the report; the native test modules import :func:`native_paths_report` (a
session fixture, autouse) to have it print this process's build, and the other builds' checks
(:func:`run_build`) hand it their subprocess's ``native.status()``. Under pytest-xdist, each worker's
part reaches the controller with the worker's output (``workeroutput``), and the controller prints
the section."""

from __future__ import annotations

import json

import pytest

from paged_jax import native

PLUGIN_NAME = "paged_jax_native_paths"


def _extra_flags(status: dict) -> str:
    extra = status.get("flags", "").split()[len(native.build.FLAGS):]
    return " ".join(extra) or "default flags"


def _not_built() -> str:
    """Why some paths were not built in this run."""
    isa = native.cpu_isa()
    if "avx512f" not in isa:
        return f"this CPU has no avx512f{'' if 'avx2' in isa else ' and no avx2'}: those tests were skipped"
    if "-mno-avx512f" in native.status().get("flags", "").split():
        return "this process built with PAGED_JAX_NATIVE_FLAGS=-mno-avx512f"
    return ("no check of this run built them: -mno-avx512f (the AVX2 paths) is in the default set, "
            "-mno-avx512f -mno-avx2 -mno-fma (the portable loops) in the slow set")


def describe(status: dict, who: list) -> list:
    """Lines for one build (a ``native.status()``, merged over the processes in ``who`` that loaded
    it): its paths, the kernels that ran on it, those that did not."""
    if not status.get("ok"):
        return [f"{', '.join(who)}: not built: {status.get('error', 'PAGED_JAX_NATIVE=0 or never asked')}"]
    paths = ", ".join(f"{k} {v}" for k, v in status["paths"].items())
    ran = [k for k in native.KERNELS if k in status.get("traced", [])]
    lines = [f"{_extra_flags(status)} build ({', '.join(who)}): {paths}", f"  {status['library']}",
             f"  ran: {', '.join(ran) or 'none'}"]
    missing = [k for k in native.KERNELS if k not in ran]
    if missing:
        lines.append(f"  not run: {', '.join(missing)}")
    return lines


class Report:
    """The section's data: this process's build, if its tests used one, and the other builds the
    checks ran. Under pytest-xdist each worker hands its own to the controller, which prints them."""

    def __init__(self):
        self.builds = []  # (what checked it, native.status() of that process)
        self.ran_here = False  # whether a native test module ran in this process

    def add(self, who: str, status: dict) -> None:
        self.builds.append((who, status))

    def pytest_sessionfinish(self, session):
        workeroutput = getattr(session.config, "workeroutput", None)  # set in a pytest-xdist worker only
        if workeroutput is not None and self.ran_here:
            worker = session.config.workerinput["workerid"]
            workeroutput[PLUGIN_NAME] = json.dumps([(f"worker {worker}", native.status()), *self.builds])

    @pytest.hookimpl(optionalhook=True)
    def pytest_testnodedown(self, node, error):  # the controller, as a worker finishes
        self.builds.extend(tuple(b) for b in json.loads(getattr(node, "workeroutput", {}).get(PLUGIN_NAME, "[]")))

    @pytest.hookimpl(trylast=True)
    def pytest_terminal_summary(self, terminalreporter):
        if not (self.ran_here or self.builds):
            return
        tr = terminalreporter
        tr.section("native kernel paths")
        tr.write_line(f"CPU: {' '.join(native.cpu_isa()) or 'none of ' + ', '.join(native.CPU_ISA)}")
        merged = {}  # library (or the error) -> (who, status with the kernels all its processes ran)
        own = [("this process", native.status())] if self.ran_here else []  # none in an xdist controller
        for who, status in own + self.builds:
            key = status.get("library") or status.get("error", "")
            names, seen = merged.setdefault(key, ([], dict(status, traced=[])))
            names.append(who)
            seen["traced"] = sorted({*seen["traced"], *status.get("traced", [])})
        for names, status in merged.values():
            for line in describe(status, names):
                tr.write_line(line)
        built = {(k, v) for _, s in merged.values() if s.get("ok") for k, v in s["paths"].items()}
        every = {(k, v) for k in ("attention", "linear float32", "linear quantized") for v in native.build.LINEAR_PATHS}
        every |= {(k, v) for k in ("linear int8 x int8", "linear int4 x int8") for v in native.build.INT8_PATHS}
        never = sorted(every - built)
        if never:
            tr.write_line(f"not built in this run: {', '.join(f'{k} {v}' for k, v in never)} ({_not_built()})")


REPORT = Report()


def record(who: str, status: dict) -> None:
    """A subprocess's build (its ``native.status()``), checked by test ``who``, for the report."""
    REPORT.add(who, status)


AVX2_FLAGS = "-mno-avx512f"  # with -march=native on an AVX-512 CPU: its AVX2 + FMA3 paths
PORTABLE_FLAGS = "-mno-avx512f -mno-avx2 -mno-fma"  # the loops of a CPU with neither


def run_build(code: str, tmp_path_factory, who: str, flags: str = AVX2_FLAGS) -> dict:
    """Run ``code`` (a Python program whose last line of output is a JSON object with
    ``"status": native.status()``) in a subprocess whose library is built with ``flags`` added
    (:data:`AVX2_FLAGS`: no AVX-512; :data:`PORTABLE_FLAGS`: no AVX2 either), into one cache per
    flags for the session (the modules and xdist workers that check it share the build); assert that
    no kernel's path in it is one those flags turn off, record it for the report, and return it. Skipped
    where this process's build already has none of the paths those flags turn off (every native
    test ran its loops, and the same build again would add nothing)."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    turned_off = {"avx512", "vnni"} if flags == AVX2_FLAGS else {"avx512", "vnni", "avx2"}
    if native.available() and not set(native.paths().values()) & turned_off:
        pytest.skip(f"this process's native build has no {'/'.join(sorted(turned_off))} paths already "
                    f"({_not_built()}): the other native tests ran its loops")
    base = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        base = base.parent  # the run's folder, which its xdist workers share: one build for them all
    home = base / f"native{flags.replace(' ', '')}"
    root = str(Path(__file__).resolve().parents[1])
    env = dict(os.environ, PAGED_JAX_HOME=str(home), PAGED_JAX_NATIVE_FLAGS=flags, JAX_PLATFORMS="cpu",
               PYTHONPATH=os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")])))
    res = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600, cwd=root)
    assert res.returncode == 0, res.stderr[-3000:]
    out = json.loads(res.stdout.strip().splitlines()[-1])
    status = out["status"]
    assert status["library"].startswith(str(home)), status
    assert not set(status["paths"].values()) & turned_off, status["paths"]
    record(who, status)
    return out


def register(config) -> None:
    """Register the report (from conftest's ``pytest_configure``: the xdist controller runs no test)."""
    if config.pluginmanager.get_plugin(PLUGIN_NAME) is None:
        config.pluginmanager.register(REPORT, PLUGIN_NAME)


@pytest.fixture(scope="session", autouse=True)
def native_paths_report():
    REPORT.ran_here = True
    yield
