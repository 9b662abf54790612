"""vLLM with the SemantiCache connector answers from a stored cache as our engine does (Tier 1).

These tests run vLLM's CPU build in a venv of its own (``python benchmarks/vllm_env.py`` builds
it, ~8 minutes, 3.5 GB) and are skipped where it is absent. Our engine reads and stores the
document here; vLLM, in a subprocess of that venv, answers the same prompt tokens with the
connector serving the stored cache (``benchmarks/vllm_runner.py``).
"""

from __future__ import annotations

import json
import os
import subprocess

import pytest
import torch
from conftest import _tiny_model, corpus_text

from benchmarks.speed import decode
from semanticache_rag import DocumentStore, Engine, KaizenCompressor, NoCompression, SemantiCacheCompressor
from semanticache_rag.models import home_dir
from semanticache_rag.prompts import Turn

VENV_PYTHON = home_dir() / "vllm-venv" / "bin" / "python"
pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(
        not (home_dir() / "vllm-venv" / "semanticache-venv.json").is_file(),
        reason="vLLM's venv is not built: python benchmarks/vllm_env.py",
    ),
]
QUESTION = "Who may reproduce the Work?"
STEPS = 8


def greedy(engine: Engine, cache) -> tuple[list[int], list[float]]:
    """Our engine's greedy tokens after :data:`QUESTION` and the log-probability of each."""
    tokens, logprobs, _, _ = decode(engine, cache, STEPS, None, QUESTION)
    return tokens, logprobs.gather(1, torch.tensor(tokens)[:, None])[:, 0].tolist()


@pytest.fixture(scope="module")
def served(tmp_path_factory, tiny_tokenizer):
    """A tiny Llama with head_dim 64 (vLLM's CPU attention takes 32, 64, ...) on disk, one document read
    and stored per compressor; returns (model dir, store dir, engine, {name: (cache, entry id)})."""
    sizes = dict(hidden_size=128, intermediate_size=256, num_attention_heads=4, head_dim=64)
    model = _tiny_model("llama", len(tiny_tokenizer), max_position_embeddings=4096, **sizes)
    with torch.no_grad():  # sharper attention than random weights give, so that compression changes the answers
        for layer in model.model.layers:
            layer.self_attn.q_proj.weight.mul_(4)
            layer.self_attn.k_proj.weight.mul_(4)
    model_dir = tmp_path_factory.mktemp("vllm-model")
    model.save_pretrained(model_dir)
    tiny_tokenizer.save_pretrained(model_dir)
    store = DocumentStore(tmp_path_factory.mktemp("vllm-store"))
    engine = Engine(model, tiny_tokenizer, model_name="tiny-64", prefill_chunk=256, store=store)
    caches = {}
    for name, compressor in (
        ("none", NoCompression()),
        ("semanticache-0.5", SemantiCacheCompressor(0.5)),
        ("semanticache-0.75", SemantiCacheCompressor(0.75)),
        ("kaizen-0.75", KaizenCompressor(0.75)),
    ):
        engine.compressor = compressor
        before = {e.id for e in store.entries()}
        cache = engine.read(corpus_text()[:2500], progress=False)
        (entry_id,) = {e.id for e in store.entries()} - before
        caches[name] = (cache, entry_id)
    engine.compressor = SemantiCacheCompressor(0.9)  # stored, then damaged on disk
    before = {e.id for e in store.entries()}
    engine.read(corpus_text()[:2500], progress=False)
    (damaged,) = {e.id for e in store.entries()} - before
    tensors = store.directory / f"{damaged}.safetensors"
    data = bytearray(tensors.read_bytes())
    data[len(data) // 2] ^= 0xFF
    tensors.write_bytes(bytes(data))
    return model_dir, store.directory, engine, caches, damaged


def run_vllm(tmp_path, model_dir, store_dir, requests: list[dict]) -> dict:
    from benchmarks.vllm_env import vllm_environment

    job, result = tmp_path / "job.json", tmp_path / "result.json"
    job.write_text(json.dumps({"model": str(model_dir), "store": str(store_dir), "requests": requests}))
    runner = [str(VENV_PYTHON), "benchmarks/vllm_runner.py", str(job), str(result)]
    proc = subprocess.run(runner, env=vllm_environment(VENV_PYTHON), capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(result.read_text())


def test_vllm_answers_from_the_stored_cache_as_our_engine(served, tmp_path):
    model_dir, store_dir, engine, caches, damaged = served
    tail = engine.tokenizer(engine.prompt.tail([Turn(QUESTION)]), add_special_tokens=False)["input_ids"]
    prompt = caches["none"][0].prefix_ids.tolist() + tail
    expected = {name: greedy(engine, cache) for name, (cache, _) in caches.items()}
    requests = [{"prompt_ids": prompt, "entry": entry_id, "max_tokens": STEPS} for _, entry_id in caches.values()]
    requests += [
        {"prompt_ids": prompt, "entry": None, "max_tokens": STEPS},  # names no cache: computed as usual
        {"prompt_ids": prompt, "entry": caches["semanticache-0.75"][1], "salt": False, "max_tokens": STEPS},
        {"prompt_ids": prompt, "entry": "0" * 64, "max_tokens": STEPS},  # no such cache
        {"prompt_ids": prompt, "entry": damaged, "max_tokens": STEPS},  # fails its checksum
        {"prompt_ids": [5, *prompt[1:]], "entry": caches["semanticache-0.75"][1], "max_tokens": STEPS},
    ]
    result = run_vllm(tmp_path, model_dir, store_dir, requests)
    outputs = result["outputs"]
    prefix = len(caches["none"][0].prefix_ids)
    (tmp_path / "vllm.json").write_text(json.dumps({"expected": expected, "result": result}))
    for (name, (tokens, logprobs)), out in zip(expected.items(), outputs):
        assert out["num_cached_tokens"] >= prefix, name  # the document was not prefilled by vLLM
        assert out["token_ids"] == tokens, name
        torch.testing.assert_close(torch.tensor(out["logprobs"]), torch.tensor(logprobs), rtol=0, atol=2e-3)
    full_tokens, full_logprobs = expected["none"]
    for name in ("semanticache-0.5", "semanticache-0.75"):  # compressed caches answer otherwise than the full one
        assert max(abs(a - b) for a, b in zip(expected[name][1], full_logprobs)) > 0.05, name
    unnamed, unsalted, missing, corrupt, other_prompt = outputs[len(caches) :]
    for out in (unnamed, unsalted, missing, corrupt):  # vLLM's own prefill: the full cache's answer, never another
        assert out["token_ids"] == full_tokens
        torch.testing.assert_close(torch.tensor(out["logprobs"]), torch.tensor(full_logprobs), rtol=0, atol=2e-3)
    for out in (missing, corrupt, other_prompt):
        assert out["num_cached_tokens"] < prefix
    assert (store_dir / f"{damaged}.safetensors").exists()  # serving never deletes a user's entry


def test_vllm_serve_answers_openai_clients_from_the_stored_cache(served, tmp_path):
    """``semanticache-rag vllm-serve`` starts vLLM's OpenAI server with the connector; the openai client
    names the cache with ``extra_body`` and gets our engine's answer."""
    import socket
    import sys
    import time
    import urllib.request

    from openai import OpenAI

    from semanticache_rag.served import request_fields

    model_dir, store_dir, engine, caches, _ = served
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    command = [sys.executable, "-m", "semanticache_rag.cli", "vllm-serve", str(model_dir), "--store", str(store_dir)]
    command += ["--", "--port", str(port), "--dtype", "float32", "--max-model-len", "4096", "--enforce-eager"]
    log = (tmp_path / "server.log").open("w")
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1"}  # GiB of KV cache on CPU (else 92% of the memory)
    server = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env)
    try:
        deadline = time.time() + 600
        while True:
            assert server.poll() is None, (tmp_path / "server.log").read_text()[-4000:]
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5)
                break
            except OSError:
                assert time.time() < deadline, "vLLM's server did not start"
                time.sleep(2)
        client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none")
        tail = engine.tokenizer(engine.prompt.tail([Turn(QUESTION)]), add_special_tokens=False)["input_ids"]
        for name in ("none", "semanticache-0.75"):
            cache, entry_id = caches[name]
            tokens, _ = greedy(engine, cache)
            response = client.completions.create(
                model=str(model_dir),
                prompt=cache.prefix_ids.tolist() + tail,
                max_tokens=STEPS,
                temperature=0,
                extra_body={**request_fields(entry_id), "return_token_ids": True},
            )
            assert response.choices[0].model_extra["token_ids"] == tokens, name  # (random weights: the text is bytes)
        assert "stored cache" not in (tmp_path / "server.log").read_text()  # no request fell back
    finally:
        server.terminate()
        server.wait(timeout=60)


