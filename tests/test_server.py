"""The real server as a subprocess (tiny preset, CPU, 127.0.0.1), driven by the openai client and aiohttp."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import aiohttp
import openai
import pytest

REPO = Path(__file__).resolve().parents[1]
MAX_MODEL_LEN = 1024  # long enough that a 1000-token request is still running when the test acts on it


class ServerProcess:
    """`python -m reference_engine serve` with its merged output collected on a thread."""

    def __init__(self, port: int, *extra: str) -> None:
        self.port = port
        self.url = f"http://127.0.0.1:{port}"
        env = {k: v for k, v in os.environ.items() if not k.startswith("OVERSHOOT_")}
        env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
        self.process = subprocess.Popen(
            [sys.executable, "-m", "reference_engine", "serve", "--preset", "tiny", "--device", "cpu",
             "--port", str(port), "--max-model-len", str(MAX_MODEL_LEN), *extra],
            cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self.lines: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for line in self.process.stdout:
            self.lines.append(line.rstrip("\n"))

    @property
    def log(self) -> str:
        return "\n".join(self.lines)

    def wait_ready(self, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while not any("ready" in line for line in self.lines):
            if self.process.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise AssertionError(f"server did not become ready:\n{self.log}")
            time.sleep(0.05)

    def stop(self) -> int:
        """SIGTERM, then SIGKILL if it lingers; returns the exit code."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self._reader.join(timeout=5)
        return self.process.returncode


@pytest.fixture(scope="module")
def server():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = ServerProcess(port)
    try:
        proc.wait_ready()
        yield proc
    finally:
        proc.stop()


def get_json(url: str) -> tuple[int, dict]:
    async def fetch():
        async with aiohttp.ClientSession() as session, session.get(url) as resp:
            return resp.status, await resp.json()

    return asyncio.run(fetch())


def post_raw(url: str, data: bytes) -> tuple[int, dict]:
    async def fetch():
        async with aiohttp.ClientSession() as session, session.post(
                url, data=data, headers={"Content-Type": "application/json"}) as resp:
            return resp.status, await resp.json()

    return asyncio.run(fetch())


def wait_for(predicate, timeout: float = 10.0, what: str = "condition"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.02)
    raise AssertionError(f"timed out waiting for {what}")


def test_startup_log_models_and_health(server):
    log = server.log
    assert "graph=eager" in log and "kernels=torch" in log and "captured graphs:" in log
    assert "s to ready" in log
    status, models = get_json(f"{server.url}/v1/models")
    assert status == 200
    assert models["object"] == "list" and models["data"][0]["id"] == "tiny"
    status, health = get_json(f"{server.url}/health")
    assert status == 200 and health["status"] == "ready"
    assert health["kv_blocks_total"] > 0 and health["kv_blocks_used"] == 0


@pytest.fixture(scope="module")
def local_engine():
    """The server's model in this process (same preset and seed: same weights), for exact expectations."""
    from reference_engine.config import Config
    from reference_engine.engine import Engine

    return Engine(Config(preset="tiny", device="cpu", max_model_len=MAX_MODEL_LEN))


def test_openai_client_matches_in_process_engine(server, local_engine):
    from reference_engine.engine import SamplingParams

    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
    result = client.completions.create(model="tiny", prompt="Hello", max_tokens=12, temperature=0.0,
                                       extra_body={"ignore_eos": True})
    assert result.object == "text_completion" and result.model == "tiny" and result.id.startswith("cmpl-")
    assert result.created > 0
    choice = result.choices[0]
    assert choice.index == 0 and choice.finish_reason == "length"
    usage = result.usage
    assert (usage.prompt_tokens, usage.completion_tokens, usage.total_tokens) == (5, 12, 17)

    # Same weights (same seed and preset) in this process: greedy text must be identical.
    engine = local_engine
    prompt = engine.tokenizer.encode("Hello")
    [ids] = engine.generate([prompt], SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))
    assert choice.text == engine.tokenizer.decode(ids)

    by_ids = client.completions.create(model="tiny", prompt=prompt, max_tokens=12, temperature=0.0,
                                       extra_body={"ignore_eos": True})
    assert by_ids.choices[0].text == choice.text and by_ids.usage.prompt_tokens == 5


