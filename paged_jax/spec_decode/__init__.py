"""Speculative decoding: draft tokens proposed above the executor border, scored by the target
model as extra query tokens of the ragged step, accepted or rolled back (see :mod:`.decoder`)."""

from paged_jax.spec_decode.config import SpeculativeConfig
from paged_jax.spec_decode.decoder import SpecDecoder
from paged_jax.spec_decode.ngram import NgramProposer, propose_ngram

__all__ = ["NgramProposer", "SpecDecoder", "SpeculativeConfig", "propose_ngram"]
