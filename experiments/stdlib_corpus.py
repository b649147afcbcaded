"""The default model's text: the Python standard library's own source files (code and docstrings).

Every machine with Python has them, so the corpus needs no download. The split is by file and
fixed: the library's ``.py`` files outside test packages, in sorted order; every tenth file
(index 9, 19, ...) is held out for evaluation, the rest is training text. The files differ
between Python versions: the model card names the version the bundled model was trained on.
"""

from __future__ import annotations

import sys
import sysconfig
from pathlib import Path

EXCLUDED_PARTS = {"test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__"}
HOLD_OUT_EVERY = 10


def stdlib_files() -> list[Path]:
    root = Path(sysconfig.get_paths()["stdlib"])
    return sorted(f for f in root.rglob("*.py") if not EXCLUDED_PARTS & set(f.relative_to(root).parts))


def split() -> tuple[list[Path], list[Path]]:
    """(training files, held-out files)."""
    files = stdlib_files()
    held = [f for i, f in enumerate(files) if i % HOLD_OUT_EVERY == HOLD_OUT_EVERY - 1]
    train = [f for i, f in enumerate(files) if i % HOLD_OUT_EVERY != HOLD_OUT_EVERY - 1]
    return train, held


def read(path: Path) -> str:
    return path.read_text(encoding="utf-8", errors="replace")


def describe() -> str:
    train, held = split()
    return (f"Python {sys.version_info.major}.{sys.version_info.minor} standard library "
            f"({sysconfig.get_paths()['stdlib']}): {len(train)} training files, {len(held)} held out")
