"""Sends a planned workload to a server's OpenAI API and records what each request got:
status, time to first token, gaps between tokens, end to end, usage (cached tokens)
and the replica that served it (`x-loraplex-replica`). Open loop (requests leave at
their planned times, at most `max_in_flight` at once) or closed loop (N users, each
sending its next request when the last one ends). A progress line on stderr."""

from __future__ import annotations

import asyncio
import json
import re
import sys
import time
from collections.abc import AsyncIterator
from dataclasses import asdict, dataclass, field

import httpx

from gateway.loadtest.generators import PlannedRequest
from gateway.loadtest.scenario import Scenario


@dataclass
class Result:
    tenant: str
    adapter: str
    kind: str
    start_s: float  # since the run began
    status: int = 0  # HTTP status; 0: no answer (connection error, timeout)
    ttft_s: float | None = None
    itl_s: list[float] = field(default_factory=list)
    e2e_s: float | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    ideal_cached: int = 0
    replica: str = ""
    error: str = ""
    worker_decode_s: float | None = None  # the worker's time from its first token to its last (its answer's timings), if given

    def as_dict(self) -> dict:
        return asdict(self)


class Progress:
    def __init__(self, total: int, duration_s: float, enabled: bool = True) -> None:
        self.total, self.duration_s, self.enabled = total, duration_s, enabled
        self.done = self.errors = 0
        self.started = time.perf_counter()
        self._last = 0.0

    def update(self, result: Result, force: bool = False) -> None:
        self.done += 1
        self.errors += result.status != 200
        now = time.perf_counter()
        if self.enabled and (force or now - self._last > 0.5):
            self._last = now
            frac = min(1.0, max(self.done / max(self.total, 1), (now - self.started) / self.duration_s))
            bar = "#" * int(30 * frac) + "." * (30 - int(30 * frac))
            print(f"\r[{bar}] {frac:4.0%} {self.done} requests, {self.errors} errors, {now - self.started:5.1f} s",
                  end="", file=sys.stderr, flush=True)

    def close(self) -> None:
        if self.enabled:
            print(file=sys.stderr)


async def sse_lines(response: httpx.Response) -> AsyncIterator[str]:
    """A stream's lines, broken only where SSE breaks them (CR, LF): httpx's `aiter_lines` also breaks at
    U+0085, U+2028 and U+2029, which a JSON string in an event may hold raw (another server's, or a
    token of a model's that decodes to one)."""
    pending = b""
    async for chunk in response.aiter_bytes():
        data = pending + chunk
        cut = len(data) - data.endswith(b"\r")  # a CR last may be the first half of a CR LF
        *lines, pending = re.split(rb"\r\n|\r|\n", data[:cut])
        pending += data[cut:]
        for line in lines:
            yield line.decode(errors="replace")
    if pending:
        yield pending.decode(errors="replace")


async def send(client: httpx.AsyncClient, base_model: str, keys: dict[str, str], request: PlannedRequest, t0: float) -> Result:
    result = Result(request.tenant, request.adapter, request.kind, time.perf_counter() - t0, ideal_cached=request.ideal_cached)
    body = {"model": base_model if request.adapter == "base" else request.adapter, "prompt": request.prompt_ids,
            "max_tokens": request.max_tokens, "temperature": 0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    headers = {"Authorization": f"Bearer {keys[request.tenant]}"} if keys.get(request.tenant) else {}
    started = time.perf_counter()
    last = None
    try:
        async with client.stream("POST", "/v1/completions", json=body, headers=headers) as response:
            result.status = response.status_code
            result.replica = response.headers.get("x-loraplex-replica", "")
            if response.status_code != 200:
                text = (await response.aread()).decode(errors="replace")
                result.error = text[:300]
                return result
            async for line in sse_lines(response):
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[6:])
                if "error" in event:
                    result.error = event["error"].get("message", "stream error")
                    result.status = 599  # failed mid-stream
                    continue
                now = time.perf_counter()
                if event.get("choices") and event["choices"][0].get("text"):
                    if result.ttft_s is None:
                        result.ttft_s = now - started
                    elif last is not None:
                        result.itl_s.append(now - last)
                    last = now
                if event.get("usage"):
                    u = event["usage"]
                    result.prompt_tokens, result.completion_tokens = u["prompt_tokens"], u["completion_tokens"]
                    result.cached_tokens = (u.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
                    predicted_ms = (event.get("timings") or {}).get("predicted_ms")  # llama-server's, which loraplex sends too
                    result.worker_decode_s = predicted_ms / 1e3 if isinstance(predicted_ms, (int, float)) else None
    except httpx.HTTPError as e:
        result.error = f"{type(e).__name__}: {e}"[:300]
    result.e2e_s = time.perf_counter() - started
    return result


async def run_workload(scenario: Scenario, url: str, requests: list[PlannedRequest], base_model: str, keys: dict[str, str],
                       progress: bool = True) -> list[Result]:
    limits = httpx.Limits(max_connections=scenario.load.max_in_flight + 4)
    results: list[Result] = []
    bar = Progress(len(requests), scenario.duration_s, progress)
    async with httpx.AsyncClient(base_url=url, timeout=httpx.Timeout(600.0, connect=10.0), limits=limits) as client:
        t0 = time.perf_counter()
        deadline = t0 + scenario.duration_s
        finished = [asyncio.Event() for _ in requests]  # an aLoRA call waits for its base call

        async def send_after(i: int) -> Result:
            r = requests[i]
            if r.after is not None:
                await finished[r.after].wait()
            try:
                return await send(client, base_model, keys, r, t0)
            finally:
                finished[i].set()

        if scenario.load.mode == "open":
            gate = asyncio.Semaphore(scenario.load.max_in_flight)

            async def one(i: int) -> None:
                await asyncio.sleep(max(0.0, t0 + requests[i].at_s - time.perf_counter()))
                async with gate:
                    result = await send_after(i)
                results.append(result)
                bar.update(result)

            await asyncio.gather(*(one(i) for i in range(len(requests))))
        else:
            queue = list(reversed(range(len(requests))))

            async def user() -> None:
                while queue and time.perf_counter() < deadline:
                    result = await send_after(queue.pop())
                    results.append(result)
                    bar.update(result)

            await asyncio.gather(*(user() for _ in range(scenario.load.users)))
    bar.close()
    return sorted(results, key=lambda r: r.start_s)
