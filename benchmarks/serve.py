"""Serving: concurrent clients asking about several documents through the OpenAI client, vs llama.cpp.

Every system gets the same requests from the real ``openai`` client (streamed, greedy, at most
``--max-tokens`` new tokens), ``--clients`` at once, each asking ``--questions`` questions about the
documents in turn:

- ``ours-document``: ``semanticache-rag serve``; each document uploaded once (``POST /v1/documents``),
  questions name it (``extra_body={"document_id": ...}``);
- ``ours-prompt``: the same server; the document pasted into every request's system message (what a
  ``ChatOpenAI`` stuff chain sends), reused by the automatic prompt cache;
- ``llama-cpp``: llama-cpp-python's OpenAI server on this package's own model file (the Q4_1 GGUF the
  default model is converted from), RAM prompt cache on, the same requests as ``ours-prompt``. It
  runs in a venv of its own (llama-cpp-python is compiled there once, 4-10 min on 2 cores; again without AMX
  where ggml's AMX kernels stop it: ``benchmarks/llama_bench.py``).

Before the timed rounds each document is asked one question (its first read; reported apart).
Reported per system and number of clients: answers/s, completion tokens/s, time to first token
(p50/p95), prompt tokens served from cache (where the server reports it), server memory (RSS).

    python -m benchmarks.serve                                  # all three, 1/4/16 clients
    python -m benchmarks.serve --systems ours-document ours-prompt --clients 1 4
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from benchmarks.data import paul_graham_essays
from benchmarks.llama_bench import ensure_llama_cpp_python
from benchmarks.report import environment

RESULTS = Path(__file__).parent / "results" / "serve"
SYSTEMS = ("ours-document", "ours-prompt", "llama-cpp")
QUESTIONS = (
    "What is the main point of this text?",
    "Name one person the text mentions.",
    "Summarise the text in one sentence.",
    "What does the text say about startups?",
)
SYSTEM_PROMPT = "Answer the question about the document below.\n\nDocument:\n{document}"


def documents(count: int, tokens: int) -> list[str]:
    """``count`` different passages of about ``tokens`` tokens from RULER's essays (~4 characters a token)."""
    text = paul_graham_essays()
    size = 4 * tokens
    return [text[k * size : (k + 1) * size] for k in range(count)]


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


