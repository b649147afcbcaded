"""Sampling parameters for text generation, with vLLM v0.2.x names and defaults.

Every field is checked in ``__post_init__``; a bad value raises ``ValueError``
whose message names the field, shows the value and says what is allowed, e.g.
``temperature must be >= 0, got -1.0``. Types are checked too: ``n="2"`` and
``temperature=True`` are rejected (no silent coercion from strings or bools).

Differences from vLLM v0.2.x, all deliberate:

* ``top_k=0`` is accepted and means "off", like Hugging Face and later vLLM; it
  is normalised to ``-1``. Other values below ``-1`` are errors.
* ``logprobs`` and ``prompt_logprobs`` are capped at :data:`MAX_LOGPROBS` (20,
  the default ``max_logprobs`` of later vLLM), so the sampler's static top-N
  width stays small.
* Beam search also requires ``min_p == 0`` (vLLM silently ignored it).
* An empty stop string is rejected (it would stop every sequence at once).
* ``seed`` may be any int; the sampler uses it modulo 2**64 (see
  :mod:`paged_jax.sampler`).

No JAX here (numpy only): this module is imported by the plain-Python engine side.
"""

from __future__ import annotations

import copy
import enum
import math
import numbers
from dataclasses import dataclass
from typing import Optional, Union

import numpy as np

from paged_jax.structured_output.params import StructuredOutputsParams

_SAMPLING_EPS = 1e-5
MAX_LOGPROBS = 20


class SamplingType(enum.IntEnum):
    GREEDY = 0
    RANDOM = 1
    RANDOM_SEED = 2
    BEAM = 3


# ---- small type checkers -------------------------------------------------------
def _is_int(x) -> bool:
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def _is_real(x) -> bool:
    return isinstance(x, numbers.Real) and not isinstance(x, bool)


def _is_bool(x) -> bool:
    # numpy bools are not ``bool`` subclasses; accept them too.
    return isinstance(x, (bool, np.bool_))


def _check_int(name: str, value, *, optional: bool = False) -> Optional[int]:
    if value is None and optional:
        return None
    if not _is_int(value):
        kind = "an int or None" if optional else "an int"
        raise ValueError(f"{name} must be {kind}, got {value!r} ({type(value).__name__})")
    return int(value)


def _check_real(name: str, value) -> float:
    if not _is_real(value):
        raise ValueError(f"{name} must be a number, got {value!r} ({type(value).__name__})")
    value = float(value)
    if not math.isfinite(value):
        raise ValueError(f"{name} must be finite, got {value!r}")
    return value


def _check_bool(name: str, value) -> bool:
    if not _is_bool(value):
        raise ValueError(f"{name} must be a bool, got {value!r} ({type(value).__name__})")
    return bool(value)


