"""Which instruction-set paths of the native kernels a test run built and ran, in a section at the
end of pytest's output ("native kernel paths").

The same native tests exercise different C++ code by the CPU they land on: the AVX-512 and VNNI
branches compile out without those extensions, and where the CPU has them the portable loops are
built only by the portable-build checks (-mno-avx512f, in a subprocess). The section lists each
build the run checked (its extra flags, each kernel's path, the kernels that ran on it) and the
paths no build of this run compiled, so a green run says what it covered.

The native test modules import :func:`native_paths_report` (a session fixture, autouse) to
register the report; the portable checks hand it their subprocess's ``native.status()``."""

from __future__ import annotations

import pytest

from paged_jax import native

PLUGIN_NAME = "paged_jax_native_paths"


def _extra_flags(status: dict) -> str:
    extra = status.get("flags", "").split()[len(native.build.FLAGS):]
    return " ".join(extra) or "default flags"


def _no_avx512() -> str:
    """Why this process's build has no AVX-512 paths (where it has none)."""
    if "avx512f" not in native.cpu_isa():
        return "this CPU has no avx512f"
    if "-mno-avx512f" in native.status().get("flags", "").split():
        return "this process built with PAGED_JAX_NATIVE_FLAGS=-mno-avx512f"
    return "its portable builds were not run"


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
    def __init__(self):
        self.builds = []  # (what checked it, native.status() of that process)

    def add(self, who: str, status: dict) -> None:
        self.builds.append((who, status))

    @pytest.hookimpl(trylast=True)
    def pytest_terminal_summary(self, terminalreporter):
        tr = terminalreporter
        tr.section("native kernel paths")
        tr.write_line(f"CPU: {' '.join(native.cpu_isa()) or 'none of ' + ', '.join(native.CPU_ISA)}")
        merged = {}  # library (or the error) -> (who, status with the kernels all its processes ran)
        for who, status in [("this process", native.status()), *self.builds]:
            key = status.get("library") or status.get("error", "")
            names, seen = merged.setdefault(key, ([], dict(status, traced=[])))
            names.append(who)
            seen["traced"] = sorted({*seen["traced"], *status.get("traced", [])})
        for names, status in merged.values():
            for line in describe(status, names):
                tr.write_line(line)
        built = {(k, v) for _, s in merged.values() if s.get("ok") for k, v in s["paths"].items()}
        every = {(k, v) for k in ("attention", "linear float32", "linear quantized") for v in ("avx512", "portable")}
        every |= {("linear int8 x int8", v) for v in ("vnni", "portable")}
        never = sorted(every - built)
        if never:
            tr.write_line(f"not built in this run: {', '.join(f'{k} {v}' for k, v in never)} ({_no_avx512()})")


REPORT = Report()


def record(who: str, status: dict) -> None:
    """A subprocess's build (its ``native.status()``), checked by test ``who``, for the report."""
    REPORT.add(who, status)


PORTABLE_FLAGS = "-mno-avx512f"


def run_portable(code: str, tmp_path_factory, who: str) -> dict:
    """Run ``code`` (a Python program whose last line of output is a JSON object with
    ``"status": native.status()``) in a subprocess whose library is built with -mno-avx512f (the
    loops of a CPU without AVX-512), into one cache for the session (the modules that check it
    share the build); assert that every kernel's path in it is the portable one, record it for the
    report, and return the object. Skipped where this process's build is portable already (a CPU
    without AVX-512): every native test ran those loops, and the same build again would add nothing."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    if native.available() and set(native.paths().values()) == {"portable"}:
        pytest.skip(f"this process's native build is the portable one already ({_no_avx512()}): the other native "
                    "tests ran its loops")
    home = tmp_path_factory.getbasetemp() / "native-portable"
    root = str(Path(__file__).resolve().parents[1])
    env = dict(os.environ, PAGED_JAX_HOME=str(home), PAGED_JAX_NATIVE_FLAGS=PORTABLE_FLAGS, JAX_PLATFORMS="cpu",
               PYTHONPATH=os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")])))
    res = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600, cwd=root)
    assert res.returncode == 0, res.stderr[-3000:]
    out = json.loads(res.stdout.strip().splitlines()[-1])
    status = out["status"]
    assert status["library"].startswith(str(home)), status
    assert set(status["paths"].values()) == {"portable"}, status["paths"]
    record(who, status)
    return out


@pytest.fixture(scope="session", autouse=True)
def native_paths_report(request):
    manager = request.config.pluginmanager
    if manager.get_plugin(PLUGIN_NAME) is None:
        manager.register(REPORT, PLUGIN_NAME)
    yield