class Process:
    """A server in a subprocess: started, waited for (``/v1/models`` answers), measured, stopped."""

    def __init__(self, command: list[str], port: int, log: Path, env: dict | None = None):
        self.url = f"http://127.0.0.1:{port}"
        self.log = log.open("w")
        self.proc = subprocess.Popen(command, stdout=self.log, stderr=subprocess.STDOUT, env=env)
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{command[0]} exited with {self.proc.returncode}; see {log}")
            try:
                if httpx.get(f"{self.url}/v1/models", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        self.stop()
        raise RuntimeError(f"{' '.join(command)} did not start within 10 min; see {log}")

    def memory_mib(self, field: str = "VmRSS") -> float | None:
        """Resident memory of the server process (Linux), in MiB."""
        try:
            for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
                if line.startswith(field + ":"):
                    return int(line.split()[1]) / 1024
        except OSError:
            return None
        return None

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self.log.close()


def start(system: str, out: Path, gguf: Path | None) -> Process:
    port = free_port()
    if system == "llama-cpp":
        python = ensure_llama_cpp_python(gguf)
        command = [str(python), "-m", "llama_cpp.server", "--model", str(gguf), "--port", str(port)]
        command += ["--n_ctx", "4096", "--n_threads", "2", "--n_threads_batch", "2", "--cache", "true"]
        # its server interrupts the answer under way when another request comes; queue them instead, as ours does
        command += ["--cache_type", "ram", "--interrupt_requests", "false", "--verbose", "false"]
    else:
        command = [sys.executable, "-m", "semanticache_rag.cli", "serve", "--port", str(port)]
        # a store of its own, so the documents' first read is a read, not a load from an earlier run
        env = os.environ | {"SEMANTICACHE_STORE_DIR": tempfile.mkdtemp(prefix="serve-store-")}
        return Process(command, port, out / f"{system}.log", env)
    return Process(command, port, out / f"{system}.log")


def ask(client, system: str, document: str, document_id: str | None, question: str, max_tokens: int) -> dict:
    """One streamed request; its time to first token, total time, tokens and cached prompt tokens."""
    if system == "ours-document":
        messages = [{"role": "user", "content": question}]
        extra = {"document_id": document_id}
    else:
        messages = [
            {"role": "system", "content": SYSTEM_PROMPT.format(document=document)},
            {"role": "user", "content": question},
        ]
        extra = {}
    started = time.perf_counter()
    first, pieces, usage = None, [], None
    stream = client.chat.completions.create(
        model="default",
        messages=messages,
        max_tokens=max_tokens,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body=extra or None,
    )
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        if chunk.choices and chunk.choices[0].delta.content:
            first = first if first is not None else time.perf_counter() - started
            pieces.append(chunk.choices[0].delta.content)
    total = time.perf_counter() - started
    details = getattr(usage, "prompt_tokens_details", None) if usage is not None else None
    return {
        "ttft_s": first if first is not None else total,
        "total_s": total,
        "completion_tokens": usage.completion_tokens if usage is not None else len(pieces),
        "prompt_tokens": usage.prompt_tokens if usage is not None else None,
        "cached_tokens": getattr(details, "cached_tokens", None),
        "answer": "".join(pieces),
    }


def upload(server: Process, texts: list[str]) -> list[str]:
    """Upload each text; wait until every one is read; their ids."""
    ids = []
    for k, text in enumerate(texts):
        response = httpx.post(f"{server.url}/v1/documents", json={"text": text, "name": f"essay-{k}"}, timeout=60)
        response.raise_for_status()
        ids.append(response.json()["id"])
    for doc_id in ids:
        while httpx.get(f"{server.url}/v1/documents/{doc_id}", timeout=60).json()["status"] == "reading":
            time.sleep(0.5)
    return ids


def run_system(system: str, texts: list[str], args, gguf: Path | None) -> list[dict]:
    import openai

    server = start(system, args.out, gguf)
    rows = []
    try:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=3600)
        started = time.perf_counter()
        ids = upload(server, texts) if system == "ours-document" else [None] * len(texts)
        for k, text in enumerate(texts):  # first question per document: its first read
            row = ask(client, system, text, ids[k], QUESTIONS[0], args.max_tokens)
            rows.append({"system": system, "round": "first", "clients": 1, "document": k, **row})
        first_s = time.perf_counter() - started
        for clients in args.clients:
            started = time.perf_counter()
            with concurrent.futures.ThreadPoolExecutor(clients) as pool:
                jobs = [pool.submit(_client, client, system, texts, ids, c, args) for c in range(clients)]
                results = [r for job in jobs for r in job.result()]
            wall, memory = time.perf_counter() - started, server.memory_mib()
            rows += [r | {"clients": clients, "wall_s": wall, "rss_mib": memory} for r in results]
        peak = server.memory_mib("VmHWM")
        rows.append({"system": system, "round": "reads", "first_round_s": first_s, "peak_mib": peak})
    finally:
        server.stop()
    return rows


def _client(client, system: str, texts: list[str], ids: list, c: int, args) -> list[dict]:
    """Client ``c``'s questions of one round, one after another, about the documents in turn."""
    rows = []
    for q in range(args.questions):
        k = (c + q) % len(texts)
        question = QUESTIONS[(c + q + 1) % len(QUESTIONS)]
        rows.append(
            {
                "system": system,
                "round": "timed",
                "document": k,
                **ask(client, system, texts[k], ids[k], question, args.max_tokens),
            }
        )
    return rows


def _percentile(values: list[float], q: float) -> float:
    return statistics.quantiles(values, n=100, method="inclusive")[q - 1] if len(values) > 1 else values[0]


