"""vLLM's OpenAI server under load: stock re-reading vs the SemantiCache connector (expanded, compact).

The same documents and questions as ``benchmarks/vllm_serving.py``, but through HTTP as users run it:
``semanticache-rag vllm-serve`` (vLLM's OpenAI server with the connector, in vLLM's own venv), the
``openai`` client streaming ``/v1/completions`` from 1, 4 and 16 threads at once, spread over the
documents. Time to first token is the client's (request sent to first streamed token), so it
includes HTTP, tokenisation-free prompts (token ids) and the queue. Prefix caching is off: every
request is a first question about its document.

    python -m benchmarks.vllm_http          # ~8 min on 2 cores
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from benchmarks.report import environment
from benchmarks.vllm_env import ensure_vllm_env
from benchmarks.vllm_serving import DOCUMENTS, RESULTS, document, workspace
from semanticache_rag import NoCompression, SemantiCacheCompressor
from semanticache_rag.served import served_request

MODES = ("stock", "connector", "compact")  # vLLM's prefill; the uncompressed cache expanded; SemantiCache 0.75 compact


def start_server(python: Path, model_dir: Path, store: Path, log: Path) -> tuple[subprocess.Popen, int]:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    command = [sys.executable, "-m", "semanticache_rag.cli", "vllm-serve", str(model_dir), "--store", str(store)]
    command += ["--vllm-python", str(python), "--", "--port", str(port), "--dtype", "float32"]
    command += ["--max-model-len", "4096", "--no-enable-prefix-caching"]
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1"}  # GiB of KV cache on CPU (else 92% of the memory)
    server = subprocess.Popen(command, stdout=log.open("w"), stderr=subprocess.STDOUT, env=env)
    deadline = time.time() + 900
    while True:
        if server.poll() is not None:
            raise RuntimeError(f"vLLM's server exited:\n{log.read_text()[-4000:]}")
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5)
            return server, port
        except OSError:
            if time.time() > deadline:
                raise RuntimeError("vLLM's server did not start in 15 minutes") from None
            time.sleep(2)


def one_request(client, model: str, body: dict, steps: int) -> dict:
    """Stream one completion; the client-side time to the first token and to the last."""
    extra = {k: v for k, v in body.items() if k != "prompt"}
    sent = time.perf_counter()
    first, tokens = None, 0
    stream = client.completions.create(
        model=model, prompt=body["prompt"], max_tokens=steps, temperature=0, stream=True, extra_body=extra
    )
    for chunk in stream:
        if chunk.choices and chunk.choices[0].text is not None:
            first = first or time.perf_counter()
            tokens += 1
    done = time.perf_counter()
    return {"ttft_s": (first or done) - sent, "total_s": done - sent, "chunks": tokens}


def main() -> None:
    from openai import OpenAI

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=2000)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    python = ensure_vllm_env()
    _, store, engine, model_dir = workspace("vllm-http-")
    started = time.perf_counter()
    bodies: dict[str, list[dict]] = {mode: [] for mode in MODES}
    for name, fact, subject in DOCUMENTS:
        text = document(engine.tokenizer, name, fact, args.tokens)
        question = f"What is the special magic number for {subject} mentioned in the document?"
        engine.compressor = NoCompression()
        full = served_request(engine, engine.read(text, progress=False), question)
        bodies["stock"].append({"prompt": full["prompt"]})
        bodies["connector"].append(full)
        engine.compressor = SemantiCacheCompressor(0.75)
        bodies["compact"].append(served_request(engine, engine.read(text, progress=False), question, compact=True))
    server, port = start_server(python, model_dir, store.directory, args.out / "vllm_http_server.log")
    rows = []
    try:
        client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0, timeout=900)
        one_request(client, str(model_dir), bodies["stock"][0], 2)  # warm-up
        for concurrency in args.concurrency:
            for mode in MODES:
                batch = [bodies[mode][i % len(DOCUMENTS)] for i in range(concurrency)]
                began = time.perf_counter()
                with ThreadPoolExecutor(concurrency) as pool:
                    results = list(pool.map(lambda b: one_request(client, str(model_dir), b, args.steps), batch))
                wall = time.perf_counter() - began
                ttfts = [r["ttft_s"] for r in results]
                rows.append(
                    {
                        "concurrency": concurrency,
                        "mode": mode,
                        "ttft_median_s": round(statistics.median(ttfts), 3),
                        "ttft_max_s": round(max(ttfts), 3),
                        "wall_s": round(wall, 3),
                        "tokens_per_s": round(sum(r["chunks"] for r in results) / wall, 1),
                    }
                )
                print(rows[-1], flush=True)
    finally:
        server.terminate()
        server.wait(timeout=120)
    log = (args.out / "vllm_http_server.log").read_text()
    report = {
        "environment": environment(started),
        "document_tokens": args.tokens,
        "steps": args.steps,
        "fallbacks_logged": log.count("not used, the prompt is computed as usual") + log.count("failed to load"),
        "rows": rows,
    }
    (args.out / "vllm_http.json").write_text(json.dumps(report, indent=1))
    (args.out / "vllm_http.md").write_text(markdown(report))
    print(markdown(report))


def markdown(report: dict) -> str:
    lines = [
        f"vLLM's OpenAI server (`semanticache-rag vllm-serve`, CPU, fp32), default model, documents of "
        f"{report['document_tokens']} tokens, {report['steps']} tokens per answer, streamed by the `openai` "
        f"client from concurrent threads; prefix caching off. Stored-cache fallbacks logged: "
        f"{report['fallbacks_logged']}.",
        "",
        report["environment"],
        "",
        "| concurrent | mode | TTFT median (s) | TTFT max (s) | wall (s) | tokens/s |",
        "|---|---|---|---|---|---|",
    ]
    for row in report["rows"]:
        lines.append(
            f"| {row['concurrency']} | {row['mode']} | {row['ttft_median_s']} | {row['ttft_max_s']} | "
            f"{row['wall_s']} | {row['tokens_per_s']} |"
        )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
