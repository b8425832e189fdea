"""The load client of `overshoot run`: a concurrency sweep against an OpenAI-compatible `/v1/completions`.

Each level keeps `concurrency` requests in flight (streaming, `ignore_eos` + `max_tokens`, so every request
decodes exactly max_tokens tokens) for `requests` requests or `duration` seconds. Times are on the host's
monotonic clock (`time.perf_counter_ns`), the clock of the spool, so level windows tag the engine's steps.
Results go to RUN/client.parquet and meta.json["levels"] (docs/contracts.md section 5).
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field

import aiohttp
import pandas as pd

PROMPT_WORD = "the "
CALIBRATION_WORDS = 32


class LoadError(RuntimeError):
    """The server cannot take the load (one-line message)."""


@dataclass(frozen=True)
class LoadPlan:
    base_url: str  # http://127.0.0.1:PORT
    concurrency: tuple[int, ...]
    max_tokens: int
    prompt_tokens: int
    requests: int | None = None  # per level; None with duration None: 4 x concurrency
    duration: float | None = None  # seconds per level
    warmup: int | None = None  # requests per level before its window; None: one per slot (= concurrency)
    model: str | None = None  # None: the first of /v1/models
    request_timeout: float = 600.0

    def requests_per_level(self, concurrency: int) -> int | None:
        """Requests a level sends (None: timed levels, --duration)."""
        if self.duration is not None:
            return self.requests
        return self.requests if self.requests is not None else 4 * concurrency


@dataclass
class LoadResults:
    """Filled while the load runs, so an interrupted run keeps what finished."""

    model: str = ""
    prompt: str = ""
    rows: list[dict] = field(default_factory=list)
    levels: list[dict] = field(default_factory=list)

    def frame(self) -> pd.DataFrame:
        columns = {
            "concurrency": "int32",
            "request": "int64",
            "start_ns": "int64",
            "end_ns": "int64",
            "ttft_ms": "float64",
            "latency_ms": "float64",
            "prompt_tokens": "int32",
            "completion_tokens": "int32",
            "ok": "bool",
            "error": "string",
        }
        frame = pd.DataFrame(self.rows, columns=list(columns))
        return frame.astype(columns)

    def write(self, run_dir) -> None:
        self.frame().to_parquet(f"{run_dir}/client.parquet", index=False)


async def first_model(session: aiohttp.ClientSession, base_url: str) -> str:
    async with session.get(f"{base_url}/v1/models") as resp:
        if resp.status != 200:
            raise LoadError(f"GET /v1/models answered HTTP {resp.status}; pass --model NAME")
        body = await resp.json(content_type=None)
    models = [m.get("id") for m in body.get("data", []) if m.get("id")]
    if not models:
        raise LoadError("GET /v1/models lists no model; pass --model NAME")
    return models[0]


async def calibrated_prompt(session, base_url: str, model: str, prompt_tokens: int) -> str:
    """A prompt of about prompt_tokens tokens for this server's tokenizer (asks it to count a probe)."""
    probe = PROMPT_WORD * CALIBRATION_WORDS
    body = {"model": model, "prompt": probe, "max_tokens": 1, "temperature": 0.0, "ignore_eos": True}
    async with session.post(f"{base_url}/v1/completions", json=body) as resp:
        text = await resp.text()
        if resp.status != 200:
            raise LoadError(f"POST /v1/completions answered HTTP {resp.status}: {text.strip()[:200]}")
    counted = (json.loads(text).get("usage") or {}).get("prompt_tokens") or CALIBRATION_WORDS
    words = max(1, round(prompt_tokens * CALIBRATION_WORDS / counted))
    return PROMPT_WORD * words


