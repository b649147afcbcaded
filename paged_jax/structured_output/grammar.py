"""Grammars compiled once per distinct constraint, and a matcher per sequence (llguidance).

:class:`GrammarCompiler` wraps the engine's tokenizer once, compiles each distinct
:class:`StructuredOutputsParams` into an llguidance matcher in its start state (kept in a
bounded LRU cache; a constraint's later requests copy it, ~6 us), and refuses a constraint that
does not compile (``ValueError`` naming the field and llguidance's message) or takes longer than
``timeout_s`` to compile. Compiling runs in a worker thread (llguidance releases the GIL), so a
caller waiting on it can be an ``asyncio.to_thread`` of the server, never its event loop; a
refused slow compile finishes in that thread and is dropped, and the engine goes on.

:class:`SequenceMatcher` is one sequence's parser state: it advances with each accepted token,
forks with the sequence (``n > 1``), rolls back undone tokens, and writes the next token's
allowed set as a row of a ``[rows, ceil(vocab / 32)]`` int32 bitmask (bit ``t % 32`` of word
``t // 32`` set: token ``t`` allowed), which the jitted sampler applies to the logits.

Plain Python and numpy (no JAX): the engine's side of the border.
"""

from __future__ import annotations

import collections
import copy
import concurrent.futures
import threading
from typing import Iterable, Optional

import llguidance
import llguidance.hf
import numpy as np
from llguidance.numpy import fill_next_token_bitmask, fill_next_token_bitmask_par

from paged_jax.structured_output.params import StructuredOutputsParams

DEFAULT_CACHE_SIZE = 256  # distinct constraints kept compiled
DEFAULT_TIMEOUT_S = 10.0  # longer than this to compile: refused
# JSON as json.dumps writes it (", " and ": ", no other whitespace): with whitespace free between
# tokens, small models fill max_tokens with newlines and spaces. A schema may say otherwise in its
# "x-guidance" object (llguidance applies it over these), e.g. {"whitespace_flexible": true}.
JSON_DEFAULTS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def bitmask_width(vocab_size: int) -> int:
    return (int(vocab_size) + 31) // 32


class SequenceMatcher:
    """One sequence's position in its grammar."""

    __slots__ = ("matcher",)

    def __init__(self, matcher: "llguidance.LLMatcher"):
        self.matcher = matcher

    def fork(self) -> "SequenceMatcher":
        return SequenceMatcher(self.matcher.deep_copy())

    def accept(self, token_id: int) -> None:
        """Advance by one sampled token; a token the grammar does not allow raises ``ValueError``
        (the mask makes that impossible unless the grammar itself failed)."""
        if not self.matcher.consume_token(int(token_id)):
            raise ValueError(f"token {token_id} does not match the request's structured_outputs constraint: "
                             f"{self.matcher.get_error()[:300]}")

    def rollback(self, num_tokens: int) -> None:
        """Undo the last ``num_tokens`` accepted tokens."""
        if num_tokens and not self.matcher.rollback(int(num_tokens)):
            raise ValueError(f"could not roll the grammar back by {num_tokens} tokens: {self.matcher.get_error()}")

    @property
    def is_finished(self) -> bool:
        """The grammar is complete and admits no further token (but EOS): the output is done."""
        return self.matcher.is_stopped()


