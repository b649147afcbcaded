"""The text side of each new token: incremental detokenization and the stop rules.

Plain Python (no JAX): the engine calls these after appending a sampled token.
"""

from __future__ import annotations

from typing import Collection

from paged_jax.sampling_params import SamplingParams
from paged_jax.sequence import Sequence, SequenceStatus


def text_decoder(tokenizer):
    """``decode(ids, skip_special_tokens=...)`` for :func:`detokenize_incrementally`: the Rust tokenizer's
    own where transformers' ``decode`` only forwards to it (a fast tokenizer that cleans up no spaces
    afterwards), the same text without transformers' wrapper around each of its two calls a token (4.4
    against 11 us a token with warm caches); else the tokenizer's ``decode``."""
    backend = getattr(tokenizer, "backend_tokenizer", None) if getattr(tokenizer, "is_fast", False) else None
    if backend is not None and getattr(tokenizer, "clean_up_tokenization_spaces", True) is False:
        return backend.decode
    return tokenizer.decode


def detokenize_incrementally(decode, seq: Sequence, params: SamplingParams) -> str:
    """Append the text of ``seq``'s newest tokens to ``seq.output_text`` once it is stable
    (no partial UTF-8 character); returns the new text ("" while it is not). ``decode``: a
    :func:`text_decoder`."""
    ids = seq.get_token_ids()
    skip = params.skip_special_tokens
    prefix = decode(ids[seq.prefix_offset:seq.read_offset], skip_special_tokens=skip)
    full = decode(ids[seq.prefix_offset:], skip_special_tokens=skip)
    if len(full) > len(prefix) and not full.endswith("\ufffd"):
        new = full[len(prefix):]
        seq.prefix_offset, seq.read_offset = seq.read_offset, len(ids)
        seq.output_text += new
        return new
    return ""


def check_stop(seq: Sequence, p: SamplingParams, new_text: str, eos_token_ids: Collection[int],
               max_model_len: int) -> None:
    """Finish ``seq`` if its newest token or text ends it: a stop string (cut from the text
    unless ``include_stop_str_in_output``), EOS, a stop token, max_tokens or the context limit."""
    out_len = seq.get_output_len()
    if out_len >= p.min_tokens:
        if p.stop and new_text:
            window = len(new_text) + max(len(s) for s in p.stop) - 1
            start = max(0, len(seq.output_text) - window)
            for stop in p.stop:
                idx = seq.output_text.find(stop, start)
                if idx != -1:
                    cut = idx + len(stop) if p.include_stop_str_in_output else idx
                    seq.output_text = seq.output_text[:cut]
                    seq.stop_reason = stop
                    seq.status = SequenceStatus.FINISHED_STOPPED
                    return
        last = seq.get_last_token_id()
        if not p.ignore_eos and last in eos_token_ids:
            seq.status = SequenceStatus.FINISHED_STOPPED
            return
        if last in p.stop_token_ids:
            seq.stop_reason = last
            seq.status = SequenceStatus.FINISHED_STOPPED
            return
    if (p.max_tokens is not None and out_len >= p.max_tokens) or seq.get_len() >= max_model_len:
        seq.status = SequenceStatus.FINISHED_LENGTH_CAPPED
