"""Every command line the README shows is one the code accepts.

``paged-jax`` commands are parsed by the CLI's own parser (``make-tiny`` is run for real: it is cheap);
``python experiments/...`` commands exist and their options parse (``--help`` appended, in a
subprocess: marked slow). Install lines (venv, pip), ``python -m pytest`` and ``curl`` are not run.
"""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from paged_jax.cli import build_parser

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()


def readme_commands() -> list[str]:
    """Command lines in ```bash blocks (continuations joined, ``&&`` chains split, comments and a
    trailing ``&`` dropped) and in inline code spans that start with ``paged-jax`` or ``python``."""
    lines = []
    for block in re.findall(r"```bash\n(.*?)```", README, re.S):
        lines += block.replace("\\\n", " ").splitlines()
    lines += re.findall(r"`((?:paged-jax|python) [^`]*)`", README)
    commands = []
    for line in lines:
        for part in line.split("&&"):
            words = shlex.split(part, comments=True)
            while words and re.match(r"^[A-Z_]+=", words[0]):  # VAR=value prefixes
                words.pop(0)
            if words and words[-1] == "&":
                words.pop()
            if words:
                commands.append(shlex.join(words))
    return list(dict.fromkeys(commands))


COMMANDS = readme_commands()
CLI = [c for c in COMMANDS if c.startswith("paged-jax ")]
SCRIPTS = [c for c in COMMANDS if c.startswith(("python experiments/", "python -m experiments"))]


def test_the_readme_shows_commands():
    assert any("make-tiny" in c for c in CLI) and any(" serve " in c for c in CLI) and SCRIPTS


@pytest.mark.parametrize("command", CLI)
def test_paged_jax_command_parses(command, tmp_path):
    argv = shlex.split(command)[1:]
    if any(w.startswith("[") for w in argv):  # a synopsis such as "serve --model DIR [--port 8000]"
        argv = [w for w in argv if not w.startswith("[") and not w.endswith("]")]
    if argv[0] == "make-tiny":  # cheap: run it, into a temporary folder
        from paged_jax.cli import main

        out = argv.index("--out") + 1
        argv[out] = str(tmp_path / "tiny")
        assert main(argv) == 0
        assert (tmp_path / "tiny" / "config.json").is_file()
        return
    args, rest = build_parser().parse_known_args(argv)
    assert not rest, f"{command!r}: unrecognized {rest}"
    assert args.cmd == argv[0]


@pytest.mark.slow
@pytest.mark.parametrize("command", SCRIPTS)
def test_experiment_command_parses(command):
    argv = shlex.split(command)[1:]
    if argv[0] == "-m":
        assert (ROOT / (argv[1].replace(".", "/") + ".py")).is_file()
    else:
        assert (ROOT / argv[0]).is_file()
    r = subprocess.run([sys.executable, *argv, "--help"], cwd=ROOT, capture_output=True, text=True, timeout=300,
                       env={**__import__("os").environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(ROOT)})
    assert r.returncode == 0, r.stderr[-2000:]
