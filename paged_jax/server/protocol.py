"""OpenAI API request bodies (pydantic, strict types) and the OpenAI error shape.

Only types are checked here; value ranges are checked once, by
``SamplingParams`` (see ``serving.py``). Strict mode rejects ``"16"`` for an
int and ``true`` for a number, as ``SamplingParams`` does. Fields OpenAI has
and this server does not implement are accepted only at their neutral value.
"""

from __future__ import annotations

from typing import Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field


class APIError(Exception):
    """An error returned to the client as ``{"error": {"message", "type", "param", "code"}}``."""

    TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
             405: "invalid_request_error", 413: "invalid_request_error", 500: "internal_server_error",
             503: "service_unavailable"}

    def __init__(self, message: str, status: int = 400, param: Optional[str] = None,
                 type: Optional[str] = None, code: Optional[str] = None):
        super().__init__(message)
        self.message, self.status, self.param, self.code = message, status, param, code
        self.type = type or self.TYPES.get(status, "invalid_request_error")

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


class _Request(BaseModel):
    # Unknown fields are ignored (as OpenAI and vLLM do); known ones must have the right type.
    model_config = ConfigDict(strict=True, extra="ignore")


class StreamOptions(_Request):
    include_usage: bool = False


class _SamplingFields(_Request):
    """Fields shared by completions and chat completions (OpenAI's, then vLLM's extras)."""

    model: str
    n: int = 1
    best_of: Optional[int] = None
    max_tokens: Optional[int] = None
    temperature: Optional[float] = None
    top_p: Optional[float] = None
    presence_penalty: Optional[float] = None
    frequency_penalty: Optional[float] = None
    stop: Union[str, list[str], None] = None
    seed: Optional[int] = None
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    user: Optional[str] = None
    logit_bias: Optional[dict[str, float]] = None
    # vLLM extensions
    top_k: Optional[int] = None
    min_p: Optional[float] = None
    repetition_penalty: Optional[float] = None
    min_tokens: Optional[int] = None
    stop_token_ids: Optional[list[int]] = None
    ignore_eos: Optional[bool] = None
    skip_special_tokens: Optional[bool] = None
    include_stop_str_in_output: Optional[bool] = None
    use_beam_search: Optional[bool] = None
    length_penalty: Optional[float] = None
    early_stopping: Union[bool, Literal["never"], None] = None
    # {"json": schema} | {"regex": ...} | {"choice": [...]} | {"grammar": ...} | {"json_object": true}
    structured_outputs: Optional[dict[str, Any]] = None


class CompletionRequest(_SamplingFields):
    prompt: Union[str, list[int], list[str], list[list[int]]]
    max_tokens: Optional[int] = 16  # OpenAI's default for completions
    logprobs: Optional[int] = None
    echo: bool = False
    suffix: Optional[str] = None


class ChatMessage(_Request):
    model_config = ConfigDict(strict=True, extra="allow")  # e.g. "name", tool fields: passed to the template
    role: str
    content: Union[str, list[dict[str, Any]], None] = None


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: Optional[int] = None
    logprobs: bool = False
    top_logprobs: Optional[int] = None
    add_generation_prompt: bool = True
    chat_template_kwargs: Optional[dict[str, Any]] = None
    response_format: Optional[dict[str, Any]] = None
    tools: Optional[list[dict[str, Any]]] = None
    tool_choice: Union[Literal["none", "auto", "required"], dict[str, Any], None] = None


SAMPLING_FIELDS = ("n", "best_of", "max_tokens", "temperature", "top_p", "presence_penalty", "frequency_penalty",
                   "stop", "seed", "top_k", "min_p", "repetition_penalty", "min_tokens", "stop_token_ids",
                   "ignore_eos", "skip_special_tokens", "include_stop_str_in_output", "use_beam_search",
                   "length_penalty", "early_stopping")


def _first_surrogate(value, path: str) -> Optional[tuple[str, str]]:
    """(path, string) of the first string in ``value`` holding a lone surrogate, else None."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return path, value
        return None
    if isinstance(value, dict):
        items = value.items()
    elif isinstance(value, (list, tuple)):
        items = enumerate(value)
    else:
        return None
    for key, item in items:
        key_path = f"{path}[{key}]" if isinstance(key, int) else (f"{path}.{key}" if path else str(key))
        found = _first_surrogate(key, path) if isinstance(key, str) else None
        found = found or _first_surrogate(item, key_path)
        if found:
            return found
    return None


def reject_surrogates(request: BaseModel) -> None:
    """JSON's ``\\ud800`` escapes decode to lone surrogates, which are not Unicode text: no
    tokenizer or encoder takes them. Refuse them up front, naming the field (400)."""
    found = _first_surrogate(request.model_dump(exclude_none=True), "")
    if found:
        path, text = found
        raise APIError(f"Invalid value for '{path}': the string holds a lone UTF-16 surrogate, which is not "
                       f"valid Unicode text; got {ascii(text):.200}", 400, param=path.split(".")[0].split("[")[0])


def constraint_spec(structured_outputs: Optional[dict], response_format: Optional[dict]) -> tuple[Optional[dict], str]:
    """A request's constraint as ``StructuredOutputsParams.from_dict`` takes it, and the field it came
    from: vLLM's ``structured_outputs``, or OpenAI's ``response_format`` (chat) translated
    (``json_object``; ``json_schema``'s ``schema``; ``text`` is no constraint). APIError 400 naming
    the field for both at once or a response_format this server does not know."""
    if response_format is None or response_format.get("type") == "text":
        return structured_outputs, "structured_outputs"
    field, kind = "response_format", response_format.get("type")
    if structured_outputs is not None:
        raise APIError("give either response_format or structured_outputs, not both", 400, param=field)
    if kind == "json_object":
        return {"json_object": True}, field
    if kind == "json_schema":
        inner = response_format.get("json_schema")
        schema = inner.get("schema") if isinstance(inner, dict) else None
        if schema is None:
            raise APIError("response_format of type json_schema needs json_schema.schema (a JSON schema "
                           "object), e.g. {'type': 'json_schema', 'json_schema': {'name': 'x', "
                           "'schema': {...}}}", 400, param=field)
        return {"json": schema}, field
    raise APIError(f"response_format type must be 'text', 'json_object' or 'json_schema', got {kind!r}",
                   400, param=field)
