"""vLLM with the SemantiCache connector vs stock vLLM re-reading the document (CPU here; GPU ready).

The default model, saved as a plain checkpoint for vLLM; three real documents (licence texts,
~``--tokens`` tokens each, one planted fact each) read once by our engine and stored (no
compression, SemantiCache 0.75, auto at 0.75). Then, in vLLM's venv (``benchmarks/vllm_env.py``),
one engine with the connector:

- **Answers**: each document's question through the connector from each stored cache, greedy, in
  fp32: the generated tokens against our engine's from the same cache; for the compressed caches
  also kept compressed in vLLM (Tier 2, ``compact``: one paged-cache slot per core, ``log s`` in
  the attention backend's side table).
- **Load**: 1, 4 and 16 concurrent requests spread over the documents, each its own document's
  question, submitted together; stock (vLLM prefills the whole prompt) vs the connector (the
  document's tokens come from the store, expanded; or compact). vLLM's automatic prefix caching is off for this part,
  so every request is a first question about its document (as after a restart, on another
  replica, or once the prefix cache has evicted it); with it on, stock vLLM re-reads each
  document once per server and keeps it in its own KV memory. Time to first token (vLLM's own
  per-request metric), batch wall time, generated tokens per second.

    python -m benchmarks.vllm_serving                       # ~10 min on 2 cores
    python -m benchmarks.vllm_serving --dtype bfloat16      # vLLM's usual CPU dtype (answers then differ slightly)
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

from benchmarks.report import environment
from benchmarks.speed import decode
from benchmarks.vllm_env import ensure_vllm_env, vllm_environment
from semanticache_rag import DocumentStore, Engine, NoCompression
from semanticache_rag.compressors import make_compressor
from semanticache_rag.served import requested_entry, served_request

RESULTS = Path(__file__).parent / "results" / "vllm"
RUNNER = Path(__file__).with_name("vllm_runner.py")
DOCUMENTS = (
    ("GPL-3", "The special magic number for the blue harbor is 7351946.", "the blue harbor"),
    ("Apache-2.0", "The special magic number for the red lighthouse is 2864019.", "the red lighthouse"),
    ("MPL-2.0", "The special magic number for the green valley is 5190273.", "the green valley"),
)
# (how vLLM gets the document, which stored cache): its own prefill; the connector expanding it; compact
LOAD_MODES = (
    ("stock", "none"),
    ("connector", "none"),
    ("connector", "semanticache 0.75"),
    ("compact", "semanticache 0.75"),
)
CACHES = (("none", None), ("semanticache", 0.75), ("auto", 0.75), ("auto", 0.9))


def document(tokenizer, name: str, fact: str, tokens: int) -> str:
    """Licence ``name`` (repeated if needed) cut to ``tokens`` tokens, ``fact`` planted in the middle."""
    text = Path("/usr/share/common-licenses", name).read_text()
    while len(tokenizer(text)["input_ids"]) < tokens:
        text += "\n\n" + text
    text = tokenizer.decode(tokenizer(text)["input_ids"][:tokens])
    cut = text.rfind("\n", 0, len(text) // 2) + 1
    return text[:cut] + fact + "\n" + text[cut:]


def workspace(prefix: str) -> tuple[Path, DocumentStore, Engine, Path]:
    """A scratch folder with a store, the default model's engine on it, and that model saved for vLLM."""
    work = Path(tempfile.mkdtemp(prefix=prefix))
    store = DocumentStore(work / "store")
    engine = Engine.from_pretrained(store=store, weights="model")  # saved below for vLLM as loaded
    model_dir = work / "model"
    engine.model.save_pretrained(model_dir)
    engine.tokenizer.save_pretrained(model_dir)
    return work, store, engine, model_dir