async def one_request(
    session, base_url: str, body: dict, concurrency: int, index: int, timeout: float
) -> dict:
    row = {
        "concurrency": concurrency,
        "request": index,
        "ttft_ms": float("nan"),
        "prompt_tokens": 0,
        "completion_tokens": 0,
        "ok": False,
        "error": "",
    }
    start = time.perf_counter_ns()
    chunks = 0
    try:
        async with session.post(
            f"{base_url}/v1/completions", json=body, timeout=aiohttp.ClientTimeout(total=timeout)
        ) as resp:
            if resp.status != 200:
                row["error"] = f"HTTP {resp.status}: {(await resp.text()).strip()[:200]}"
            else:
                async for raw in resp.content:
                    line = raw.decode("utf-8", "replace").strip()
                    if not line.startswith("data:"):
                        continue
                    data = line[5:].strip()
                    if data == "[DONE]":
                        break
                    event = json.loads(data)
                    if event.get("choices") and event["choices"][0].get("text"):
                        chunks += 1
                        if chunks == 1:
                            row["ttft_ms"] = (time.perf_counter_ns() - start) / 1e6
                    usage = event.get("usage")
                    if usage:
                        row["prompt_tokens"] = usage.get("prompt_tokens") or 0
                        row["completion_tokens"] = usage.get("completion_tokens") or 0
                row["completion_tokens"] = row["completion_tokens"] or chunks
                row["ok"] = row["completion_tokens"] > 0
                if not row["ok"]:
                    row["error"] = "no tokens in the answer"
    except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
        row["error"] = f"{type(exc).__name__}: {exc}"[:200] or type(exc).__name__
    end = time.perf_counter_ns()
    row.update(start_ns=start, end_ns=end, latency_ms=(end - start) / 1e6)
    return row


async def run_level(
    session,
    plan: LoadPlan,
    results: LoadResults,
    concurrency: int,
    *,
    count: int | None,
    duration: float | None,
    record: bool,
    on_done=None,
) -> None:
    """Keep `concurrency` requests in flight until `count` were sent or `duration` passed."""
    body = {
        "model": results.model,
        "max_tokens": plan.max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    deadline = None if duration is None else time.perf_counter() + duration
    issued = 0

    async def worker() -> None:
        nonlocal issued
        while (count is None or issued < count) and (deadline is None or time.perf_counter() < deadline):
            index = issued
            issued += 1
            # A distinct head per request: no two prompts share a prefix cache entry entirely.
            request = dict(body, prompt=f"{index} {results.prompt}")
            row = await one_request(session, plan.base_url, request, concurrency, index, plan.request_timeout)
            if record:
                results.rows.append(row)
            if on_done is not None:
                on_done(row)

    await asyncio.gather(*(worker() for _ in range(concurrency)))


async def prepare(session, plan: LoadPlan, results: LoadResults) -> None:
    """The model name and a calibrated prompt; a server that answers oddly is a LoadError, not a traceback."""
    url = plan.base_url
    try:
        results.model = plan.model or await first_model(session, url)
        results.prompt = await calibrated_prompt(session, url, results.model, plan.prompt_tokens)
    except (aiohttp.ClientError, TimeoutError, ValueError, AttributeError, TypeError) as exc:
        raise LoadError(f"cannot query the server at {url}: {type(exc).__name__}: {exc}") from None


async def run_sweep(plan: LoadPlan, results: LoadResults, *, progress=None, on_level_done=None) -> None:
    """Run every level of the plan; `progress` is a rich Progress (or None). Fills `results` as it goes and
    calls on_level_done() after each level (to save what is complete)."""
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector) as session:
        await prepare(session, plan, results)
        for concurrency in plan.concurrency:
            warmup = concurrency if plan.warmup is None else plan.warmup
            if warmup:
                await run_level(
                    session, plan, results, concurrency, count=warmup, duration=None, record=False
                )
            count = plan.requests_per_level(concurrency)
            task = None
            if progress is not None:
                total = count if plan.duration is None else None
                task = progress.add_task(f"concurrency {concurrency}", total=total)
            level = {"concurrency": concurrency, "start_ns": time.perf_counter_ns(), "end_ns": None}
            results.levels.append(level)
            failed = 0

            def done(row: dict, task=task) -> None:
                nonlocal failed
                failed += not row["ok"]
                if progress is not None:
                    progress.advance(task)

            try:
                await run_level(
                    session,
                    plan,
                    results,
                    concurrency,
                    count=count,
                    duration=plan.duration,
                    record=True,
                    on_done=done,
                )
            finally:
                level["end_ns"] = time.perf_counter_ns()
            if on_level_done is not None:
                on_level_done()
            level_rows = [r for r in results.rows if r["concurrency"] == concurrency]
            if level_rows and failed == len(level_rows):
                raise LoadError(
                    f"every request at concurrency {concurrency} failed: {level_rows[-1]['error']}"
                )