class GrammarCompiler:
    """Compiles constraints for one tokenizer; thread-safe (the server compiles off its event loop
    while the engine thread runs)."""

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: Iterable[int] = (),
                 cache_size: int = DEFAULT_CACHE_SIZE, timeout_s: float = DEFAULT_TIMEOUT_S):
        if tokenizer is None:
            raise ValueError("structured_outputs needs the model's tokenizer; this engine has none")
        eos = sorted(int(t) for t in eos_token_ids) or None
        # Byte-level BPE and byte-fallback (SentencePiece-converted) fast tokenizers alike; ids past
        # the tokenizer's own (a padded embedding) are never allowed.
        self.ll_tokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=int(vocab_size), eos_token=eos)
        self.vocab_size = int(vocab_size)
        self.cache_size = int(cache_size)
        self.timeout_s = float(timeout_s)
        self._cache: "collections.OrderedDict[tuple, llguidance.LLMatcher]" = collections.OrderedDict()
        self._lock = threading.Lock()
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=2, thread_name_prefix="grammar-compile")
        self._fill_pool = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar-mask")
        self._scratch = np.zeros((1, bitmask_width(vocab_size)), np.int32)
        self.num_compiled = 0

    def matcher(self, params: StructuredOutputsParams) -> SequenceMatcher:
        """A fresh matcher for ``params`` (compiled now unless cached). ``ValueError`` if the
        constraint is invalid, unsupported or too slow to compile."""
        return SequenceMatcher(self._compiled(params).deep_copy())

    def _compiled(self, params: StructuredOutputsParams) -> "llguidance.LLMatcher":
        if not isinstance(params, StructuredOutputsParams):
            raise TypeError(f"structured_outputs must be a StructuredOutputsParams, got {type(params).__name__}")
        key = params.key()
        with self._lock:
            if key in self._cache:
                self._cache.move_to_end(key)
                return self._cache[key]
        kind = params.kind
        try:
            if key[0] == "json":
                grammar = llguidance.LLMatcher.grammar_from_json_schema(key[1], defaults=JSON_DEFAULTS)
            else:
                grammar = llguidance.grammar_from(*key)
        except ValueError as exc:
            raise ValueError(f"structured_outputs.{kind} is invalid: {exc}") from None
        future = self._pool.submit(self._build, grammar)
        try:
            m = future.result(timeout=self.timeout_s)
        except concurrent.futures.TimeoutError:
            raise ValueError(f"structured_outputs.{kind} took longer than {self.timeout_s:g} s to compile; "
                             "simplify it") from None
        if m.is_error():
            raise ValueError(f"structured_outputs.{kind} is invalid or unsupported: {m.get_error()[:500]}")
        with self._lock:
            self._cache[key] = m
            self.num_compiled += 1
            while len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
        return m

    def _build(self, grammar: str) -> "llguidance.LLMatcher":
        m = llguidance.LLMatcher(self.ll_tokenizer, grammar, log_level=0)
        if not m.is_error():
            # The lexer is built lazily: its first mask is part of compiling (and of the time bound),
            # and shows errors of the start state now rather than in a step.
            fill_next_token_bitmask(m, np.zeros_like(self._scratch))
        return m

    def fill_bitmasks(self, matchers: list[SequenceMatcher]) -> np.ndarray:
        """The next token's allowed set of each matcher, one row each: int32 ``[len, width]``."""
        out = np.empty((len(matchers), self._scratch.shape[1]), np.int32)
        if len(matchers) == 1:
            fill_next_token_bitmask(matchers[0].matcher, out, 0)
        else:
            fill_next_token_bitmask_par(_executor(), [(m.matcher, i) for i, m in enumerate(matchers)], out)
        return out

    def start_bitmasks(self, matchers: list[SequenceMatcher]) -> "PendingBitmasks":
        """:meth:`fill_bitmasks` in a worker thread (llguidance releases the GIL): the engine starts
        it before the executor dispatches the step, so the masks are computed while the forward pass
        runs; the sampler's arrays read them (and wait for them) only after that dispatch."""
        return PendingBitmasks(self._fill_pool.submit(self.fill_bitmasks, matchers))


class PendingBitmasks:
    """The bitmask rows being computed for one step; :meth:`row` stands for row ``k`` (numpy reads
    it through ``__array__``, waiting for it)."""

    def __init__(self, future: "concurrent.futures.Future"):
        self._future = future

    def result(self) -> np.ndarray:
        return self._future.result()

    def row(self, k: int) -> "_PendingRow":
        return _PendingRow(self, k)


class _PendingRow:
    __slots__ = ("pending", "k")

    def __init__(self, pending: PendingBitmasks, k: int):
        self.pending, self.k = pending, k

    def __array__(self, dtype=None, copy=None):
        row = self.pending.result()[self.k]
        return row if dtype is None else row.astype(dtype)


_EXECUTOR: Optional["llguidance.LLExecutor"] = None


def _executor() -> "llguidance.LLExecutor":
    global _EXECUTOR
    if _EXECUTOR is None:
        _EXECUTOR = llguidance.LLExecutor()
    return _EXECUTOR


def with_bitmask(params, bitmask_row):
    """A copy of a row's ``SamplingParams`` carrying that row's bitmask (int32 ``[width]``, or a
    pending row of :class:`PendingBitmasks`) to
    ``SamplingTensors.from_params``: the executor passes each row's params through untouched, so
    the mask needs no field of its own at the border."""
    row_params = copy.copy(params)
    row_params.token_bitmask = bitmask_row
    return row_params
