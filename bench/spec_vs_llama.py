"""loraplex against llama-server, one stream, greedy, the same chat prompts (bench/bench_speculative.py's
workloads: JSON extraction, a rewrite that copies its prompt, free chat), each without and with n-gram
speculative decoding, side by side in one run: the requests go to the four servers in turn, prompt by
prompt, so the machine's noise hits all alike. Decode speed is each answer's own `timings`
(`predicted_n` over `predicted_ms`: both servers report llama-server's timings), acceptance its
`draft_n_accepted` over `draft_n`.

Not a test (llama-server is never a dependency): a developer's check against a llama-server built from
llama.cpp's source on the same GGUF:

    python -m bench.spec_vs_llama --llama-server /path/to/llama-server [--count 4] [--max-tokens 128]

llama-server runs twice: plain, and with `--spec-type ngram-simple` (its lookup of the last tokens in
the sequence's own context, the closest to loraplex's `ngram`), its sizes at their defaults. loraplex
runs once with `speculative: {method: ngram, max_draft: 4}`; its requests without speculation say
`"speculative": 0` (the per-request switch: nothing is drafted for them).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from bench.bench_speculative import WORKLOADS, prompts, response_format
from bench.server import Server
from bench.cluster import free_port
from worker.formats.default_model import default_model_path

START_TIMEOUT_S = 300.0


def llama_server(binary: str, model: Path, port: int, extra: list[str]) -> subprocess.Popen:
    process = subprocess.Popen([binary, "-m", str(model), "--port", str(port), "-np", "1", "--jinja", "-t", "2", *extra],
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return process
        except httpx.HTTPError:
            pass
        if process.poll() is not None:
            raise RuntimeError(f"llama-server {' '.join(extra)} exited ({process.returncode})")
        time.sleep(0.5)
    process.kill()
    raise RuntimeError("llama-server did not start in time")


def ask(url: str, prompt: str, max_tokens: int, extra: dict) -> dict:
    body = {"messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens, "temperature": 0, **extra}
    answer = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=600)
    answer.raise_for_status()
    return answer.json()["timings"]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.spec_vs_llama", description=__doc__.split("\n\n")[0])
    ap.add_argument("--llama-server", required=True, help="the llama-server binary")
    ap.add_argument("--model", default=None, help="the GGUF (default: loraplex's default model, SmolLM2-135M Q4_1)")
    ap.add_argument("--count", type=int, default=4, help="prompts a workload (default: 4)")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--llama-spec", default="ngram-simple", help="llama-server's --spec-type (default: ngram-simple)")
    args = ap.parse_args(argv)
    model = Path(args.model) if args.model else default_model_path()
    sides: dict[str, tuple[str, dict]] = {}
    processes: list[subprocess.Popen] = []
    server = None
    try:
        for name, extra in (("llama", []), ("llama+ngram", ["--spec-type", args.llama_spec])):
            port = free_port()
            processes.append(llama_server(args.llama_server, model, port, extra))
            sides[name] = (f"http://127.0.0.1:{port}", {})
        port = free_port()
        config = {"model": str(model), "adapters": [], "shards": [{"name": "base", "adapters": [], "replicas": 1}],
                  "cache": {"redis_url": None}, "state": {"ephemeral": True}, "auth": "none",
                  "speculative": {"method": "ngram", "max_draft": 4}, "http": {"host": "127.0.0.1", "port": port}}
        server = Server(config, Path(tempfile.mkdtemp(prefix="spec-vs-llama-")), port, START_TIMEOUT_S)
        sides["loraplex"] = (server.url, {"speculative": 0})
        sides["loraplex+ngram"] = (server.url, {})
        for url, extra in sides.values():  # warm each once (the first answer loads what it loads)
            ask(url, "Hello", 8, extra)
        totals = {(w, s): [0, 0.0, 0, 0] for w in WORKLOADS for s in sides}  # tokens, ms, drafted, accepted
        for workload in WORKLOADS:
            for prompt in prompts(workload, args.count):
                for side, (url, extra) in sides.items():
                    t = ask(url, prompt, args.max_tokens, {**extra, **response_format(workload)})
                    total = totals[(workload, side)]
                    total[0] += t["predicted_n"]
                    total[1] += t["predicted_ms"]
                    total[2] += t.get("draft_n", 0)
                    total[3] += t.get("draft_n_accepted", 0)
        print(f"one stream, greedy, {args.count} prompts a workload, up to {args.max_tokens} tokens; model {model.name}; "
              f"llama-server -t 2 -np 1 (+ --spec-type {args.llama_spec}); loraplex speculative ngram, max_draft 4, device.weights auto")
        print(f"{'workload':<8} {'side':<15} {'tok/s':>7} {'vs off':>7} {'vs llama':>9} {'drafted':>8} {'accepted':>9}")
        for workload in WORKLOADS:
            rate = {s: totals[(workload, s)][0] / (totals[(workload, s)][1] / 1e3) for s in sides}
            for side in sides:
                tokens, ms, drafted, accepted = totals[(workload, side)]
                off = side.removesuffix("+ngram")
                other = side.replace("loraplex", "llama") if side.startswith("loraplex") else None
                print(f"{workload:<8} {side:<15} {rate[side]:7.1f} {rate[side] / rate[off]:6.2f}x "
                      f"{'' if other is None else f'{rate[side] / rate[other]:8.2f}x':>9} {drafted:8d} "
                      f"{(accepted / drafted if drafted else 0):8.0%}")
        return 0
    finally:
        if server is not None:
            server.stop(60)
        for process in processes:
            process.terminate()
            process.wait(30)


if __name__ == "__main__":
    sys.exit(main())