def run_vllm(python: Path, work: Path, job: dict) -> dict:
    (work / "job.json").write_text(json.dumps(job))
    command = [str(python), str(RUNNER), str(work / "job.json"), str(work / "result.json")]
    proc = subprocess.run(command, env=vllm_environment(python), capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"vLLM runner failed:\n{proc.stderr[-4000:]}")
    return json.loads((work / "result.json").read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=2000)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--steps", type=int, default=16, help="tokens generated per request")
    parser.add_argument("--dtype", default="float32", help="vLLM's dtype (default float32: our engine's)")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    python = ensure_vllm_env()
    work, store, engine, model_dir = workspace("vllm-serving-")
    started = time.perf_counter()
    docs = []  # per document: {cache name: (entry id, prompt, our tokens)}
    for name, fact, subject in DOCUMENTS:
        text = document(engine.tokenizer, name, fact, args.tokens)
        question = f"What is the special magic number for {subject} mentioned in the document?"
        per_cache = {}
        for cache_name, ratio in CACHES:
            engine.compressor = NoCompression() if ratio is None else make_compressor(cache_name, ratio)
            cache = engine.read(text, progress=False)
            body = served_request(engine, cache, question)  # our prompt tokens and the stored entry's id
            compact = served_request(engine, cache, question, compact=True)["prompt"]  # Tier 2: one slot per core
            ours = decode(engine, cache, args.steps, None, question)[0]
            entry_id = requested_entry(body["kv_transfer_params"])
            label = cache_name if ratio is None else f"{cache_name} {ratio}"
            per_cache[label] = (entry_id, body["prompt"], ours, cache.nbytes, compact)
        docs.append(per_cache)
    read_s = time.perf_counter() - started
    requests, batches, labels = [], [], []

    def add(prompt, entry, compact=False):
        requests.append({"prompt_ids": prompt, "entry": entry, "compact": compact, "max_tokens": args.steps})
        return len(requests) - 1

    answer_checks = []
    for d, per_cache in enumerate(docs):
        for cache_name, (entry_id, prompt, ours, _, compact) in per_cache.items():
            for served_as in ("expanded", "compact") if cache_name != "none" else ("expanded",):
                index = add(compact if served_as == "compact" else prompt, entry_id, served_as == "compact")
                batches.append([index])
                answer_checks.append((d, cache_name, served_as, index, ours))
    for concurrency in args.concurrency:
        for mode, cache_name in LOAD_MODES:
            batch = []
            for i in range(concurrency):
                entry_id, prompt, _, _, compact = docs[i % len(docs)][cache_name]
                if mode == "compact":
                    batch.append(add(compact, entry_id, compact=True))
                else:
                    batch.append(add(prompt, None if mode == "stock" else entry_id))
            batches.append(batch)
            labels.append((concurrency, f"{mode} ({cache_name})" if mode != "stock" else mode, len(batches) - 1))
    job = {
        "model": str(model_dir),
        "store": str(store.directory),
        "dtype": args.dtype,
        "prefix_caching": False,
        "requests": requests,
        "batches": batches,
        "max_model_len": args.tokens + 1024,
    }
    result = run_vllm(python, work, job)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "vllm_serving_raw.json").write_text(json.dumps({"job_batches": batches, "result": result}))
    outputs = result["outputs"]
    answers = [
        {
            "document": DOCUMENTS[d][0],
            "cache": cache_name,
            "served_as": served_as,
            "same_tokens": outputs[index]["token_ids"] == ours,
            "served_tokens": outputs[index]["num_cached_tokens"],
            "kv_slots": len(requests[index]["prompt_ids"]) + args.steps,  # vLLM's paged-cache slots at the end
        }
        for d, cache_name, served_as, index, ours in answer_checks
    ]
    load = []
    for concurrency, mode, b in labels:
        batch = batches[b]
        ttfts = [outputs[i]["ttft_s"] for i in batch if outputs[i]["ttft_s"] is not None]
        tokens = sum(len(outputs[i]["token_ids"]) for i in batch)
        load.append(
            {
                "concurrency": concurrency,
                "mode": mode,
                "ttft_median_s": round(statistics.median(ttfts), 3) if ttfts else None,
                "ttft_max_s": round(max(ttfts), 3) if ttfts else None,
                "batch_s": round(result["batch_s"][b], 3),
                "tokens_per_s": round(tokens / result["batch_s"][b], 1),
                "served_tokens_mean": round(statistics.mean(outputs[i]["num_cached_tokens"] for i in batch), 1),
                "kv_slots_mean": round(statistics.mean(len(requests[i]["prompt_ids"]) + args.steps for i in batch), 1),
            }
        )
    report = {
        "environment": environment(started),
        "vllm_version": result["vllm_version"],
        "dtype": args.dtype,
        "document_tokens": args.tokens,
        "steps": args.steps,
        "our_read_and_store_s": round(read_s, 1),
        "vllm_startup_s": round(result["startup_s"], 1),
        "cache_mib": {name: round(entry[3] / 2**20, 1) for name, entry in docs[0].items()},
        "answers": answers,
        "load": load,
    }
    (args.out / "vllm_serving.json").write_text(json.dumps(report, indent=1))
    (args.out / "vllm_serving.md").write_text(markdown(report))
    plot(report, args.out / "vllm_serving.png")
    print(markdown(report))


def markdown(report: dict) -> str:
    lines = [
        f"vLLM {report['vllm_version']} (CPU, {report['dtype']}), default model, documents of "
        f"{report['document_tokens']} tokens, {report['steps']} tokens per answer; prefix caching off.",
        "",
        "Answers through the connector against our engine's from the same stored cache (3 documents each):",
        "",
        "| stored cache | served as | same tokens | prompt tokens served | vLLM KV slots per request |",
        "|---|---|---|---|---|",
    ]
    groups: dict[tuple[str, str], list[dict]] = {}
    for answer in report["answers"]:
        groups.setdefault((answer["cache"], answer["served_as"]), []).append(answer)
    for (cache, served_as), rows in groups.items():
        same = sum(r["same_tokens"] for r in rows)
        served = round(statistics.mean(r["served_tokens"] for r in rows))
        slots = round(statistics.mean(r["kv_slots"] for r in rows))
        lines.append(f"| {cache} | {served_as} | {same}/{len(rows)} | {served} | {slots} |")
    lines += [
        "",
        report["environment"],
        "",
        "| concurrent | mode | TTFT median (s) | TTFT max (s) | batch (s) | tokens/s | prompt tokens served "
        "| KV slots |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for row in report["load"]:
        lines.append(
            f"| {row['concurrency']} | {row['mode']} | {row['ttft_median_s']} | {row['ttft_max_s']} | "
            f"{row['batch_s']} | {row['tokens_per_s']} | {row['served_tokens_mean']} | {row['kv_slots_mean']} |"
        )
    return "\n".join(lines) + "\n"


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for mode in dict.fromkeys(r["mode"] for r in report["load"]):
        rows = [r for r in report["load"] if r["mode"] == mode and r["ttft_median_s"] is not None]
        ax.plot([r["concurrency"] for r in rows], [r["ttft_median_s"] for r in rows], marker="o", label=mode)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("concurrent requests")
    ax.set_ylabel("median time to first token (s)")
    ax.set_title("vLLM (CPU): stock prefill vs SemantiCache connector")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