def test_streaming_with_openai_client(server):
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
    kwargs = dict(model="tiny", prompt=[7, 8, 9], max_tokens=20, temperature=0.0,
                  extra_body={"ignore_eos": True})
    full = client.completions.create(**kwargs)
    chunks = list(client.completions.create(stream=True, stream_options={"include_usage": True}, **kwargs))
    text_chunks, usage_chunk = chunks[:-1], chunks[-1]
    assert "".join(c.choices[0].text for c in text_chunks) == full.choices[0].text
    assert [c.choices[0].finish_reason for c in text_chunks][-1] == "length"
    assert all(c.choices[0].finish_reason is None for c in text_chunks[:-1])
    assert len({c.id for c in chunks}) == 1
    assert usage_chunk.choices == [] and usage_chunk.usage.completion_tokens == 20
    assert usage_chunk.usage.prompt_tokens == 3


def test_random_preset_streams_one_event_per_token_with_visible_text(server, local_engine):
    """tiny has 512 ids: bytes, 3 specials and word pieces. Greedy output is known from the in-process engine:
    one SSE event per token (sync, no drafts), and an event's text is empty only while a character's bytes
    are incomplete (a byte of 0x80 and up) or for a special; every word piece shows at once."""
    from reference_engine.engine import SamplingParams

    tok = local_engine.tokenizer
    prompts = [[7, 8, 9], tok.encode("Hello, streaming"), [300, 301, 302, 303]]
    for prompt in prompts:
        greedy = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
        [ids] = local_engine.generate([prompt], greedy)
        body = {"prompt": prompt, "max_tokens": 40, "temperature": 0.0, "ignore_eos": True, "stream": True}
        events = asyncio.run(_stream_events(server.url, body))
        texts = [e["choices"][0]["text"] for e in events]
        assert len(texts) == len(ids) == 40
        assert "".join(texts) == tok.decode(ids) and "".join(texts).strip()
        specials = {tok.bos_token_id, tok.eos_token_id, tok.pad_token_id}
        for token, text in zip(ids, texts, strict=True):
            if token >= tok.first_word_id:  # a word piece: its event shows it
                piece = tok.decode([token])
                assert piece.strip() and text.endswith(piece), (token, text)
            elif not text:
                assert token >= 0x80 or token in specials, (token, ids)
        assert sum(1 for t in ids if t >= tok.first_word_id) >= 5  # the test saw word pieces


async def _stream_events(url: str, body: dict, path: str = "/v1/completions") -> list[dict]:
    async with aiohttp.ClientSession() as session, session.post(f"{url}{path}", json=body) as resp:
        assert resp.status == 200
        raw = (await resp.read()).decode()
    events = [line[6:] for line in raw.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    return [json.loads(e) for e in events[:-1]]


def test_chat_completions_with_openai_client(server, local_engine):
    from reference_engine.chat import chatml

    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
    messages = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Say hi"}]
    kwargs = dict(model="tiny", messages=messages, max_tokens=12, temperature=0.0,
                  extra_body={"ignore_eos": True})
    full = client.chat.completions.create(**kwargs)
    assert full.object == "chat.completion" and full.id.startswith("chatcmpl-") and full.model == "tiny"
    choice = full.choices[0]
    assert choice.message.role == "assistant" and choice.message.content and choice.finish_reason == "length"
    prompt_tokens = len(local_engine.tokenizer.encode(chatml(messages)))
    assert (full.usage.prompt_tokens, full.usage.completion_tokens) == (prompt_tokens, 12)

    chunks = list(client.chat.completions.create(stream=True, stream_options={"include_usage": True},
                                                 **kwargs))
    deltas, usage = chunks[:-1], chunks[-1]
    assert len(deltas) == 12 and all(c.object == "chat.completion.chunk" for c in chunks)
    assert deltas[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content for c in deltas) == choice.message.content
    assert deltas[-1].choices[0].finish_reason == "length" and usage.usage.completion_tokens == 12
    # max_completion_tokens, the newer name of max_tokens
    short = client.chat.completions.create(model="tiny", messages=messages, max_completion_tokens=3)
    assert short.usage.completion_tokens <= 3
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="tiny", messages=[{"role": "robot", "content": "x"}])
    assert info.value.body["param"] == "messages[0].role"


