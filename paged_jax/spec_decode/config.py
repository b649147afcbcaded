"""SpeculativeConfig: ``LLM(model, speculative_config={...})``, vLLM's keys and checks."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

METHODS = ("ngram", "draft_model")
# disable_by_batch_size when the dict does not give it: a verification step's cost grows with its rows'
# tokens (k + 1 each), and on the default model (experiments/bench_spec_decode.py, README) n-gram drafts
# paid at batch 1, were about even at 4 and lost at 8. An explicit None speculates at every batch size (vLLM's).
DEFAULT_DISABLE_BY_BATCH_SIZE = 8
_KEYS = ("method", "num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min", "disable_by_batch_size",
         "model")


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding's settings.

    ``method="ngram"``: proposals looked up in the request's own tokens (:mod:`.ngram`), up to
    ``num_speculative_tokens`` a step, from suffixes of ``prompt_lookup_min`` to
    ``prompt_lookup_max`` tokens (vLLM's defaults: both 5 when neither is given, otherwise the
    missing one equals the given one). ``model`` (method ``"draft_model"``, implied by the key): a
    smaller model with the target's vocabulary proposes the drafts (:mod:`.draft_model`: its argmax for
    greedy requests, sampled for the others). ``disable_by_batch_size``: no speculation in a step that runs
    at least that many sequences (None: always on; not given: :data:`DEFAULT_DISABLE_BY_BATCH_SIZE`)."""

    method: str
    num_speculative_tokens: int
    prompt_lookup_max: int
    prompt_lookup_min: int
    disable_by_batch_size: Optional[int] = DEFAULT_DISABLE_BY_BATCH_SIZE
    model: Optional[str] = None  # method "draft_model": the draft model's folder

    @classmethod
    def from_dict(cls, config: Any) -> "SpeculativeConfig":
        """Validate a user's dict (or pass a SpeculativeConfig through); ValueError naming the bad entry."""
        if isinstance(config, SpeculativeConfig):
            return config
        if not isinstance(config, dict):
            raise ValueError(f"speculative_config must be a dict such as {{'method': 'ngram', "
                             f"'num_speculative_tokens': 4}}, got {config!r}")
        unknown = sorted(set(config) - set(_KEYS))
        if unknown:
            raise ValueError(f"speculative_config has unknown keys {unknown}; allowed: {list(_KEYS)}")
        model = config.get("model")
        method = config.get("method", "draft_model" if model is not None else None)
        if (method == "draft_model") != (model is not None) or (model is not None and not isinstance(model, str)):
            raise ValueError(f"speculative_config: method 'draft_model' needs a draft model folder in 'model' "
                             f"(a string), and only it takes one: got method={method!r}, model={model!r}")
        if method not in METHODS:
            raise ValueError(f"speculative_config['method'] must be one of {list(METHODS)}, got {method!r}")
        k = config.get("num_speculative_tokens")
        if not _is_int(k) or k < 1:
            raise ValueError(f"speculative_config['num_speculative_tokens'] must be an integer >= 1, got {k!r}")
        lo, hi = config.get("prompt_lookup_min"), config.get("prompt_lookup_max")
        if lo is None and hi is None:
            lo = hi = 5
        lo = hi if lo is None else lo
        hi = lo if hi is None else hi
        for name, v in (("prompt_lookup_min", lo), ("prompt_lookup_max", hi)):
            if not _is_int(v) or v < 1:
                raise ValueError(f"speculative_config['{name}'] must be an integer >= 1, got {v!r}")
        if lo > hi:
            raise ValueError(f"speculative_config: prompt_lookup_min ({lo}) must be <= prompt_lookup_max ({hi})")
        off = config.get("disable_by_batch_size", DEFAULT_DISABLE_BY_BATCH_SIZE)
        if off is not None and (not _is_int(off) or off < 2):
            raise ValueError(f"speculative_config['disable_by_batch_size'] must be None or an integer >= 2, "
                             f"got {off!r}")
        return cls(method, k, hi, lo, off, model)


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)
