"""paged-jax: PagedAttention and a vLLM-style LLM serving engine in JAX."""

from paged_jax.outputs import CompletionOutput, RequestOutput
from paged_jax.sampling_params import SamplingParams
from paged_jax.structured_output import StructuredOutputsParams

__version__ = "0.1.0"


def __getattr__(name):  # LLM and LLMEngine import JAX: load them on first use
    if name == "LLM":
        from paged_jax.llm import LLM

        return LLM
    if name in ("LLMEngine", "EngineArgs"):
        from paged_jax import engine

        return getattr(engine, name)
    raise AttributeError(f"module 'paged_jax' has no attribute {name!r}")


__all__ = ["LLM", "LLMEngine", "EngineArgs", "SamplingParams", "StructuredOutputsParams", "RequestOutput", "CompletionOutput"]