def test_unknown_model_route_and_big_body_get_json_errors(server):
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
    user = [{"role": "user", "content": "x"}]
    for call in (lambda: client.completions.create(model="gpt-4o", prompt="hi", max_tokens=2),
                 lambda: client.chat.completions.create(model="gpt-4o", messages=user)):
        with pytest.raises(openai.NotFoundError) as info:
            call()
        assert info.value.body["code"] == "model_not_found" and "gpt-4o" in info.value.body["message"]

    async def raw(method: str, path: str, data: bytes | None = None) -> tuple[int, dict]:
        async with aiohttp.ClientSession() as session, session.request(
                method, f"{server.url}{path}", data=data) as resp:
            assert resp.content_type == "application/json"
            return resp.status, await resp.json()

    status, body = asyncio.run(raw("POST", "/v1/no-such-route", b"{}"))
    assert status == 404 and body["error"]["message"] == "Invalid URL (POST /v1/no-such-route)"
    status, body = asyncio.run(raw("POST", "/v1/completions", b"x" * (17 * 1024 * 1024)))
    assert status == 413 and "16 MiB" in body["error"]["message"]
    status, body = asyncio.run(raw("GET", "/v1/chat/completions"))
    assert status == 405 and body["error"]["code"] == "method_not_allowed"


def test_eight_concurrent_streams(server):
    _, before = get_json(f"{server.url}/stats")
    lengths = [9, 17, 23, 31, 40, 12, 5, 28]

    async def one(client: openai.AsyncOpenAI, max_tokens: int) -> tuple[int, str | None, int]:
        stream = await client.completions.create(
            model="tiny", prompt=f"request {max_tokens}", max_tokens=max_tokens, temperature=0.8, top_p=0.9,
            stream=True, stream_options={"include_usage": True}, extra_body={"ignore_eos": True, "top_k": 50})
        finish, usage = None, None
        async for chunk in stream:
            if chunk.choices and chunk.choices[0].finish_reason:
                finish = chunk.choices[0].finish_reason
            if chunk.usage:
                usage = chunk.usage.completion_tokens
        return max_tokens, finish, usage

    async def run_all():
        client = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
        async with client:
            return await asyncio.gather(*(one(client, n) for n in lengths))

    for max_tokens, finish, usage in asyncio.run(run_all()):
        assert (finish, usage) == ("length", max_tokens)
    _, after = get_json(f"{server.url}/stats")
    decode_steps = after["engine"]["decode_steps"] - before["engine"]["decode_steps"]
    # Continuous batching: far fewer decode steps than tokens (one step decodes every running request).
    assert max(lengths) - 1 <= decode_steps < sum(lengths) // 2
    assert after["kv_blocks_used"] == 0 and after["in_flight"] == 0


