"""Runs requests through vLLM (in its own venv: ``benchmarks/vllm_env.py``) with the SemantiCache connector.

Reads a JSON job, writes a JSON result; it imports vLLM, so it runs only in that venv::

    python benchmarks/vllm_runner.py JOB.json RESULT.json

Job: ``{"model": DIR, "store": DIR, "dtype": "float32", "max_model_len": N, "connector": true,
"prefix_caching": true, "requests": [{"prompt_ids": [...], "entry": ID or null, "compact": false,
"salt": true, "max_tokens": 8}, ...], "batches": [[0, 1], [2], ...]}``. ``entry`` names a stored
cache (``kv_transfer_params``), ``compact`` keeps it compressed in vLLM (Tier 2); ``salt: false``
leaves the cache's salt out; the requests of one batch
are submitted together (default: one at a time). Result: per request the generated token ids, the
log-probability of each, ``num_cached_tokens`` (prompt tokens vLLM did not compute: its prefix
cache and the connector) and the time to its first token; per batch its wall time; vLLM's version.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path


def _requests(job: dict):
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    from semanticache_rag.served import request_fields

    prompts, params = [], []
    for request in job["requests"]:
        prompt = TokensPrompt(prompt_token_ids=request["prompt_ids"])
        extra = {}
        if request.get("entry"):
            fields = request_fields(request["entry"], compact=request.get("compact", False))
            extra["kv_transfer_params"] = fields["kv_transfer_params"]
            if request.get("salt", True):
                prompt["cache_salt"] = fields["cache_salt"]
        prompts.append(prompt)
        params.append(
            SamplingParams(
                temperature=0.0, max_tokens=request.get("max_tokens", 8), logprobs=0, detokenize=False, extra_args=extra
            )
        )
    return prompts, params


def main(job_path: str, result_path: str) -> None:
    import vllm
    from vllm import LLM
    from vllm.config import KVTransferConfig

    job = json.loads(Path(job_path).read_text())
    kv_transfer = None
    if job.get("connector", True):
        kv_transfer = KVTransferConfig(
            kv_connector="SemantiCacheConnector",
            kv_connector_module_path="semanticache_rag.integrations.vllm_connector",
            kv_role="kv_consumer",
            kv_connector_extra_config={"store": job["store"]},
        )
    started = time.perf_counter()
    llm = LLM(
        model=job["model"],
        dtype=job.get("dtype", "float32"),
        skip_tokenizer_init=True,
        max_model_len=job.get("max_model_len", 4096),
        enforce_eager=True,
        kv_transfer_config=kv_transfer,
        enable_prefix_caching=job.get("prefix_caching", True),
        disable_log_stats=False,  # per-request metrics: the time to the first token
        seed=0,
    )
    startup_s = time.perf_counter() - started
    prompts, params = _requests(job)
    outputs: list[dict] = [{} for _ in prompts]
    batches = job.get("batches") or [[i] for i in range(len(prompts))]
    walls = []
    for batch in batches:
        began = time.perf_counter()
        results = llm.generate([prompts[i] for i in batch], [params[i] for i in batch], use_tqdm=False)
        walls.append(time.perf_counter() - began)
        for index, out in zip(batch, results):
            completion = out.outputs[0]
            steps = zip(completion.logprobs or [], completion.token_ids)
            metrics = getattr(out, "metrics", None)
            outputs[index] = {
                "token_ids": list(completion.token_ids),
                "finish_reason": completion.finish_reason,
                "logprobs": [float(step[token].logprob) for step, token in steps],
                "num_cached_tokens": out.num_cached_tokens,
                "ttft_s": getattr(metrics, "first_token_latency", None),
            }
    result = {"vllm_version": vllm.__version__, "startup_s": startup_s, "outputs": outputs, "batch_s": walls}
    Path(result_path).write_text(json.dumps(result))


if __name__ == "__main__":
    main(*sys.argv[1:3])
