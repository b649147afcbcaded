"""Client prompts to token ids, off the event loop.

Tokenizing a long prompt or rendering a chat template takes long enough to stall
every stream and ``/health`` if done on the event loop; :class:`PromptBuilder`
does it in one worker thread with a tokenizer copy of its own (HF tokenizers are
not safe to share between threads). A tokenizer failure on client text is the
input's fault: a 400, its details in the log.
"""

from __future__ import annotations

import asyncio
import copy
import logging
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Optional, TypeVar

from paged_jax.server.protocol import APIError, ChatCompletionRequest

logger = logging.getLogger("paged_jax.server")
T = TypeVar("T")


class PromptBuilder:
    def __init__(self, tokenizer, chat_template: Optional[str] = None):
        self.tokenizer = copy.deepcopy(tokenizer)  # used in the worker thread only
        self.chat_template = chat_template
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="paged-jax-tokenize")

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    async def completion(self, prompt) -> list[tuple[Optional[str], list[int]]]:
        """(text or None, token ids) per prompt of a completion request."""
        return await self._run(lambda: self._completion(prompt))

    async def chat(self, req: ChatCompletionRequest) -> tuple[str, list[int]]:
        """The chat prompt's text and token ids."""
        return await self._run(lambda: self._chat(req))

    async def _run(self, fn: Callable[[], T]) -> T:
        """Run ``fn`` in the tokenizer thread."""
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn)

    def encode(self, text: str, field: str) -> list[int]:
        """Tokenize client text (in the tokenizer thread); a tokenizer failure is the input's fault: 400."""
        try:
            return self.tokenizer.encode(text)
        except Exception as exc:
            logger.warning("could not tokenize the %s: %s: %s", field, type(exc).__name__, exc)
            raise APIError(f"The {field} could not be tokenized ({type(exc).__name__}); send valid "
                           "Unicode text.", 400, param=field) from None

    def _completion(self, prompt) -> list[tuple[Optional[str], list[int]]]:
        if isinstance(prompt, str):
            return [(prompt, self.encode(prompt, "prompt"))]
        if not prompt:
            raise APIError("prompt must not be empty", 400, param="prompt")
        if isinstance(prompt[0], int):
            return [(None, list(prompt))]
        out = []
        for p in prompt:
            if isinstance(p, str):
                out.append((p, self.encode(p, "prompt")))
            elif not p:
                raise APIError("prompt must not contain an empty list of token ids", 400, param="prompt")
            else:
                out.append((None, list(p)))
        return out

    def _chat(self, req: ChatCompletionRequest) -> tuple[str, list[int]]:
        """The chat prompt's text and token ids (in the tokenizer thread)."""
        text = self._render_chat(req)
        return text, self.encode(text, "messages")

    def _render_chat(self, req: ChatCompletionRequest) -> str:
        template = self.chat_template or getattr(self.tokenizer, "chat_template", None)
        if not template:
            raise APIError("This model's tokenizer has no chat template, so chat messages cannot be turned into "
                           "a prompt. Use /v1/completions with a prompt, or start the server with "
                           "--chat-template.", 400, param="messages", code="no_chat_template")
        messages = []
        for i, m in enumerate(req.messages):
            msg = m.model_dump(exclude_none=True)
            if isinstance(m.content, list):
                parts = []
                for part in m.content:
                    if part.get("type") != "text" or not isinstance(part.get("text"), str):
                        raise APIError(f"messages[{i}].content: only text parts ({{'type': 'text', 'text': ...}}) "
                                       f"are supported, got {part!r}", 400, param="messages")
                    parts.append(part["text"])
                msg["content"] = "\n".join(parts)
            messages.append(msg)
        try:
            return self.tokenizer.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=req.add_generation_prompt,
                chat_template=template, **(req.chat_template_kwargs or {}))
        except Exception as exc:  # a template error (raise_exception in the template, bad kwargs)
            raise APIError(f"the chat template failed on these messages: {exc}", 400, param="messages") from None
