"""The server's pure parts: the incremental decoder and the chat templates (no server, no torch)."""

from __future__ import annotations

import json

import pytest

from reference_engine.chat import ChatTemplate, parse_chat_request
from reference_engine.protocol import IncrementalDecoder, RequestError
from reference_engine.tokenizer import SyntheticTokenizer

TOK = SyntheticTokenizer(512)
WORD = TOK.first_word_id  # decodes to " ba"


def deltas(pushes: list[list[int]], *, final: bool = True) -> list[str]:
    decoder = IncrementalDecoder(TOK.decode)
    return [decoder.push(ids, final=final and i == len(pushes) - 1) for i, ids in enumerate(pushes)]


@pytest.mark.parametrize("pushes,expected", [
    # "€" is three bytes: only its own bytes wait, the "h" before it goes out at once
    ([[104, 0xE2], [0x82], [0xAC], [105]], ["h", "", "€", "i"]),
    ([[WORD], [0xF0], [0x9F], [0x98], [0x80], [WORD]], [" ba", "", "", "", "😀", " ba"]),
    # a byte that cannot start a character waits one token at most
    ([[0x80], [WORD], [0x80], [0x80], [97]], ["", "� ba", "", "�", "�a"]),
    # an incomplete character after a broken one: the broken one goes out, the incomplete one waits
    ([[0x80], [0xE2], [0x82], [0xAC]], ["", "�", "", "€"]),
    # never completed: out with the next character, or at the end
    ([[WORD], [0xE2], [WORD]], [" ba", "", "� ba"]),
    ([[0xE2], [0x82]], ["", "�"]),
    # several tokens in one output (speculative decoding)
    ([[104, 105, 0xE2, 0x82], [0xAC, WORD]], ["hi", "€ ba"]),
])
def test_incremental_decoder_holds_back_only_an_incomplete_character(pushes, expected):
    assert deltas(pushes) == expected
    assert "".join(expected) == TOK.decode([i for p in pushes for i in p])


def test_incremental_decoder_emits_every_word_piece_at_once():
    ids = list(range(WORD, WORD + 200))
    assert all(d for d in deltas([[i] for i in ids])), "a word piece was held back"


def test_chatml_for_the_synthetic_tokenizer():
    template = ChatTemplate.for_model(None)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    prompt = template(messages)
    assert template.source == "chatml"
    assert prompt == ("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
                      "<|im_start|>assistant\n")
    body = {"messages": [{"role": "user", "content": [{"type": "text", "text": "Hi"}]}],
            "max_completion_tokens": 3}
    req = parse_chat_request(body, template=template, encode=TOK.encode, max_model_len=256)
    assert TOK.decode(req.prompt_ids).endswith("user\nHi<|im_end|>\n<|im_start|>assistant\n")
    assert req.max_tokens == 3 and req.id.startswith("chatcmpl-")


def test_a_model_directorys_own_template(tmp_path):
    template_text = ("{{ bos_token }}{% for m in messages %}[{{ m['role'] | upper }}] {{ m['content'] }}\n"
                     "{% endfor %}{% if add_generation_prompt %}[ASSISTANT]{% endif %}")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>",
                                                                "chat_template": template_text}))
    template = ChatTemplate.for_model(str(tmp_path))
    assert template.source.endswith("tokenizer_config.json")
    assert template([{"role": "user", "content": "Hi"}]) == "<s>[USER] Hi\n[ASSISTANT]"
    (tmp_path / "chat_template.jinja").write_text("{{ raise_exception('no ' + messages[0]['role']) }}")
    with pytest.raises(RequestError, match="cannot render these messages: no user"):
        ChatTemplate.for_model(str(tmp_path))([{"role": "user", "content": "Hi"}])
    (tmp_path / "chat_template.jinja").write_text("{% for %}")
    with pytest.raises(ValueError, match="does not compile"):
        ChatTemplate.for_model(str(tmp_path))
    (tmp_path / "chat_template.jinja").unlink()
    (tmp_path / "tokenizer_config.json").write_text("{}")
    assert ChatTemplate.for_model(str(tmp_path)).source == "chatml"


@pytest.mark.parametrize("body,code,param", [
    ({}, "missing_field", "messages"),
    ({"messages": []}, "invalid_value", "messages"),
    ({"messages": "hi"}, "invalid_type", "messages"),
    ({"messages": [{"role": "robot", "content": "x"}]}, "invalid_value", "messages[0].role"),
    ({"messages": [{"role": "user", "content": 5}]}, "invalid_type", "messages[0].content"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "unsupported_parameter",
     "messages[0].content"),
    ({"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]},
     "unsupported_parameter", "tools"),
    ({"messages": [{"role": "user", "content": "x"}], "logprobs": True}, "unsupported_parameter", "logprobs"),
    ({"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 0}, "invalid_value",
     "max_completion_tokens"),
])
def test_bad_chat_requests(body, code, param):
    with pytest.raises(RequestError) as info:
        parse_chat_request(body, template=ChatTemplate.for_model(None), encode=TOK.encode, max_model_len=256)
    assert (info.value.code, info.value.param, info.value.status) == (code, param, 400)
