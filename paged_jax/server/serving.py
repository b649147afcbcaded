"""Completions and chat completions on the async engine: OpenAI requests in, OpenAI responses out.

Each prompt of a request becomes one engine request (the engine runs the
``n`` / ``best_of`` samples of a prompt as one sequence group). Outputs are
cumulative; streaming sends the new text of each choice as a server-sent
event and ends with ``data: [DONE]``. While a stop string could still be
forming, the last ``len(stop) - 1`` characters are held back, so streamed
text never has to be taken back.

Prompts are tokenized off the event loop (see :mod:`paged_jax.server.prompts`). The disconnect watcher starts before the first prompt is queued, so a
batched completion whose client goes away stops queueing and aborts all its prompts.
"""

from __future__ import annotations

import asyncio
import re
import time
import uuid
from typing import AsyncIterator, Optional

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from paged_jax.engine import REQUEST_FAILED
from paged_jax.outputs import CompletionOutput, RequestOutput
from paged_jax.sampling_params import SamplingParams
from paged_jax.server.async_engine import AsyncLLMEngine, EngineDeadError, RequestStream
from paged_jax.server.prompts import PromptBuilder
from paged_jax.server.protocol import (SAMPLING_FIELDS, APIError, ChatCompletionRequest, CompletionRequest,
                                       constraint_spec)
from paged_jax.server.responses import (ChoiceState, chat_logprobs, completion_logprobs, merge_logprobs,
                                        prompt_logprobs_legacy, sse)
from paged_jax.structured_output import StructuredOutputsParams

_FIELD_RE = re.compile(r"^(\w+)")
_DISCONNECTED = object()  # put in a request's output queue when its client goes away


class _ClientGone(Exception):
    """The client disconnected while its prompts were being queued."""


class _AbortOnCloseResponse(StreamingResponse):
    """Server-sent events that abort the requests behind them however the response ends: Starlette
    cancels the sending task on a disconnect, which need not pass through the body generator."""

    def __init__(self, content, on_close, **kw):
        super().__init__(content, **kw)
        self._on_close = on_close

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_close()


