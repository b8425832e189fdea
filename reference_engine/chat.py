"""OpenAI chat completions on top of the completions protocol: messages -> one prompt through a chat template,
and the chat response bodies (no I/O, no torch).

The template is a Hugging Face directory's own (tokenizer_config.json's "chat_template", or
chat_template.jinja), rendered with jinja2 in a sandbox as transformers renders it (jinja2 is installed with
torch). Otherwise, for the synthetic tokenizer and for directories without one, the minimal ChatML template
below: Qwen's turn markers, no tools, no default system prompt.

    <|im_start|>{role}\\n{content}<|im_end|>\\n     for each message, then     <|im_start|>assistant\\n
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from reference_engine.protocol import (
    CompletionRequest,
    RequestError,
    check_type,
    parse_options,
    usage,
)

ROLES = ("system", "developer", "user", "assistant", "tool")

# Chat fields the engine does not implement: accepted at their neutral value only (as protocol._UNSUPPORTED).
_UNSUPPORTED: dict[str, tuple[tuple[type, ...], Any]] = {
    "stop": ((str, list, type(None)), lambda v: v is None or v == []),
    "logprobs": ((bool, type(None)), lambda v: not v),
    "top_logprobs": ((int, type(None)), lambda v: not v),
    "presence_penalty": ((int, float, type(None)), lambda v: not v),
    "frequency_penalty": ((int, float, type(None)), lambda v: not v),
    "logit_bias": ((dict, type(None)), lambda v: not v),
    "tools": ((list, type(None)), lambda v: not v),
    "tool_choice": ((str, dict, type(None)), lambda v: v in (None, "none", "auto")),
    "response_format": ((dict, type(None)), lambda v: v in (None, {"type": "text"})),
}


def chatml(messages: list[dict[str, str]]) -> str:
    turns = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages)
    return turns + "<|im_start|>assistant\n"


class ChatTemplate:
    """messages -> prompt text. `source` says which template: "chatml" or the directory file it came from."""

    def __init__(self, render: Callable[[list[dict[str, str]]], str], source: str) -> None:
        self._render = render
        self.source = source

    def __call__(self, messages: list[dict[str, str]]) -> str:
        try:
            return self._render(messages)
        except Exception as exc:  # a template's raise_exception(...) or any error while rendering
            raise RequestError(f"the chat template cannot render these messages: {exc}", param="messages",
                               code="invalid_value") from None

    @classmethod
    def for_model(cls, model_dir: str | None) -> ChatTemplate:
        """The directory's template when it has one, else ChatML. Raises ValueError for a broken one."""
        if model_dir is None:
            return cls(chatml, "chatml")
        directory = Path(model_dir)
        config: dict = {}
        config_path = directory / "tokenizer_config.json"
        if config_path.is_file():
            try:
                config = json.loads(config_path.read_text())
            except ValueError as exc:
                raise ValueError(f"{config_path} is not valid JSON: {exc}") from None
        text, where = _template_text(directory, config)
        if text is None:
            return cls(chatml, "chatml")
        return cls(_jinja_renderer(text, config, where), where)


def _template_text(directory: Path, config: dict) -> tuple[str | None, str]:
    jinja_file = directory / "chat_template.jinja"
    if jinja_file.is_file():
        return jinja_file.read_text(), str(jinja_file)
    template = config.get("chat_template")
    if isinstance(template, list):  # named templates: the "default" one
        template = next((t.get("template") for t in template if t.get("name") == "default"), None)
    return (template, str(directory / "tokenizer_config.json")) if isinstance(template, str) else (None, "")


def _special(config: dict, name: str) -> str:
    token = config.get(name)
    if isinstance(token, dict):
        token = token.get("content")
    return token if isinstance(token, str) else ""


def _jinja_renderer(text: str, config: dict, where: str) -> Callable[[list[dict[str, str]]], str]:
    from jinja2 import TemplateError
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise TemplateError(message)

    # The environment transformers renders chat templates in.
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = lambda value, indent=None: json.dumps(value, ensure_ascii=False, indent=indent)
    env.globals["raise_exception"] = raise_exception
    try:
        template = env.from_string(text)
    except TemplateError as exc:
        raise ValueError(f"the chat template in {where} does not compile: {exc}") from None
    specials = {"bos_token": _special(config, "bos_token"), "eos_token": _special(config, "eos_token")}
    return lambda messages: template.render(messages=messages, add_generation_prompt=True, **specials)


def _content(message: dict, index: int) -> str:
    param = f"messages[{index}].content"
    content = message.get("content")
    if content is None and message["role"] == "assistant":
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            text_part = isinstance(part, dict) and part.get("type") == "text"
            if not text_part or not isinstance(part.get("text"), str):
                raise RequestError("only text content parts ({'type': 'text', 'text': ...}) are supported",
                                   param=param, code="unsupported_parameter")
            parts.append(part["text"])
        return "".join(parts)
    raise RequestError("'content' must be a string or an array of text parts", param=param,
                       code="invalid_type")


def parse_messages(body: dict) -> list[dict[str, str]]:
    if "messages" not in body:
        raise RequestError("'messages' is required", param="messages", code="missing_field")
    messages = check_type(body, "messages", (list,))
    if not messages:
        raise RequestError("'messages' is empty", param="messages", code="invalid_value")
    plain = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise RequestError("each message must be an object", param=f"messages[{i}]", code="invalid_type")
        role = message.get("role")
        if role not in ROLES:
            raise RequestError(f"'role' must be one of {', '.join(ROLES)}, got {json.dumps(role)[:40]}",
                               param=f"messages[{i}].role", code="invalid_value")
        if message.get("tool_calls"):
            raise RequestError("tool calls are not supported by this server",
                               param=f"messages[{i}].tool_calls", code="unsupported_parameter")
        plain.append({"role": role, "content": _content(message, i)})
    return plain


def parse_chat_request(body: dict, *, template: ChatTemplate, encode, max_model_len: int
                       ) -> CompletionRequest:
    """Validate a /v1/chat/completions body; the rendered conversation becomes the prompt."""
    prompt_ids = encode(template(parse_messages(body)))
    return parse_options(body, prompt_ids, unsupported=_UNSUPPORTED, max_model_len=max_model_len,
                         max_tokens_names=("max_completion_tokens", "max_tokens"), id_prefix="chatcmpl")


# ---- responses

def _envelope(req: CompletionRequest, model: str, obj: str) -> dict:
    return {"id": req.id, "object": obj, "created": req.created, "model": model}


def chat_body(req: CompletionRequest, model: str, *, text: str, finish_reason: str | None,
              completion_tokens: int) -> dict:
    message = {"role": "assistant", "content": text}
    choice = {"index": 0, "message": message, "logprobs": None, "finish_reason": finish_reason}
    return {**_envelope(req, model, "chat.completion"), "choices": [choice],
            "usage": usage(len(req.prompt_ids), completion_tokens)}


def chat_chunk(req: CompletionRequest, model: str, *, text: str, finish_reason: str | None,
               first: bool) -> dict:
    # The role rides on the first token's chunk: one event per engine output, no empty opening event.
    delta = {"role": "assistant", "content": text} if first else {"content": text}
    choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
    return {**_envelope(req, model, "chat.completion.chunk"), "choices": [choice]}


def chat_usage_chunk(req: CompletionRequest, model: str, completion_tokens: int) -> dict:
    return {**_envelope(req, model, "chat.completion.chunk"), "choices": [],
            "usage": usage(len(req.prompt_ids), completion_tokens)}