BAD_REQUESTS = [
    (b'{"prompt": "hi", "max_tokens": 4', "invalid_json", None),
    (b'["not", "an", "object"]', "invalid_json", None),
    (b'{"max_tokens": 4}', "missing_field", "prompt"),
    (b'{"prompt": 123}', "invalid_type", "prompt"),
    (b'{"prompt": []}', "invalid_value", "prompt"),
    (b'{"prompt": ["a", "b"]}', "unsupported_parameter", "prompt"),
    (b'{"prompt": [1, 99999]}', "invalid_value", "prompt"),
    (b'{"prompt": "hi", "max_tokens": "4"}', "invalid_type", "max_tokens"),
    (b'{"prompt": "hi", "max_tokens": true}', "invalid_type", "max_tokens"),
    (b'{"prompt": "hi", "max_tokens": 0}', "invalid_value", "max_tokens"),
    (b'{"prompt": "hi", "max_tokens": -3}', "invalid_value", "max_tokens"),
    (b'{"prompt": "hi", "n": 2}', "unsupported_parameter", "n"),
    (b'{"prompt": "hi", "temperature": "hot"}', "invalid_type", "temperature"),
    (b'{"prompt": "hi", "top_p": 0}', "invalid_value", "top_p"),
    (b'{"prompt": "hi", "stream": "yes"}', "invalid_type", "stream"),
    (b'{"prompt": "hi", "ignore_eos": 1}', "invalid_type", "ignore_eos"),
    (b'{"prompt": "hi", "stop": 5}', "invalid_type", "stop"),  # a field we do not use, wrong type
    (b'{"prompt": "hi", "logprobs": "many"}', "invalid_type", "logprobs"),
    (b'{"prompt": "hi", "echo": true}', "unsupported_parameter", "echo"),
    (b'{"prompt": "hi", "max_tokens": 2000}', "context_length_exceeded", "max_tokens"),
]


@pytest.mark.parametrize("raw,code,param", BAD_REQUESTS, ids=[r[0].decode()[:40] for r in BAD_REQUESTS])
def test_bad_request_gets_400_openai_error(server, raw, code, param):
    status, body = post_raw(f"{server.url}/v1/completions", raw)
    assert status == 400, body
    assert set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["type"] == "invalid_request_error" and body["error"]["message"]
    assert (body["error"]["code"], body["error"]["param"]) == (code, param)


def test_prompt_too_long_and_unknown_fields(server):
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model="tiny", prompt=[5] * MAX_MODEL_LEN, max_tokens=1)
    assert info.value.body["code"] == "context_length_exceeded" and info.value.body["param"] == "prompt"
    # Names the API does not know are ignored; neutral values of unsupported fields are accepted.
    status, body = post_raw(f"{server.url}/v1/completions",
                            b'{"prompt": "hi", "max_tokens": 2, "some_other_server_option": {"x": 1}, '
                            b'"stop": null, "echo": false, "presence_penalty": 0}')
    assert status == 200 and body["usage"]["completion_tokens"] <= 2


async def _stream_first_chunk_then(url: str, action) -> None:
    body = {"prompt": "long", "max_tokens": 1000, "ignore_eos": True, "stream": True, "temperature": 0.0}
    async with aiohttp.ClientSession() as session:
        resp = await session.post(f"{url}/v1/completions", json=body)
        line = await resp.content.readline()
        assert line.startswith(b"data: ") and json.loads(line[6:])["choices"][0]["finish_reason"] is None
        await action()
        resp.close()  # drop the connection mid-stream


def test_client_disconnect_frees_kv_blocks(server):
    async def check_busy():
        status, health = await asyncio.to_thread(get_json, f"{server.url}/health")
        assert health["kv_blocks_used"] > 0 and health["in_flight"] == 1

    _, before = get_json(f"{server.url}/stats")
    asyncio.run(_stream_first_chunk_then(server.url, check_busy))
    wait_for(lambda: get_json(f"{server.url}/health")[1]["kv_blocks_used"] == 0, what="blocks freed (stream)")

    async def non_streaming_then_give_up():
        body = {"prompt": "long", "max_tokens": 1000, "ignore_eos": True}
        async with aiohttp.ClientSession() as session:
            with pytest.raises(asyncio.TimeoutError):
                await session.post(f"{server.url}/v1/completions", json=body,
                                   timeout=aiohttp.ClientTimeout(total=0.5))

    asyncio.run(non_streaming_then_give_up())
    # The handler ends first; the engine frees the blocks at its next step.
    def idle() -> bool:
        health = get_json(f"{server.url}/health")[1]
        return health["in_flight"] == 0 and health["kv_blocks_used"] == 0

    wait_for(idle, what="blocks freed (non-streaming)")
    _, after = get_json(f"{server.url}/stats")
    # Both were aborted well before their 1000 tokens each.
    assert after["engine"]["tokens_generated"] - before["engine"]["tokens_generated"] < 1000


