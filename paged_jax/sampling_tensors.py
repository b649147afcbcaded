"""SamplingTensors: a step's per-row sampling parameters packed into arrays on the host.

``SamplingTensors.from_params`` turns each row's ``SamplingParams``, seed and token history
into the padded arrays the jitted sampler (``paged_jax/sampler.py``, which documents the
semantics) takes; the meta fields (``all_greedy``, ``do_penalties``, ...) are static and pick
the sampler's code path.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Optional, Sequence

import jax
import numpy as np

from paged_jax.seeds import splitmix64
from paged_jax.utils import pow2_bucket

_SAMPLING_EPS = 1e-5
_M64 = (1 << 64) - 1
_M32 = (1 << 32) - 1
PAD_ID = -1  # padding in the token-id arrays; ignored (any id outside [0, V) is)


# ---- seeds -------------------------------------------------------------------
# seed_for_sample and splitmix64 live in paged_jax.seeds: the engine derives per-sample seeds without JAX.
def _key_words(seed: int) -> tuple[int, int]:
    s = seed & _M64
    return (s >> 32) & _M32, s & _M32


def _pow2_bucket(n: int, minimum: int) -> int:
    return 0 if n <= 0 else pow2_bucket(n, minimum)


# ---- per-row parameters -------------------------------------------------------
def is_greedy(params) -> bool:
    """Greedy and beam-search rows take the argmax of their processed logits."""
    return params.use_beam_search or params.temperature < _SAMPLING_EPS


def uses_penalties(params) -> bool:
    return params.repetition_penalty != 1.0 or params.presence_penalty != 0.0 or params.frequency_penalty != 0.0


def banned_ids(params, num_output_tokens: int, eos_token_id: Optional[int]) -> list[int]:
    """The ids a row may not draw now: its stop ids and EOS while ``min_tokens`` is not reached."""
    if num_output_tokens >= params.min_tokens:
        return []
    ban = list(params.stop_token_ids)
    if eos_token_id is not None and not params.ignore_eos:
        ban.append(int(eos_token_id))
    return ban


def argmax_only(params, num_output_tokens: int, eos_token_id: Optional[int]) -> bool:
    """Whether a row's sample is the plain argmax of its model's logits, with that token's logprob
    and nothing more: greedy, not beam search, no penalties, no banned ids now, no structured-output
    mask, no top logprobs (``logprobs=0`` asks only the token's own). :class:`SamplingTensors` of
    such rows alone has ``all_greedy`` and no other flag, ban, mask or top-N; the model step returns
    these tokens itself (:func:`paged_jax.sampler.greedy_tokens`)."""
    return (not params.use_beam_search and params.temperature < _SAMPLING_EPS and not params.logprobs
            and not uses_penalties(params) and getattr(params, "token_bitmask", None) is None
            and not banned_ids(params, num_output_tokens, eos_token_id))


def loop_decodable(params, num_output_tokens: int, eos_token_id: Optional[int]) -> bool:
    """Whether multi-step decoding's loop (``paged_jax.executor.decode_loop``) can give a row's tokens:
    the plain argmax (:func:`argmax_only`), or a random row's draw with at most that token's own
    logprob (no top logprobs, no structured-output mask; its ``min_tokens`` ban the loop applies as the
    sampler does). Not with penalties: the loop would carry the output so far in an array whose width
    follows its length, and compile again at every power of two."""
    if is_greedy(params):
        return argmax_only(params, num_output_tokens, eos_token_id)
    return not params.logprobs and getattr(params, "token_bitmask", None) is None and not uses_penalties(params)


@dataclass(frozen=True, eq=False)
class SamplingTensors:
    """Per-row sampling parameters as arrays (a pytree; build with :meth:`from_params`).

    Data fields, S = padded batch, all numpy:
        temperature f32[S] (1.0 for greedy rows), top_k i32[S] (V = off),
        top_p f32[S], min_p f32[S], presence_penalty / frequency_penalty /
        repetition_penalty f32[S], greedy bool[S] (greedy and beam-search rows:
        argmax), key_data u32[S, 2] (threefry key words), key_offset u32[S]
        (folded into the key), prompt_token_ids i32[S, Lp] and output_token_ids
        i32[S, Lo] (for penalties, PAD_ID-padded), banned_token_ids i32[S, B]
        (logit set to -inf; min_tokens), token_bitmask i32[S, ceil(V / 32)] (structured output:
        bit t % 32 of word t // 32 clear = token t banned; all bits set on unconstrained rows),
        or i32[S, 0] when no row is constrained (the sampler then skips it: the shape is static).
    Meta fields (static, part of the tree structure, so part of the jit key):
        all_greedy, do_penalties, do_top_k, do_top_p, do_min_p, num_top.
    Padded rows are greedy with no penalties or truncation; their outputs are
    garbage to ignore, and never affect real rows (every op is row-wise).
    """

    temperature: Any
    top_k: Any
    top_p: Any
    min_p: Any
    presence_penalty: Any
    frequency_penalty: Any
    repetition_penalty: Any
    greedy: Any
    key_data: Any
    key_offset: Any
    prompt_token_ids: Any
    output_token_ids: Any
    banned_token_ids: Any
    token_bitmask: Any
    all_greedy: bool = True
    do_penalties: bool = False
    do_top_k: bool = False
    do_top_p: bool = False
    do_min_p: bool = False
    num_top: int = 0

    @property
    def batch_size(self) -> int:
        return int(self.temperature.shape[0])

    @classmethod
    def from_params(
        cls,
        rows: Sequence[tuple[Any, Optional[int], Sequence[int], Sequence[int]]],
        vocab_size: int,
        pad_to: Optional[int] = None,
        *,
        eos_token_id: Optional[int] = None,
        engine_seed: int = 0,
        step: int = 0,
        num_top: Optional[int] = None,
        ids_bucket_min: int = 16,
    ) -> "SamplingTensors":
        """Build the arrays for one step.

        rows: one ``(SamplingParams, seed or None, prompt_token_ids,
            output_token_ids)`` per sequence, in batch order. The seed is the
            row's own (see :func:`seed_for_sample`); it must be given when
            ``params.seed`` is set. output_token_ids are the tokens this sequence
            has generated so far (their count is the seeded key's offset).
        vocab_size: V, the last dimension of the logits.
        pad_to: S, the padded batch (>= len(rows)); defaults to len(rows).
        eos_token_id: banned, with ``stop_token_ids``, while ``min_tokens`` is
            not reached (unless ``ignore_eos``).
        engine_seed, step: the key of unseeded rows (see the module docstring).
        num_top: the top-N width; by default the largest ``logprobs`` asked for
            (``2 * best_of`` for beam search, as vLLM's beam step needs),
            rounded up to a power of two, at most V.
        """
        n = len(rows)
        S = n if pad_to is None else int(pad_to)
        V = int(vocab_size)
        if S < n:
            raise ValueError(f"pad_to must be >= the number of rows ({n}), got {pad_to}")
        temperature = np.ones(S, np.float32)
        top_k = np.full(S, V, np.int32)
        top_p = np.ones(S, np.float32)
        min_p = np.zeros(S, np.float32)
        presence = np.zeros(S, np.float32)
        frequency = np.zeros(S, np.float32)
        repetition = np.ones(S, np.float32)
        greedy = np.ones(S, bool)
        key_data = np.zeros((S, 2), np.uint32)
        key_offset = np.zeros(S, np.uint32)
        unseeded_words = _key_words(splitmix64(splitmix64(engine_seed & _M64) ^ (step & _M64)))

        prompt_lists, output_lists, ban_lists = [], [], []
        mask_rows = {}
        want_top = 0
        for i, (params, seed, prompt_ids, output_ids) in enumerate(rows):
            row_greedy = is_greedy(params)
            greedy[i] = row_greedy
            # A constrained row's mask rides on its row's params (a per-row copy made by the engine,
            # see paged_jax.structured_output.grammar.with_bitmask), so executors pass it through.
            row_mask = getattr(params, "token_bitmask", None)
            if row_mask is not None:
                mask_rows[i] = row_mask
            if params.use_beam_search:
                want_top = max(want_top, 2 * params.best_of)
            want_top = max(want_top, params.logprobs or 0)
            presence[i] = params.presence_penalty
            frequency[i] = params.frequency_penalty
            repetition[i] = params.repetition_penalty
            prompt_lists.append(prompt_ids if params.repetition_penalty != 1.0 else ())
            output_lists.append(output_ids if uses_penalties(params) else ())
            ban_lists.append(banned_ids(params, len(output_ids), eos_token_id))
            if row_greedy:
                continue
            temperature[i] = params.temperature
            if 0 < params.top_k < V:
                top_k[i] = params.top_k
            top_p[i] = params.top_p
            min_p[i] = params.min_p
            if seed is None and params.seed is not None:
                raise ValueError(
                    f"row {i}: params.seed={params.seed} is set but the row seed is None; "
                    "pass seed_for_sample(params.seed, sample_index)"
                )
            if seed is not None:
                key_data[i] = _key_words(int(seed))
                key_offset[i] = len(output_ids) & _M32
            else:
                key_data[i] = unseeded_words
                key_offset[i] = i

        def pack(lists):
            width = _pow2_bucket(max((len(x) for x in lists), default=0), ids_bucket_min)
            out = np.full((S, width), PAD_ID, np.int32)
            for i, ids in enumerate(lists):
                if len(ids):
                    out[i, : len(ids)] = np.asarray(ids, np.int32)
            return out

        token_bitmask = np.zeros((S, 0), np.int32)
        if mask_rows:
            token_bitmask = np.full((S, (V + 31) // 32), -1, np.int32)
            for i, row_mask in mask_rows.items():
                token_bitmask[i] = np.asarray(row_mask)  # a row being computed is waited for here
        real = slice(0, n)
        if num_top is None:
            num_top = _pow2_bucket(want_top, 1)
        return cls(
            temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p,
            presence_penalty=presence, frequency_penalty=frequency, repetition_penalty=repetition,
            greedy=greedy, key_data=key_data, key_offset=key_offset,
            prompt_token_ids=pack(prompt_lists), output_token_ids=pack(output_lists),
            banned_token_ids=pack(ban_lists), token_bitmask=token_bitmask,
            all_greedy=bool(greedy.all()),
            do_penalties=bool((presence[real] != 0).any() or (frequency[real] != 0).any()
                              or (repetition[real] != 1).any()),
            do_top_k=bool((top_k[real] < V).any()),
            do_top_p=bool((top_p[real] < 1).any()),
            do_min_p=bool((min_p[real] > 0).any()),
            num_top=int(min(num_top, V)),
        )


_DATA_FIELDS = [f.name for f in dataclasses.fields(SamplingTensors)
                if f.name not in ("all_greedy", "do_penalties", "do_top_k", "do_top_p", "do_min_p", "num_top")]
jax.tree_util.register_dataclass(
    SamplingTensors,
    data_fields=_DATA_FIELDS,
    meta_fields=["all_greedy", "do_penalties", "do_top_k", "do_top_p", "do_min_p", "num_top"],
)