def table(rows: list[dict]) -> str:
    lines = [
        "| system | clients | requests | empty answers | answers/s | tokens/s | TTFT p50 (s) | TTFT p95 (s) "
        "| prompt tokens from cache | RSS (MiB) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    timed = [r for r in rows if r["round"] == "timed"]
    for system in dict.fromkeys(r["system"] for r in timed):
        for clients in sorted({r["clients"] for r in timed if r["system"] == system}):
            group = [r for r in timed if r["system"] == system and r["clients"] == clients]
            wall = group[0]["wall_s"]
            ttft = [r["ttft_s"] for r in group]
            cached = [r for r in group if r["cached_tokens"] is not None and r["prompt_tokens"]]
            hit = (
                f"{sum(r['cached_tokens'] for r in cached) / sum(r['prompt_tokens'] for r in cached):.0%}"
                if cached
                else "not reported"
            )
            tokens = sum(r["completion_tokens"] for r in group)
            rss = f"{group[0]['rss_mib']:.0f}" if group[0]["rss_mib"] else "-"
            lines.append(
                f"| {system} | {clients} | {len(group)} | {sum(1 for r in group if not r['completion_tokens'])} | "
                f"{len(group) / wall:.2f} | {tokens / wall:.1f} | "
                f"{_percentile(ttft, 50):.2f} | {_percentile(ttft, 95):.2f} | {hit} | {rss} |"
            )
    reads = ["", "| system | first question per document (s, all documents) | peak RSS (MiB) |", "|---|---|---|"]
    for r in rows:
        if r["round"] == "reads":
            reads.append(f"| {r['system']} | {r['first_round_s']:.1f} | {r['peak_mib'] or 0:.0f} |")
    return "\n".join(lines + reads)


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    timed = [r for r in rows if r["round"] == "timed"]
    fig, (left, right) = plt.subplots(1, 2, figsize=(8, 3.2))
    for system in dict.fromkeys(r["system"] for r in timed):
        counts = sorted({r["clients"] for r in timed if r["system"] == system})
        groups = [[r for r in timed if r["system"] == system and r["clients"] == c] for c in counts]
        left.plot(counts, [_percentile([r["ttft_s"] for r in g], 50) for g in groups], marker="o", label=system)
        right.plot(counts, [sum(r["completion_tokens"] for r in g) / g[0]["wall_s"] for g in groups], marker="o")
    left.set(xscale="log", xlabel="concurrent clients", ylabel="time to first token p50 (s)")
    right.set(xscale="log", xlabel="concurrent clients", ylabel="completion tokens/s")
    left.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--systems", nargs="+", default=list(SYSTEMS), choices=SYSTEMS)
    parser.add_argument("--clients", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--questions", type=int, default=2, help="questions per client per round")
    parser.add_argument("--documents", type=int, default=3)
    parser.add_argument("--document-tokens", type=int, default=2000)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    started = time.perf_counter()
    args.out.mkdir(parents=True, exist_ok=True)
    texts = documents(args.documents, args.document_tokens)
    gguf = None
    if "llama-cpp" in args.systems:
        from semanticache_rag.models import default_gguf

        gguf = default_gguf()
    raw = args.out / "serve.jsonl"  # rows of the systems not run this time are kept
    rows = [r for r in map(json.loads, raw.open()) if r["system"] not in args.systems] if raw.exists() else []
    for system in args.systems:
        print(f"{system} ...", file=sys.stderr)
        rows += run_system(system, texts, args, gguf)
        with open(raw, "w") as handle:
            handle.writelines(json.dumps(r) + "\n" for r in rows)
    settings = (
        f"{args.documents} documents of ~{args.document_tokens} tokens (RULER's essays), {args.questions} "
        f"questions per client per round, streamed through the `openai` client, greedy, at most {args.max_tokens} "
        "new tokens; "
        f"{os.cpu_count()} cores shared by server and clients."
    )
    text = table(rows)
    (args.out / "serve.md").write_text(f"# Serving\n\n{settings}\n\n{text}\n\n{environment(started)}\n")
    plot(rows, args.out / "serve.png")
    print(text)


if __name__ == "__main__":
    main()