def test_overload_503_then_sigterm_drains_and_exits_0(free_port):
    proc = ServerProcess(free_port, "--max-num-seqs", "1", "--queue-limit", "1", "--drain-timeout", "1")
    try:
        proc.wait_ready()

        async def scenario():
            body = {"prompt": "x", "max_tokens": 1000, "ignore_eos": True, "stream": True}
            async with aiohttp.ClientSession() as session:
                streams = [await session.post(f"{proc.url}/v1/completions", json=body) for _ in range(2)]
                assert [s.status for s in streams] == [200, 200]
                # Both admitted (one running, one waiting): a third is refused.
                async with session.post(f"{proc.url}/v1/completions", json=body) as resp:
                    assert resp.status == 503
                    error = (await resp.json())["error"]
                    assert error["code"] == "overloaded" and "queue limit 1" in error["message"]
                proc.process.send_signal(signal.SIGTERM)
                # Draining: in-flight streams end (aborted after --drain-timeout 1) with [DONE].
                for stream in streams:
                    text = (await stream.read()).decode()
                    assert text.rstrip().endswith("data: [DONE]")
                    finishes = [json.loads(line[6:])["choices"][0]["finish_reason"]
                                for line in text.splitlines() if line.startswith("data: {")]
                    assert finishes[-1] in ("abort", "length")

        asyncio.run(scenario())
        assert proc.process.wait(timeout=15) == 0
        assert "draining" in proc.log and "Traceback" not in proc.log
    finally:
        proc.stop()


def test_sigterm_drains_in_flight_request_then_exits_0(free_port):
    proc = ServerProcess(free_port)
    try:
        proc.wait_ready()

        async def scenario():
            body = {"prompt": "x", "max_tokens": 300, "ignore_eos": True, "stream": True,
                    "stream_options": {"include_usage": True}}
            async with aiohttp.ClientSession() as session:
                stream = await session.post(f"{proc.url}/v1/completions", json=body)
                assert (await stream.content.readline()).startswith(b"data: ")
                proc.process.send_signal(signal.SIGTERM)
                for _ in range(200):  # until the signal is handled
                    async with session.get(f"{proc.url}/health") as resp:
                        if (await resp.json())["status"] == "draining":
                            assert resp.status == 503
                            break
                    await asyncio.sleep(0.01)
                async with session.post(f"{proc.url}/v1/completions", json={"prompt": "y"}) as resp:
                    assert resp.status == 503 and "shutting down" in (await resp.json())["error"]["message"]
                # The in-flight request still completes in full (drain timeout 30 s by default).
                events = [line[6:] for line in (await stream.read()).decode().splitlines()
                          if line.startswith("data: ")]
                assert events[-1] == "[DONE]"
                assert json.loads(events[-2])["usage"]["completion_tokens"] == 300
                assert json.loads(events[-3])["choices"][0]["finish_reason"] == "length"

        asyncio.run(scenario())
        assert proc.process.wait(timeout=15) == 0
    finally:
        proc.stop()
    assert "draining 1 request" in proc.log and "stopped" in proc.log and "Traceback" not in proc.log


def test_port_in_use_fails_with_one_line(free_port):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", free_port))
        busy.listen()
        result = subprocess.run(
            [sys.executable, "-m", "reference_engine", "serve", "--preset", "tiny", "--device", "cpu",
             "--port", str(free_port)], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert result.returncode != 0
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "cannot listen on 127.0.0.1" in lines[0], result.stderr


@pytest.mark.parametrize("args,expected", [
    (["--preset", "bogus"], "invalid choice: 'bogus'"),
    (["--port", "0"], "must be positive"),
    (["--num-blocks", "1"], "num_blocks must be at least 2"),  # caught by Config, not argparse
])
def test_bad_cli_input_is_one_line(args, expected):
    result = subprocess.run([sys.executable, "-m", "reference_engine", "serve", "--device", "cpu", *args],
                            cwd=REPO, capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and expected in lines[0], result.stderr
