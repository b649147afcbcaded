"""The simulator notebooks run top to bottom at a small size (PAGED_JAX_NB_SMALL=1)."""

from __future__ import annotations

from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")

ROOT = Path(__file__).resolve().parents[1]


# 26 s and 13 s: the block-size and preemption notebooks' engines and simulator runs are the engine's
# and simulator's own tests; the latency-target notebook runs by default
@pytest.mark.parametrize("name, expected", [pytest.param("block_size_ablation.ipynb", "greedy outputs identical",
                                                         marks=pytest.mark.slow),
                                            pytest.param("preemption.ipynb", "greedy outputs identical",
                                                         marks=pytest.mark.slow),
                                            ("latency_target.ipynb", "targets kept in the simulator")])
def test_notebook_runs(name, expected, monkeypatch):
    monkeypatch.setenv("PAGED_JAX_NB_SMALL", "1")
    nb = nbformat.read(ROOT / "notebooks" / name, as_version=4)
    client = nbclient.NotebookClient(nb, timeout=600, kernel_name="python3",
                                     resources={"metadata": {"path": str(ROOT)}})
    client.execute()  # raises CellExecutionError on any failing cell (the notebooks assert their invariants)
    text = "".join(o.get("text", "") for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", []))
    assert expected in text, text[-2000:]