class OpenAIServing:
    def __init__(self, engine: AsyncLLMEngine, tokenizer, model_name: str, max_model_len: int,
                 chat_template: Optional[str] = None, disconnect_poll_s: float = 0.5):
        self.engine = engine
        self.tokenizer = tokenizer  # a copy owned by the event loop (the engine thread has its own)
        self.prompts = PromptBuilder(tokenizer, chat_template)  # tokenizes in a thread of its own
        self.model_name = model_name
        self.max_model_len = max_model_len
        self.disconnect_poll_s = disconnect_poll_s
        self.created = int(time.time())

    def close(self) -> None:
        """Stop the tokenizer thread (the app's lifespan ends)."""
        self.prompts.close()

    # ---- /v1/models ----------------------------------------------------------------
    def model_card(self) -> dict:
        return {"id": self.model_name, "object": "model", "created": self.created, "owned_by": "paged-jax",
                "max_model_len": self.max_model_len}

    def check_model(self, model: str) -> None:
        if model != self.model_name:
            raise APIError(f"The model `{model}` does not exist; this server serves `{self.model_name}`.",
                           404, param="model", code="model_not_found")

    # ---- request -> engine ---------------------------------------------------------------
    @staticmethod
    def _field_of(message: str, rename: Optional[dict] = None) -> Optional[str]:
        m = _FIELD_RE.match(message)
        name = m.group(1) if m else None
        if rename and name in rename:
            return rename[name]
        return name if name in SAMPLING_FIELDS + ("logprobs", "prompt", "structured_outputs") else None

    def _sampling_params(self, req, max_tokens: Optional[int], logprobs: Optional[int],
                         rename: Optional[dict] = None, prompt_logprobs: Optional[int] = None,
                         structured_outputs: Optional[StructuredOutputsParams] = None) -> SamplingParams:
        kw = {f: getattr(req, f) for f in SAMPLING_FIELDS if getattr(req, f) is not None}
        kw["max_tokens"] = max_tokens
        kw["logprobs"] = logprobs
        kw["prompt_logprobs"] = prompt_logprobs
        kw["structured_outputs"] = structured_outputs
        try:
            params = SamplingParams(**kw)  # the one place values are validated
        except ValueError as exc:
            raise APIError(str(exc), 400, param=self._field_of(str(exc), rename)) from None
        if req.stream and params.use_beam_search:
            raise APIError("stream=true is not supported with use_beam_search: beams are rewritten until the end",
                           400, param="stream")
        if req.stream and params.best_of != params.n:
            raise APIError(f"best_of must equal n when streaming (got n={params.n}, best_of={params.best_of}): "
                           "the best samples are known only at the end", 400, param="best_of")
        if req.logit_bias:
            raise APIError("logit_bias is not supported by this server", 400, param="logit_bias")
        return params

    async def _structured_outputs(self, req, response_format: Optional[dict] = None
                                  ) -> tuple[Optional[StructuredOutputsParams], str]:
        """The request's constraint (vLLM's ``structured_outputs`` or, on chat, OpenAI's
        ``response_format``) and the field it came from, compiled off the event loop (the engine
        then finds it in its cache). Bad input gets 400 naming what is wrong."""
        spec, field = constraint_spec(req.structured_outputs, response_format)
        if spec is None:
            return None, field
        try:
            params = StructuredOutputsParams.from_dict(spec)
            await asyncio.to_thread(self.engine.engine.grammar_compiler.matcher, params)
        except (TypeError, ValueError) as exc:
            raise APIError(f"{field}: {exc}" if field == "response_format" else str(exc), 400, param=field) from None
        return params, field

    def _check_length(self, num_prompt: int, max_tokens: Optional[int], field: str) -> None:
        if num_prompt >= self.max_model_len:
            raise APIError(f"This model's maximum context length is {self.max_model_len} tokens, and the "
                           f"{field} has {num_prompt} tokens, leaving no room for the completion. Shorten the "
                           f"{field}.", 400, param=field, code="context_length_exceeded")
        if max_tokens is not None and num_prompt + max_tokens > self.max_model_len:
            raise APIError(f"This model's maximum context length is {self.max_model_len} tokens. However, you "
                           f"requested {num_prompt + max_tokens} tokens ({num_prompt} in the {field}, {max_tokens} "
                           f"in the completion). Reduce the length of the {field} or max_tokens.", 400,
                           param="max_tokens", code="context_length_exceeded")

    async def _submit(self, base_id: str, prompts: list[tuple[Optional[str], list[int]]], params: SamplingParams,
                      field: str, sink: asyncio.Queue, watcher: asyncio.Task) -> list[RequestStream]:
        streams: list[RequestStream] = []
        try:
            for i, (text, ids) in enumerate(prompts):
                if watcher.done():  # the client left while its prompts were being queued
                    raise _ClientGone()
                rid = base_id if len(prompts) == 1 else f"{base_id}-{i}"
                streams.append(await self.engine.add_request(rid, text, params, ids, sink=sink, index=i))
        except ValueError as exc:
            self._abort(streams)
            msg = str(exc)
            raise APIError(msg, 400, param=field if msg.startswith("prompt") else self._field_of(msg)) from None
        except EngineDeadError as exc:
            self._abort(streams)
            raise APIError(str(exc), 503) from None
        except BaseException:
            self._abort(streams)
            raise
        return streams

    def _abort(self, streams: list[RequestStream]) -> None:
        for s in streams:
            if not s.finished:
                self.engine.abort(s.request_id)

    @staticmethod
    def _rejection(out: RequestOutput, field: str) -> Optional[APIError]:
        """The engine ended the request before it generated anything, saying why (e.g. best_of > max_num_seqs),
        or after an internal error in its own processing."""
        if out.finished and out.finish_message and out.finish_message.startswith(REQUEST_FAILED):
            # The engine ended this request alone after an internal error (the others go on).
            return APIError("The server had an error while processing this request; it is in the server log.",
                            500)
        if out.finished and out.finish_message and not any(c.token_ids for c in out.outputs):
            name = OpenAIServing._field_of(out.finish_message)
            return APIError(out.finish_message, 400, param=name or field)
        return None

    async def _watch_disconnect(self, raw: Request, sink: asyncio.Queue) -> None:
        """Tell the output loop when the client goes away (Starlette only notices that by itself while
        a streaming response is being sent)."""
        while not await raw.is_disconnected():
            await asyncio.sleep(self.disconnect_poll_s)
        sink.put_nowait((-1, _DISCONNECTED))

    async def _outputs(self, sink: asyncio.Queue, streams: list[RequestStream],
                       field: str) -> AsyncIterator[tuple[int, RequestOutput]]:
        """(prompt index, output) as they come; raises APIError; aborts everything left on any exit."""
        remaining = len(streams)
        try:
            while remaining:
                i, item = await sink.get()
                # Outputs are cumulative: when this connection fell behind, only the latest per prompt matters.
                latest = {i: item}
                while not sink.empty() and not isinstance(item, BaseException) and item is not _DISCONNECTED:
                    i, item = sink.get_nowait()
                    latest[i] = item
                if _DISCONNECTED in latest.values():
                    return  # the finally clause aborts
                for i, item in latest.items():
                    if isinstance(item, BaseException):  # the engine stopped (its error is in the log)
                        raise APIError("The engine stopped after an internal error; the server is shutting "
                                       "down.", 503) from None
                    err = self._rejection(item, field)
                    if err is not None:
                        raise err
                    remaining -= item.finished
                    yield i, item
        finally:
            self._abort(streams)

    async def _respond(self, req, request_id: str, prompts, params: SamplingParams, field: str, raw: Request,
                       render_full, render_chunks):
        """Run the prompts; JSON for stream=false, server-sent events for stream=true."""
        gone = JSONResponse(APIError("client disconnected", 400).body(), 400)
        sink: asyncio.Queue = asyncio.Queue()
        watcher = asyncio.create_task(self._watch_disconnect(raw, sink))
        try:
            streams = await self._submit(request_id, prompts, params, field, sink, watcher)
        except _ClientGone:
            watcher.cancel()
            return gone
        except BaseException:
            watcher.cancel()
            raise
        outputs = self._outputs(sink, streams, field)
        try:
            if not req.stream:
                finals: list[Optional[RequestOutput]] = [None] * len(streams)
                async for i, out in outputs:
                    finals[i] = out
                return gone if any(f is None for f in finals) else JSONResponse(render_full(finals))
            # The first output before the headers, so a rejected request still gets its HTTP status.
            first = await outputs.__anext__()
        except StopAsyncIteration:
            return gone
        except BaseException:
            await outputs.aclose()
            raise
        finally:
            watcher.cancel()

        async def events():
            try:
                async for chunk in render_chunks(first, outputs):
                    yield sse(chunk)
            except APIError as exc:
                yield sse(exc.body())
            finally:
                await outputs.aclose()  # aborts unfinished requests when the client disconnects
            yield "data: [DONE]\n\n"

        return _AbortOnCloseResponse(events(), lambda: self._abort(streams), media_type="text/event-stream")

    async def _stream_choices(self, first, outputs, params: SamplingParams, make_chunk, usage_chunk):
        """Shared streaming loop: per prompt and choice, the text and tokens not sent yet."""
        hold = max((len(s) for s in params.stop), default=1) - 1
        states: dict[int, list[ChoiceState]] = {}
        prompt_tokens: dict[int, int] = {}

        async def all_outputs():
            yield first
            async for item in outputs:
                yield item

        async for i, out in all_outputs():
            prompt_tokens[i] = len(out.prompt_token_ids)
            slots = states.setdefault(i, [ChoiceState(i * params.n + k) for k in range(params.n)])
            for slot, c in ChoiceState.align(slots, out.outputs):
                chunk = make_chunk(slot, c, slot.take(c, hold), out)
                if chunk is not None:
                    yield chunk
        if usage_chunk is not None:
            completion = sum(s.num_tokens for slots in states.values() for s in slots)
            yield usage_chunk(sum(prompt_tokens.values()), completion)

    @staticmethod
    def _usage(prompt: int, completion: int) -> dict:
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}

    # ---- /v1/completions ----------------------------------------------------------------
    async def completion(self, req: CompletionRequest, raw: Request):
        self.check_model(req.model)
        if req.suffix:
            raise APIError("suffix is not supported by this server", 400, param="suffix")
        structured, _ = await self._structured_outputs(req)
        params = self._sampling_params(req, req.max_tokens, req.logprobs,
                                       prompt_logprobs=req.logprobs if req.echo else None,
                                       structured_outputs=structured)
        prompts = await self.prompts.completion(req.prompt)
        for _, ids in prompts:
            self._check_length(len(ids), params.max_tokens, "prompt")
        rid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
        head = {"id": rid, "object": "text_completion", "created": created, "model": self.model_name}
        top = params.logprobs

        def echo_prefix(out: RequestOutput) -> tuple[str, Optional[dict], int]:
            """echo=true: the prompt's text, its tokens' logprobs and the text offset after them."""
            text = out.prompt if out.prompt is not None else self.tokenizer.decode(out.prompt_token_ids)
            if top is None:
                return text, None, 0
            return (text, *prompt_logprobs_legacy(self.tokenizer, out.prompt_token_ids, out.prompt_logprobs, top))

        def text_and_logprobs(out: RequestOutput, c: CompletionOutput) -> tuple[str, Optional[dict]]:
            prefix, lp, offset = echo_prefix(out) if req.echo else ("", None, 0)
            if top is not None:
                lp = merge_logprobs(lp, completion_logprobs(self.tokenizer, c, top, 0, offset)[0])
            return prefix + c.text, lp

        def full(finals: list[RequestOutput]) -> dict:
            choices = [{"index": i * params.n + c.index, "text": text, "finish_reason": c.finish_reason,
                        "stop_reason": c.stop_reason, "logprobs": lp}
                       for i, out in enumerate(finals) for c in out.outputs for text, lp in [text_and_logprobs(out, c)]]
            n_out = sum(len(c.token_ids) for out in finals for c in out.outputs)
            return {**head, "choices": choices,
                    "usage": self._usage(sum(len(o.prompt_token_ids) for o in finals), n_out)}

        def chunk(slot: ChoiceState, c: CompletionOutput, delta, out: RequestOutput) -> Optional[dict]:
            text, start, finish = delta
            lp = None
            if req.echo and not slot.sent_role:  # the first chunk of a choice starts with the prompt
                prefix, lp, slot.offset0 = echo_prefix(out)
                text = prefix + text
            slot.sent_role = True
            if not text and lp is None and finish is None and (top is None or start == len(c.token_ids)):
                return None
            if top is not None:
                new, slot.offset0 = completion_logprobs(self.tokenizer, c, top, start, slot.offset0)
                lp = merge_logprobs(lp, new)
            return {**head, "choices": [{"index": slot.index, "text": text, "logprobs": lp, "finish_reason": finish,
                                         "stop_reason": c.stop_reason if finish else None}], **usage_none}

        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        usage_none = {"usage": None} if include_usage else {}
        usage = (lambda p, c: {**head, "choices": [], "usage": self._usage(p, c)}) if include_usage else None
        return await self._respond(req, rid, prompts, params, "prompt", raw, full,
                                   lambda first, outs: self._stream_choices(first, outs, params, chunk, usage))

    # ---- /v1/chat/completions -------------------------------------------------------------
    async def chat(self, req: ChatCompletionRequest, raw: Request):
        self.check_model(req.model)
        if req.tools or (req.tool_choice not in (None, "none")):
            raise APIError("tools are not supported by this server", 400, param="tools")
        if req.top_logprobs is not None and not req.logprobs:
            raise APIError("top_logprobs needs logprobs=true", 400, param="top_logprobs")
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        top = (req.top_logprobs or 0) if req.logprobs else None
        structured, field = await self._structured_outputs(req, req.response_format)
        params = self._sampling_params(req, max_tokens, top, rename={"logprobs": "top_logprobs",
                                                                     "structured_outputs": field},
                                       structured_outputs=structured)
        text, ids = await self.prompts.chat(req)
        self._check_length(len(ids), params.max_tokens, "messages")
        rid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
        head = {"id": rid, "object": "chat.completion", "created": created, "model": self.model_name}
        chunk_head = {**head, "object": "chat.completion.chunk"}

        def full(finals: list[RequestOutput]) -> dict:
            out = finals[0]
            choices = [{"index": c.index, "message": {"role": "assistant", "content": c.text},
                        "logprobs": None if top is None else chat_logprobs(self.tokenizer, c, top),
                        "finish_reason": c.finish_reason, "stop_reason": c.stop_reason} for c in out.outputs]
            return {**head, "choices": choices,
                    "usage": self._usage(len(out.prompt_token_ids), sum(len(c.token_ids) for c in out.outputs))}

        def chunk(slot: ChoiceState, c: CompletionOutput, delta, out: RequestOutput) -> Optional[dict]:
            text, start, finish = delta
            first = not slot.sent_role
            if not first and not text and finish is None and (top is None or start == len(c.token_ids)):
                return None
            slot.sent_role = True
            d = {"role": "assistant", "content": text} if first else ({"content": text} if text else {})
            lp = None if top is None else chat_logprobs(self.tokenizer, c, top, start)
            return {**chunk_head, "choices": [{"index": slot.index, "delta": d, "logprobs": lp,
                                               "finish_reason": finish,
                                               "stop_reason": c.stop_reason if finish else None}], **usage_none}

        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        usage_none = {"usage": None} if include_usage else {}
        usage = (lambda p, c: {**chunk_head, "choices": [], "usage": self._usage(p, c)}) if include_usage else None
        return await self._respond(req, rid, [(text, ids)], params, "messages", raw, full,
                                   lambda first, outs: self._stream_choices(first, outs, params, chunk, usage))
