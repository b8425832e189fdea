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


def check_type(body: dict, name: str, types: tuple[type, ...]) -> Any:
    value = body[name]
    if not _matches(value, types):
        raise RequestError(f"'{name}' must be {_type_name(types)}, got {json.dumps(value)[:40]}", param=name,
                           code="invalid_type")
    return value


def _optional(body: dict, name: str, types: tuple[type, ...], default: Any) -> Any:
    if body.get(name) is None:
        return default
    return check_type(body, name, types)


def check_model(body: dict, served: str) -> None:
    """A request naming another model than the one served is a 404, as OpenAI's API answers it."""
    model = body.get("model")
    if isinstance(model, str) and model != served:
        raise RequestError(f"The model `{model}` does not exist; this server serves `{served}`.",
                           param="model", code="model_not_found", status=404)


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
    return parse_options(body, prompt_ids, unsupported=_UNSUPPORTED, max_model_len=max_model_len)


def parse_options(body: dict, prompt_ids: list[int], *, unsupported: dict, max_model_len: int,
                  max_tokens_names: tuple[str, ...] = ("max_tokens",), id_prefix: str = "cmpl"
                  ) -> CompletionRequest:
    """The sampling and streaming fields both endpoints share. `unsupported`: the endpoint's fields accepted
    at their neutral value only; `max_tokens_names`: the field(s) naming the completion's length."""
    for name, (types, neutral) in unsupported.items():
        if name in body:
            value = check_type(body, name, types)
            if not neutral(value):
                raise RequestError(f"'{name}' is not supported by this server", param=name,
                                   code="unsupported_parameter")
    for name, types in _IGNORED.items():
        if body.get(name) is not None:
            check_type(body, name, types)
    n = _optional(body, "n", (int,), 1)
    if n != 1:
        raise RequestError(f"only n=1 is supported, got {n}", param="n", code="unsupported_parameter")

    length_name = next((name for name in max_tokens_names if body.get(name) is not None), max_tokens_names[0])
    max_tokens = _optional(body, length_name, (int,), 16)
    if max_tokens <= 0:
        raise RequestError(f"'{length_name}' must be at least 1, got {max_tokens}", param=length_name,
                           code="invalid_value")
    if len(prompt_ids) + max_tokens > max_model_len:
        raise RequestError(
            f"This model's maximum context length is {max_model_len} tokens. However, you requested "
            f"{len(prompt_ids) + max_tokens} tokens ({len(prompt_ids)} in the prompt, {max_tokens} for the "
            "completion). Please reduce your prompt or max_tokens.",
            param="prompt" if len(prompt_ids) >= max_model_len else length_name,
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
        model=body.get("model"), id=f"{id_prefix}-{uuid.uuid4().hex}",
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


MAX_CHAR_TOKENS = 4  # a UTF-8 character has at most 4 bytes, and a token brings at least one


class IncrementalDecoder:
    """Token ids -> text deltas. Holds back only a character that may still be incomplete: the decoded text's
    last character when it is U+FFFD, until the ids since that character began are too many to be one
    incomplete character (MAX_CHAR_TOKENS). Everything before it goes out at once.

    Decodes a short window (from one emitted segment back, for decoders that treat a leading token
    differently, as vLLM does), so the cost per token stays constant.
    """

    def __init__(self, decode) -> None:
        self._decode = decode
        self.ids: list[int] = []
        self._start = 0  # window start: ids[_start:_read] were emitted in full
        self._read = 0
        self._sent = 0  # characters of the window's text already emitted
        self._held_len = -1  # length of the window's text when its held-back last character appeared
        self._held_from = 0  # ids before the push that brought it

    def push(self, new_ids: list[int], *, final: bool = False) -> str:
        before = len(self.ids)
        self.ids.extend(new_ids)
        text = self._decode(self.ids[self._start:])
        if text.endswith("\ufffd") and not final:
            if len(text) != self._held_len:  # a new last character: it may still complete
                self._held_len, self._held_from = len(text), self._char_start(len(text), before)
            if len(self.ids) - self._held_from < MAX_CHAR_TOKENS:
                return self._emit(text[:-1])
        delta = self._emit(text)
        # All of the text is out: the window moves on to the ids just emitted.
        self._start, self._read = self._read, len(self.ids)
        self._sent = len(self._decode(self.ids[self._start:self._read]))
        self._held_len = -1
        return delta

    def _char_start(self, length: int, before: int) -> int:
        """The first id of the text's new last character: an output may bring several ids (speculative
        decoding), and the character began with one of them."""
        lowest = max(before, len(self.ids) - MAX_CHAR_TOKENS)
        for j in range(len(self.ids) - 1, lowest, -1):
            if len(self._decode(self.ids[self._start:j])) < length:
                return j
        return lowest

    def _emit(self, ready: str) -> str:
        delta = ready[self._sent:]
        self._sent = max(self._sent, len(ready))
        return delta