@dataclass
class SamplingParams:
    """Sampling parameters for one request (OpenAI-completions style, as vLLM).

    Args:
        n: number of output sequences returned.
        best_of: number of sequences generated, the best ``n`` returned
            (beam width under beam search). Defaults to ``n``.
        presence_penalty: in [-2, 2]; subtracted once from the logit of every
            token already generated (> 0 favours new tokens).
        frequency_penalty: in [-2, 2]; subtracted per occurrence in the output.
        repetition_penalty: in (0, 2]; HF/CTRL style, for tokens in the prompt or
            the output: positive logits are divided by it, negative multiplied.
        temperature: >= 0; below 1e-5 means greedy.
        top_p: in (0, 1]; nucleus sampling mass.
        top_k: -1 (off) or >= 1; 0 is also accepted as off (normalised to -1).
        min_p: in [0, 1]; drop tokens whose probability is below
            ``min_p * max_probability``.
        seed: per-request seed (any int) for reproducible random sampling.
        use_beam_search: beam search instead of sampling.
        length_penalty: beam search only.
        early_stopping: beam search only: True, False or "never".
        stop: string(s) that end generation; normalised to a list.
        stop_token_ids: token ids that end generation; normalised to a list.
        include_stop_str_in_output: keep the stop string in the text.
        ignore_eos: keep going after EOS.
        max_tokens: >= 1, or None for "up to the model's context length".
        min_tokens: >= 0 and <= max_tokens; EOS and ``stop_token_ids`` are
            banned until this many tokens have been generated.
        logprobs: None or in [0, 20]: number of top log-probabilities returned
            per generated token (plus the sampled one).
        prompt_logprobs: None or in [0, 20]: the same for prompt tokens.
        skip_special_tokens: drop special tokens when detokenizing.
        spaces_between_special_tokens: as in vLLM's detokenizer.
        structured_outputs: a :class:`StructuredOutputsParams`: the output must match a JSON
            schema, a regex, a choice or a grammar (not with beam search).
    """

    n: int = 1
    best_of: Optional[int] = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    seed: Optional[int] = None
    use_beam_search: bool = False
    length_penalty: float = 1.0
    early_stopping: Union[bool, str] = False
    stop: Union[None, str, list[str]] = None
    stop_token_ids: Optional[list[int]] = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    max_tokens: Optional[int] = 16
    min_tokens: int = 0
    logprobs: Optional[int] = None
    prompt_logprobs: Optional[int] = None
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    structured_outputs: Optional[StructuredOutputsParams] = None

    def __post_init__(self) -> None:
        self._check_types_and_ranges()
        if self.use_beam_search:
            self._verify_beam_search()
        else:
            self._verify_non_beam_search()
            if self.temperature < _SAMPLING_EPS:
                self._verify_greedy_sampling()
                # Greedy ignores truncation: normalise so the sampler sees "off".
                self.top_p = 1.0
                self.top_k = -1
                self.min_p = 0.0

    # ---- validation -------------------------------------------------------
    def _check_types_and_ranges(self) -> None:
        self.n = _check_int("n", self.n)
        if self.n < 1:
            raise ValueError(f"n must be at least 1, got {self.n}")
        if self.best_of is None:
            self.best_of = self.n
        self.best_of = _check_int("best_of", self.best_of, optional=True)
        if self.best_of < self.n:
            raise ValueError(
                f"best_of must be greater than or equal to n, got n={self.n} and best_of={self.best_of}"
            )

        for name in ("presence_penalty", "frequency_penalty"):
            v = _check_real(name, getattr(self, name))
            if not -2.0 <= v <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2], got {v}")
            setattr(self, name, v)
        self.repetition_penalty = _check_real("repetition_penalty", self.repetition_penalty)
        if not 0.0 < self.repetition_penalty <= 2.0:
            raise ValueError(f"repetition_penalty must be in (0, 2], got {self.repetition_penalty}")
        self.temperature = _check_real("temperature", self.temperature)
        if self.temperature < 0.0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        self.top_p = _check_real("top_p", self.top_p)
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        self.top_k = _check_int("top_k", self.top_k)
        if self.top_k == 0:
            self.top_k = -1  # 0 means "off" (HF convention); store vLLM's -1
        if self.top_k < -1:
            raise ValueError(f"top_k must be -1 (disable), 0 (disable) or at least 1, got {self.top_k}")
        self.min_p = _check_real("min_p", self.min_p)
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        self.seed = _check_int("seed", self.seed, optional=True)

        self.use_beam_search = _check_bool("use_beam_search", self.use_beam_search)
        self.length_penalty = _check_real("length_penalty", self.length_penalty)
        if not (_is_bool(self.early_stopping) or self.early_stopping == "never"):
            raise ValueError(
                f"early_stopping must be True, False or 'never', got {self.early_stopping!r}"
            )
        if _is_bool(self.early_stopping):
            self.early_stopping = bool(self.early_stopping)

        self.stop = self._normalise_stop(self.stop)
        self.stop_token_ids = self._normalise_stop_token_ids(self.stop_token_ids)
        for name in ("include_stop_str_in_output", "ignore_eos", "skip_special_tokens",
                     "spaces_between_special_tokens"):
            setattr(self, name, _check_bool(name, getattr(self, name)))

        self.max_tokens = _check_int("max_tokens", self.max_tokens, optional=True)
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1 (or None), got {self.max_tokens}")
        self.min_tokens = _check_int("min_tokens", self.min_tokens)
        if self.min_tokens < 0:
            raise ValueError(f"min_tokens must be >= 0, got {self.min_tokens}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(
                f"min_tokens must be less than or equal to max_tokens={self.max_tokens}, "
                f"got {self.min_tokens}"
            )
        for name in ("logprobs", "prompt_logprobs"):
            v = _check_int(name, getattr(self, name), optional=True)
            if v is not None and not 0 <= v <= MAX_LOGPROBS:
                raise ValueError(f"{name} must be None or in [0, {MAX_LOGPROBS}] (max_logprobs), got {v}")
            setattr(self, name, v)
        if self.structured_outputs is not None and not isinstance(self.structured_outputs, StructuredOutputsParams):
            raise ValueError(f"structured_outputs must be a StructuredOutputsParams or None, "
                             f"got {type(self.structured_outputs).__name__}")

    @staticmethod
    def _normalise_stop(stop) -> list[str]:
        if stop is None:
            return []
        if isinstance(stop, str):
            stop = [stop]
        if not isinstance(stop, (list, tuple)):
            raise ValueError(f"stop must be None, a str or a list of str, got {stop!r}")
        out = []
        for s in stop:
            if not isinstance(s, str):
                raise ValueError(f"stop must be None, a str or a list of str, got element {s!r} in {stop!r}")
            if s == "":
                raise ValueError(f"stop strings must be non-empty, got {stop!r}")
            out.append(s)
        return out

    @staticmethod
    def _normalise_stop_token_ids(ids) -> list[int]:
        if ids is None:
            return []
        if isinstance(ids, (str, bytes)) or not hasattr(ids, "__iter__"):
            raise ValueError(f"stop_token_ids must be None or a list of ints, got {ids!r}")
        out = []
        for t in ids:
            if not _is_int(t) or t < 0:
                raise ValueError(
                    f"stop_token_ids must be None or a list of ints >= 0, got element {t!r} in {ids!r}"
                )
            out.append(int(t))
        return out

    def _verify_beam_search(self) -> None:
        if self.best_of == 1:
            raise ValueError(f"best_of must be greater than 1 when using beam search, got {self.best_of}")
        if self.temperature > _SAMPLING_EPS:
            raise ValueError(f"temperature must be 0 when using beam search, got {self.temperature}")
        if self.top_p < 1.0 - _SAMPLING_EPS:
            raise ValueError(f"top_p must be 1 when using beam search, got {self.top_p}")
        if self.top_k != -1:
            raise ValueError(f"top_k must be -1 when using beam search, got {self.top_k}")
        if self.min_p > _SAMPLING_EPS:
            raise ValueError(f"min_p must be 0 when using beam search, got {self.min_p}")
        if self.structured_outputs is not None:
            raise ValueError("structured_outputs is not supported with use_beam_search=True: "
                             "use sampling (n / best_of) to constrain several outputs")

    def _verify_non_beam_search(self) -> None:
        if self.early_stopping is not False:
            raise ValueError(
                f"early_stopping is not effective and must be False when not using beam search, "
                f"got {self.early_stopping!r}"
            )
        if not 1.0 - _SAMPLING_EPS <= self.length_penalty <= 1.0 + _SAMPLING_EPS:
            raise ValueError(
                f"length_penalty is not effective and must be 1.0 when not using beam search, "
                f"got {self.length_penalty}"
            )

    def _verify_greedy_sampling(self) -> None:
        if self.best_of > 1:
            raise ValueError(
                f"best_of must be 1 when using greedy sampling (temperature={self.temperature}), "
                f"got {self.best_of}"
            )

    # ---- conveniences -----------------------------------------------------
    @property
    def sampling_type(self) -> SamplingType:
        if self.use_beam_search:
            return SamplingType.BEAM
        if self.temperature < _SAMPLING_EPS:
            return SamplingType.GREEDY
        if self.seed is not None:
            return SamplingType.RANDOM_SEED
        return SamplingType.RANDOM

    @property
    def uses_penalties(self) -> bool:
        return (
            self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
            or self.repetition_penalty != 1.0
        )

    def clone(self) -> "SamplingParams":
        return copy.deepcopy(self)
