"""Structured output: a request's text constrained to a JSON schema, a regex, a choice or a grammar.

- :mod:`~paged_jax.structured_output.params`: ``StructuredOutputsParams`` (vLLM's interface).
- :mod:`~paged_jax.structured_output.grammar`: the compiler (llguidance; cached, time-bounded) and
  the per-sequence matcher that writes the token bitmask the jitted sampler applies.

The engine compiles a request's constraint when it is added, gives each sequence its matcher,
asks for the bitmask rows of the constrained rows each step and advances each matcher with each
accepted token (see ``LLMEngine``). Unconstrained steps do none of this.
"""

from paged_jax.structured_output.params import StructuredOutputsParams

__all__ = ["StructuredOutputsParams"]
