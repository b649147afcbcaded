"""StructuredOutputsParams: what a request's output must match (vLLM's name and fields).

Exactly one of ``json`` (a JSON schema, as a dict or its JSON text), ``regex``, ``choice`` (a
non-empty list of strings), ``grammar`` (a Lark grammar in llguidance's dialect, or GBNF as
llama.cpp writes it) or ``json_object=True`` (any JSON object). Only the shape is checked here;
whether the schema, regex or grammar compiles is checked when the request is added (see
:mod:`paged_jax.structured_output.grammar`), before anything is queued.

Plain Python: imported by :mod:`paged_jax.sampling_params`.
"""

from __future__ import annotations

import json as json_module
from dataclasses import dataclass
from typing import Any, Optional, Union

KINDS = ("json", "regex", "choice", "grammar", "json_object")


@dataclass
class StructuredOutputsParams:
    json: Optional[Union[str, dict]] = None
    regex: Optional[str] = None
    choice: Optional[list[str]] = None
    grammar: Optional[str] = None
    json_object: Optional[bool] = None

    def __post_init__(self) -> None:
        given = [k for k in KINDS if getattr(self, k) is not None and getattr(self, k) is not False]
        if len(given) != 1:
            raise ValueError(f"structured_outputs must set exactly one of {', '.join(KINDS)}; "
                             f"got {', '.join(given) if given else 'none'}")
        kind = given[0]
        value = getattr(self, kind)
        if kind == "json":
            if isinstance(value, str):
                try:
                    parsed = json_module.loads(value)
                except ValueError as exc:
                    raise ValueError(f"structured_outputs.json is not valid JSON: {exc}") from None
            else:
                parsed = value
            if not isinstance(parsed, (dict, bool)):
                raise ValueError(f"structured_outputs.json must be a JSON schema (an object or its JSON text), "
                                 f"got {type(parsed).__name__}: {value!r:.80}")
        elif kind in ("regex", "grammar"):
            if not isinstance(value, str) or not value:
                raise ValueError(f"structured_outputs.{kind} must be a non-empty string, got {value!r:.80}")
        elif kind == "choice":
            if isinstance(value, (str, bytes)) or not isinstance(value, (list, tuple)) or not value:
                raise ValueError(f"structured_outputs.choice must be a non-empty list of strings, got {value!r:.80}")
            bad = [c for c in value if not isinstance(c, str)]
            if bad:
                raise ValueError(f"structured_outputs.choice must hold strings only, got {bad[0]!r:.80}")
            self.choice = list(value)
        elif value is not True:
            raise ValueError(f"structured_outputs.json_object must be True or None, got {value!r}")

    @property
    def kind(self) -> str:
        return next(k for k in KINDS if getattr(self, k) is not None and getattr(self, k) is not False)

    def key(self) -> tuple[str, str]:
        """``(llguidance grammar format, text)``: the constraint in one canonical form (the
        compile cache's key)."""
        kind = self.kind
        if kind == "json":
            # One text per schema, as a dict or as text (key order kept: it orders the output's fields).
            schema = json_module.loads(self.json) if isinstance(self.json, str) else self.json
            return "json", json_module.dumps(schema)
        if kind == "json_object":
            return "json", '{"type": "object"}'
        if kind == "choice":
            return "choice", json_module.dumps(self.choice)
        return kind, getattr(self, kind)

    @classmethod
    def from_dict(cls, d: Any) -> "StructuredOutputsParams":
        """From a request body's ``structured_outputs`` object (the server)."""
        if not isinstance(d, dict):
            raise ValueError(f"structured_outputs must be an object, got {type(d).__name__}")
        unknown = sorted(set(d) - set(KINDS))
        if unknown:
            raise ValueError(f"structured_outputs has unknown fields {unknown}; allowed: {', '.join(KINDS)}")
        return cls(**d)