def test_vllm_keeps_compressed_caches_compressed(served, tmp_path):
    """Tier 2: a compact request puts one slot per core into vLLM's paged cache (its log s in the
    attention backend's side table) and gets our engine's answer from the cache at its own positions;
    a compact request that cannot be served fails instead of being computed from its stand-in prompt."""
    from semanticache_rag.expansion import compact_slots
    from semanticache_rag.served import served_request

    model_dir, store_dir, engine, caches, damaged = served
    names = ("semanticache-0.5", "semanticache-0.75", "kaizen-0.75")
    expected = {name: greedy(engine, caches[name][0]) for name in names}
    requests = []
    for name in names:
        body = served_request(engine, caches[name][0], QUESTION, compact=True)
        requests.append({"prompt_ids": body["prompt"], "entry": caches[name][1], "compact": True, "max_tokens": STEPS})
    stand_in = requests[1]["prompt_ids"]
    requests += [
        {"prompt_ids": stand_in, "entry": "0" * 64, "compact": True, "max_tokens": STEPS},  # no such cache
        {"prompt_ids": stand_in, "entry": damaged, "compact": True, "max_tokens": STEPS},  # fails its checksum
        {"prompt_ids": stand_in, "entry": caches["semanticache-0.75"][1], "compact": True, "salt": False},
    ]
    result = run_vllm(tmp_path, model_dir, store_dir, requests)
    outputs = result["outputs"]
    (tmp_path / "vllm.json").write_text(json.dumps({"expected": expected, "result": result}))
    for name, out in zip(names, outputs):
        cache = caches[name][0]
        slots = compact_slots(cache.layers)
        assert out["num_cached_tokens"] == slots, name  # P slots in vLLM's cache, not the document's N tokens
        if name.startswith("semanticache"):
            assert slots < 0.6 * cache.length, name
        assert out["token_ids"] == expected[name][0], name
        torch.testing.assert_close(torch.tensor(out["logprobs"]), torch.tensor(expected[name][1]), rtol=0, atol=2e-3)
    for out in outputs[len(names) :]:
        assert out["token_ids"] == [] and out["finish_reason"] not in ("length", "stop"), out
    assert (store_dir / f"{damaged}.safetensors").exists()
