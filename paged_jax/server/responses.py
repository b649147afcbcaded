"""Pieces of OpenAI responses: per-choice streaming state, logprobs in both OpenAI shapes, SSE framing."""

from __future__ import annotations

import json
from typing import Optional

from paged_jax.outputs import CompletionOutput

_MIN_LOGPROB = -9999.0  # JSON has no -inf


def sse(obj: dict) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"


class ChoiceState:
    """What has been streamed of one choice: its text so far and the tokens whose logprobs were sent."""

    def __init__(self, index: int):
        self.index = index
        self.text_sent = 0
        self.token_ids: list[int] = []
        self.finished = False
        self.sent_role = False  # the first chunk was sent (chat: it carries the role; echo: the prompt)
        self.offset0 = 0  # completions logprobs: text offset of the next token

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    def take(self, c: CompletionOutput, hold: int) -> tuple[str, int, Optional[str]]:
        """(new text, index of the first new token, finish reason if it just finished).

        While running, the last ``hold`` characters stay back: a stop string may still complete there
        and the engine would then cut them."""
        if self.finished:
            return "", len(c.token_ids), None
        finish = c.finish_reason
        end = len(c.text) if finish else max(self.text_sent, len(c.text) - hold)
        text = c.text[self.text_sent:end]
        self.text_sent = end
        start = len(self.token_ids)
        self.token_ids = list(c.token_ids)
        self.finished = finish is not None
        return text, start, finish

    @staticmethod
    def align(slots: list["ChoiceState"], outs: list[CompletionOutput]) -> list[tuple["ChoiceState", CompletionOutput]]:
        """Pair each streamed choice with the output that continues it.

        The engine lists samples in a stable order while running but sorts them
        by cumulative logprob when the request finishes; a choice is the output
        whose tokens start with the tokens already streamed for it."""
        if len(outs) <= 1:
            return list(zip(slots, outs))
        free = list(range(len(outs)))
        pairs = []
        for slot in sorted(slots, key=lambda s: -len(s.token_ids)):
            n = len(slot.token_ids)
            pick = next((j for j in free if outs[j].token_ids[:n] == slot.token_ids), free[0])
            free.remove(pick)
            pairs.append((slot, outs[pick]))
        return sorted(pairs, key=lambda p: p[0].index)


def _token(tokenizer, token_id: int) -> str:
    return tokenizer.decode([token_id], skip_special_tokens=False)


def _top(entry: dict, num: int) -> list[tuple[int, float]]:
    return sorted(entry.items(), key=lambda kv: kv[1], reverse=True)[:num]


def completion_logprobs(tokenizer, c: CompletionOutput, top: int, start: int = 0,
                        offset: int = 0) -> tuple[dict, int]:
    """Legacy completions shape for tokens ``start:``: tokens, token_logprobs, top_logprobs, text_offset.
    Returns it and the text offset after the last token."""
    res = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for tid, entry in zip(c.token_ids[start:], (c.logprobs or [])[start:]):
        s = _token(tokenizer, tid)
        res["tokens"].append(s)
        res["token_logprobs"].append(max(entry[tid], _MIN_LOGPROB))
        res["top_logprobs"].append({_token(tokenizer, t): max(v, _MIN_LOGPROB) for t, v in _top(entry, top)})
        res["text_offset"].append(offset)
        offset += len(s)
    return res, offset


def prompt_logprobs_legacy(tokenizer, prompt_ids: list[int], prompt_logprobs, top: int) -> tuple[dict, int]:
    """echo=true with logprobs: the prompt's tokens in the legacy shape (None where nothing predicts a token)."""
    res = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    offset = 0
    for k, tid in enumerate(prompt_ids):
        entry = prompt_logprobs[k] if prompt_logprobs is not None and k < len(prompt_logprobs) else None
        s = _token(tokenizer, tid)
        res["tokens"].append(s)
        res["token_logprobs"].append(None if entry is None else max(entry[tid], _MIN_LOGPROB))
        res["top_logprobs"].append(None if entry is None else
                                   {_token(tokenizer, t): max(v, _MIN_LOGPROB) for t, v in _top(entry, top)})
        res["text_offset"].append(offset)
        offset += len(s)
    return res, offset


def merge_logprobs(a: Optional[dict], b: dict) -> dict:
    return b if a is None else {k: a[k] + b[k] for k in a}


def chat_logprobs(tokenizer, c: CompletionOutput, top: int, start: int = 0) -> dict:
    """Chat shape: {"content": [{token, logprob, bytes, top_logprobs: [{token, logprob, bytes}]}]}."""

    def item(tid: int, lp: float) -> dict:
        s = _token(tokenizer, tid)
        return {"token": s, "logprob": max(lp, _MIN_LOGPROB), "bytes": list(s.encode("utf-8"))}

    content = []
    for tid, entry in zip(c.token_ids[start:], (c.logprobs or [])[start:]):
        content.append({**item(tid, entry[tid]), "top_logprobs": [item(t, v) for t, v in _top(entry, top)]})
    return {"content": content}
