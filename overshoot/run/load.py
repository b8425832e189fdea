"""The load client of `overshoot run`: a concurrency sweep against an OpenAI-compatible `/v1/completions`.

Each level keeps `concurrency` requests in flight (streaming, `ignore_eos` + `max_tokens`, so every request
decodes exactly max_tokens tokens) for `requests` requests or `duration` seconds. Times are on the host's
monotonic clock (`time.perf_counter_ns`), the clock of the spool, so level windows tag the engine's steps.
A token event is a streamed event with a choice (one per engine output on the reference server and vLLM): TTFT
is the time to the first one, inter-token latencies (ITL) are the gaps between them, whatever text they carry.
Tokens are counted from the `usage` event (`stream_options.include_usage`), else one per token event.
Results go to RUN/client.parquet and meta.json["levels"] (docs/contracts.md section 5).
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field

import aiohttp
import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq

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

    def table(self) -> pa.Table:
        return pa.table({name: [row.get(name) for row in self.rows] for name in CLIENT_SCHEMA.names},
                        schema=CLIENT_SCHEMA)

    def frame(self) -> pd.DataFrame:
        return self.table().to_pandas()

    def write(self, run_dir) -> None:
        pq.write_table(self.table(), f"{run_dir}/client.parquet")


CLIENT_SCHEMA = pa.schema([
    ("concurrency", pa.int32()),
    ("request", pa.int64()),
    ("start_ns", pa.int64()),
    ("end_ns", pa.int64()),
    ("ttft_ms", pa.float64()),
    ("latency_ms", pa.float64()),
    ("prompt_tokens", pa.int32()),
    ("completion_tokens", pa.int32()),
    ("token_events", pa.int32()),
    ("itl_ms_p50", pa.float64()),  # this request's inter-token latencies
    ("itl_ms_p90", pa.float64()),
    ("itl_ms_p99", pa.float64()),
    ("itl_ms", pa.list_(pa.float64())),  # every gap, for percentiles over a level
    ("ok", pa.bool_()),
    ("error", pa.string()),
])  # fmt: skip


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


def is_token_event(event: dict) -> bool:
    """An event with a choice; a closing one with only a finish_reason and no text carries no token."""
    choices = event.get("choices")
    if not choices:
        return False
    return bool(choices[0].get("text")) or choices[0].get("finish_reason") is None


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
    token_ns: list[int] = []
    usage = None
    try:
        async with session.post(
            f"{base_url}/v1/completions", json=body, timeout=aiohttp.ClientTimeout(total=timeout)
        ) as resp:
            if resp.status != 200:
                row["error"] = f"HTTP {resp.status}: {(await resp.text()).strip()[:200]}"
            else:
                async for raw in resp.content:
                    arrived = time.perf_counter_ns()  # before parsing: the event's arrival
                    line = raw.decode("utf-8", "replace").strip()
                    if not line.startswith("data:"):
                        continue
                    data = line[5:].strip()
                    if data == "[DONE]":
                        break
                    event = json.loads(data)
                    if is_token_event(event):
                        token_ns.append(arrived)
                    usage = event.get("usage") or usage
                row["prompt_tokens"] = (usage or {}).get("prompt_tokens") or 0
                row["completion_tokens"] = (usage or {}).get("completion_tokens") or len(token_ns)
                row["ok"] = row["completion_tokens"] > 0
                if not row["ok"]:
                    row["error"] = "no tokens in the answer"
    except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
        row["error"] = f"{type(exc).__name__}: {exc}"[:200] or type(exc).__name__
    end = time.perf_counter_ns()
    row.update(start_ns=start, end_ns=end, latency_ms=(end - start) / 1e6, **token_times(start, token_ns))
    return row


def token_times(start_ns: int, token_ns: list[int]) -> dict:
    """TTFT, the gaps between token events and their percentiles (NaN where there are none)."""
    gaps = np.diff(np.asarray(token_ns, dtype=np.int64)) / 1e6
    p50, p90, p99 = np.percentile(gaps, [50, 90, 99]) if len(gaps) else (float("nan"),) * 3
    return {
        "ttft_ms": (token_ns[0] - start_ns) / 1e6 if token_ns else float("nan"),
        "token_events": len(token_ns),
        "itl_ms_p50": float(p50),
        "itl_ms_p90": float(p90),
        "itl_ms_p99": float(p99),
        "itl_ms": gaps.tolist(),
    }


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
