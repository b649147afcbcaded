"""Which cases of a parametrized test the default suite runs.

The default suite (``python -m pytest``) stays within the time the project gives it (15 minutes on 2
cores) by running one case of each code path; ``-m slow`` runs the other cases, before a change lands.
"""

from __future__ import annotations

import pytest


def slow_unless(cases, kept) -> list:
    """cases as parameters, each whose first value is not in kept marked slow (a case may already be a
    ``pytest.param``: its values and id are kept)."""
    out = []
    for case in cases:
        values = case.values if hasattr(case, "values") else (case if isinstance(case, tuple) else (case,))
        if values[0] in kept:
            out.append(case)
        else:
            out.append(pytest.param(*values, marks=pytest.mark.slow, id=getattr(case, "id", None)))
    return out
