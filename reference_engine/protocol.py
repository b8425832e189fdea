"""OpenAI completions protocol: request validation and response bodies (no I/O, no torch).

Validation follows the OpenAI API's types: a field of the wrong type is a 400 whose `param` names it. Fields
the engine does not implement are type-checked too and accepted at their neutral value (`stop: null`,
`logprobs: null`, `echo: false`, penalties 0, ...); any other value is a 400 that says it is not supported.
Names the API does not know (e.g. a client's extra_body for another server) are ignored.
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass, field
from typing import Any


class RequestError(Exception):
    """A request the server refuses; becomes an OpenAI-style error body."""

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None,
                 status: int = 400, error_type: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.message, self.param, self.code = message, param, code
        self.status, self.error_type = status, error_type

    def body(self) -> dict:
        return error_body(self.message, error_type=self.error_type, param=self.param, code=self.code)


def error_body(message: str, *, error_type: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": error_type, "param": param, "code": code}}


@dataclass
class CompletionRequest:
    prompt_ids: list[int]
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    ignore_eos: bool = False
    seed: int | None = None
    stream: bool = False
    include_usage: bool = False
    model: str | None = None
    id: str = field(default_factory=lambda: f"cmpl-{uuid.uuid4().hex}")
    created: int = field(default_factory=lambda: int(time.time()))


# name -> (accepted types, neutral value or a predicate saying the value is neutral)
_UNSUPPORTED: dict[str, tuple[tuple[type, ...], Any]] = {
    "stop": ((str, list, type(None)), lambda v: v is None or v == []),
    "logprobs": ((int, type(None)), lambda v: v is None),
    "echo": ((bool,), lambda v: v is False),
    "best_of": ((int, type(None)), lambda v: v in (None, 1)),
    "suffix": ((str, type(None)), lambda v: v in (None, "")),
    "presence_penalty": ((int, float, type(None)), lambda v: not v),
    "frequency_penalty": ((int, float, type(None)), lambda v: not v),
    "logit_bias": ((dict, type(None)), lambda v: not v),
}
_IGNORED = {"user": (str,), "model": (str,)}


def _type_name(types: tuple[type, ...]) -> str:
    names = {bool: "a boolean", int: "an integer", float: "a number", str: "a string", list: "an array",
             dict: "an object", type(None): "null"}
    return " or ".join(dict.fromkeys(names[t] for t in types))


def _matches(value: Any, types: tuple[type, ...]) -> bool:
    # JSON types: a boolean is not a number, an integer is a valid number.
    if isinstance(value, bool):
        return bool in types
    if isinstance(value, int):
        return int in types or float in types
    return any(isinstance(value, t) for t in types if t not in (bool, int))


def _check_type(body: dict, name: str, types: tuple[type, ...]) -> Any:
    value = body[name]
    if not _matches(value, types):
        raise RequestError(f"'{name}' must be {_type_name(types)}, got {json.dumps(value)[:40]}", param=name,
                           code="invalid_type")
    return value


def _optional(body: dict, name: str, types: tuple[type, ...], default: Any) -> Any:
    if body.get(name) is None:
        return default
    return _check_type(body, name, types)


def parse_json(raw: bytes) -> dict:
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise RequestError(f"request body is not valid JSON: {exc}", code="invalid_json") from None
    if not isinstance(body, dict):
        raise RequestError("request body must be a JSON object", code="invalid_json")
    return body


def parse_completion_request(body: dict, *, encode, vocab_size: int, max_model_len: int) -> CompletionRequest:
    """Validate a /v1/completions body; `encode(text) -> list[int]` tokenizes a text prompt."""
    if "prompt" not in body:
        raise RequestError("'prompt' is required", param="prompt", code="missing_field")
    prompt_ids = _prompt_ids(body["prompt"], encode=encode, vocab_size=vocab_size)

    for name, (types, neutral) in _UNSUPPORTED.items():
        if name in body:
            value = _check_type(body, name, types)
            if not neutral(value):
                raise RequestError(f"'{name}' is not supported by this server", param=name,
                                   code="unsupported_parameter")
    for name, types in _IGNORED.items():
        if body.get(name) is not None:
            _check_type(body, name, types)
    n = _optional(body, "n", (int,), 1)
    if n != 1:
        raise RequestError(f"only n=1 is supported, got {n}", param="n", code="unsupported_parameter")

    max_tokens = _optional(body, "max_tokens", (int,), 16)
    if max_tokens <= 0:
        raise RequestError(f"'max_tokens' must be at least 1, got {max_tokens}", param="max_tokens",
                           code="invalid_value")
    if len(prompt_ids) + max_tokens > max_model_len:
        raise RequestError(
            f"This model's maximum context length is {max_model_len} tokens. However, you requested "
            f"{len(prompt_ids) + max_tokens} tokens ({len(prompt_ids)} in the prompt, {max_tokens} for the "
            "completion). Please reduce your prompt or max_tokens.",
            param="prompt" if len(prompt_ids) >= max_model_len else "max_tokens",
            code="context_length_exceeded")

    temperature = float(_optional(body, "temperature", (float,), 1.0))
    if not 0.0 <= temperature <= 2.0:
        raise RequestError(f"'temperature' must be in [0, 2], got {temperature}", param="temperature",
                           code="invalid_value")
    top_p = float(_optional(body, "top_p", (float,), 1.0))
    if not 0.0 < top_p <= 1.0:
        raise RequestError(f"'top_p' must be in (0, 1], got {top_p}", param="top_p", code="invalid_value")
    top_k = _optional(body, "top_k", (int,), 0)
    if top_k < -1:
        raise RequestError(f"'top_k' must be -1, 0 (off) or positive, got {top_k}", param="top_k",
                           code="invalid_value")
    stream = _optional(body, "stream", (bool,), False)
    options = _optional(body, "stream_options", (dict,), {})
    include_usage = False
    if options:
        if not stream:
            raise RequestError("'stream_options' needs 'stream': true", param="stream_options",
                               code="invalid_value")
        include_usage = bool(_optional(options, "include_usage", (bool,), False))
    return CompletionRequest(
        prompt_ids=prompt_ids, max_tokens=max_tokens, temperature=temperature, top_p=top_p,
        top_k=max(top_k, 0), ignore_eos=_optional(body, "ignore_eos", (bool,), False),
        seed=_optional(body, "seed", (int,), None), stream=stream, include_usage=include_usage,
        model=body.get("model"),
    )


def _prompt_ids(prompt: Any, *, encode, vocab_size: int) -> list[int]:
    # One prompt per request: a string, a list of token ids, or a one-element list of either.
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]
    if isinstance(prompt, str):
        ids = encode(prompt)
    elif isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        ids = list(prompt)
        if any(not 0 <= t < vocab_size for t in ids):
            raise RequestError(f"prompt token ids must be in [0, {vocab_size})", param="prompt",
                               code="invalid_value")
    elif isinstance(prompt, list) and prompt and all(isinstance(p, str | list) for p in prompt):
        raise RequestError("only one prompt per request is supported", param="prompt",
                           code="unsupported_parameter")
    else:
        raise RequestError("'prompt' must be a string or an array of token ids", param="prompt",
                           code="invalid_type")
    if not ids:
        raise RequestError("'prompt' is empty", param="prompt", code="invalid_value")
    return ids


# ---- responses

def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def completion_body(req: CompletionRequest, model: str, *, text: str, finish_reason: str | None,
                    completion_tokens: int | None = None) -> dict:
    """A full response (completion_tokens given) or one streamed chunk (completion_tokens None)."""
    body = {
        "id": req.id, "object": "text_completion", "created": req.created, "model": model,
        "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}],
    }
    if completion_tokens is not None:
        body["usage"] = usage(len(req.prompt_ids), completion_tokens)
    return body


def usage_chunk(req: CompletionRequest, model: str, completion_tokens: int) -> dict:
    return {"id": req.id, "object": "text_completion", "created": req.created, "model": model, "choices": [],
            "usage": usage(len(req.prompt_ids), completion_tokens)}


class IncrementalDecoder:
    """Token ids -> text deltas, holding back bytes of a character that is not complete yet.

    Decodes a short window (ids from the last emitted boundary), so cost per token stays constant.
    """

    def __init__(self, decode) -> None:
        self._decode = decode
        self.ids: list[int] = []
        self._prefix = 0  # window start
        self._read = 0  # ids already turned into emitted text

    def push(self, new_ids: list[int], *, final: bool = False) -> str:
        self.ids.extend(new_ids)
        prefix_text = self._decode(self.ids[self._prefix:self._read])
        text = self._decode(self.ids[self._prefix:])
        if len(text) > len(prefix_text) and (final or not text.endswith("\ufffd")):
            self._prefix, self._read = self._read, len(self.ids)
            return text[len(prefix_text):]
        return ""
