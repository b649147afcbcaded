"""OpenAI-compatible HTTP server on the engine: ``paged-jax serve`` (see api_server.py)."""

from paged_jax.server.async_engine import AsyncLLMEngine, RequestStream

__all__ = ["AsyncLLMEngine", "RequestStream"]
