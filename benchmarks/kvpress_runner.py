"""Run NVIDIA kvpress presses on prepared token ids (executed by the kvpress venv's python).

Standalone on purpose: kvpress 0.5.5 pins ``transformers<5.3``, so this script imports nothing
from semanticache_rag. ``benchmarks/kvpress_env.py`` builds the venv and calls it.

    python kvpress_runner.py --tasks tasks.jsonl --model DIR --presses none snapkv knorm \
        --ratios 0.5 0.75 --max-new-tokens 32 --out rows.jsonl

Input, one JSON object per line (per context)::

    {"context_id": str, "task": str, "length": int, "prefix_ids": [int, ...],
     "questions": [{"qid": str, "tail_ids": [int, ...], "refs": [str, ...], "metric": "all"|"part"}]}

``prefix_ids`` (chat-template head + document) are prefilled with the press applied, so the press
never sees a question; ``tail_ids`` (question + template up to the assistant prefix) follow. Both
are used exactly as given. Output, one line per (press, ratio, question)::

    {"method": "kvpress:<name>", "ratio", "context_id", "qid", "task", "length", "answer",
     "kv_bytes", "full_kv_bytes", "prefill_compress_s", "decode_ms_per_token", "kl"}

The mechanics follow ``kvpress.pipeline.KVPressTextGenerationPipeline._forward`` (0.5.5):
prefill ``model.model`` (no LM head) inside ``with press(model)``; question tokens get positions
continuing from the *original* context length while the cache holds fewer entries; after each
question every cache layer is cropped back to its compressed length. ``kl`` is the
teacher-forced KL(full || press) averaged over the tokens of the full-cache greedy answer.

``--prefill shared`` (the default) prefills each context once and hands every press and ratio the
same layer inputs and full keys and values: a press's hook only replaces the layer's cache after the
layer has run, and no layer reads another's cache while prefilling, so each press compresses exactly
what its own prefill would give it (the presses run here keep no state between layers). ``--prefill
each`` runs kvpress's pipeline as it is, one prefill per press and ratio; on a shared run's
contexts both give the same answers.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from pathlib import Path

import torch
from kvpress import ChunkKVPress, ExpectedAttentionPress, KnormPress, SnapKVPress, StreamingLLMPress
from kvpress.utils import extract_keys_and_values
from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache
from transformers.utils import logging as hf_logging

logger = logging.getLogger("kvpress_runner")

PRESSES = {
    "snapkv": SnapKVPress,
    "streaming_llm": StreamingLLMPress,
    "knorm": KnormPress,
    "expected_attention": ExpectedAttentionPress,
    "chunkkv": lambda compression_ratio: ChunkKVPress(press=SnapKVPress(compression_ratio=compression_ratio)),
}
PRESS_NAMES = ("none", *PRESSES)


def build_press(name: str, ratio: float):
    """The kvpress press ``name`` at ``ratio`` (kvpress defaults otherwise); None for ``none``."""
    if name == "none":
        return None
    return PRESSES[name](compression_ratio=ratio)


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tasks", type=Path, required=True, help="input JSONL, one context per line")
    parser.add_argument("--model", type=Path, required=True, help="transformers model directory")
    parser.add_argument("--presses", nargs="+", required=True, choices=PRESS_NAMES)
    parser.add_argument("--ratios", type=float, nargs="+", required=True, help="compression ratios in [0, 1)")
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument(
        "--prefill",
        choices=("shared", "each"),
        default="shared",
        help="one prefill per context for every press and ratio (shared), or one per press and ratio (each)",
    )
    parser.add_argument("--out", type=Path, required=True, help="output JSONL (overwritten)")
    args = parser.parse_args(argv)
    bad = [r for r in args.ratios if not 0.0 <= r < 1.0]
    if bad:
        parser.error(f"--ratios must lie in [0, 1); got {bad}")
    if args.max_new_tokens < 1:
        parser.error(f"--max-new-tokens must be >= 1; got {args.max_new_tokens}")
    return args


def load_model(model_dir: Path):
    """Model (float32, eval), tokenizer and the token ids that end an answer."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    eos = model.generation_config.eos_token_id
    stop_ids = set(eos if isinstance(eos, list) else [eos]) | {tokenizer.eos_token_id}
    if "<|im_end|>" in tokenizer.get_vocab():
        stop_ids.add(tokenizer.convert_tokens_to_ids("<|im_end|>"))
    return model, tokenizer, stop_ids - {None}


def cache_nbytes(cache) -> int:
    """Bytes of every key and value tensor in ``cache``."""
    return sum(t.numel() * t.element_size() for layer in cache.layers for t in (layer.keys, layer.values))


def prefill(model, prefix_ids: list[int], press) -> tuple[DynamicCache, float]:
    """Prefill ``prefix_ids`` with ``press`` applied, as kvpress's pipeline does; cache and seconds."""
    cache = DynamicCache()
    ids = torch.tensor([prefix_ids])
    started = time.perf_counter()
    if press is None:
        model.model(input_ids=ids, past_key_values=cache)
    else:
        with press(model):
            model.model(input_ids=ids, past_key_values=cache)
    return cache, time.perf_counter() - started


def prefill_shared(model, prefix_ids: list[int], presses: dict) -> tuple[dict, float, dict]:
    """Prefill ``prefix_ids`` once and compress every layer with each of ``presses`` ({job: press}).

    Each press's ``compress`` gets what its ``forward_hook`` would read in a prefill of its own (the
    layer's inputs, attention output and full keys and values); the full cache stays as it is.
    Returns a cache per job (``None`` holds the full one), the prefill seconds, and each press's
    compression seconds.
    """
    language_model = model.model
    for press in presses.values():
        press.post_init_from_model(model)
    compressed: dict = {job: [] for job in presses}
    compress_s = dict.fromkeys(presses, 0.0)

    def hook(module, args, kwargs, output):
        keys, values = extract_keys_and_values(kwargs["past_key_values"], module.layer_idx)
        for job, press in presses.items():
            started = time.perf_counter()
            compressed[job].append(press.compress(module, kwargs["hidden_states"], keys, values, output[1], kwargs))
            compress_s[job] += time.perf_counter() - started
        return output

    hooks = []
    try:
        for layer in language_model.layers:
            layer.self_attn.rotary_emb = language_model.rotary_emb  # as BasePress.__call__ sets it
            hooks.append(layer.self_attn.register_forward_hook(hook, with_kwargs=True))
        full, seconds = prefill(model, prefix_ids, None)
    finally:
        for handle in hooks:
            handle.remove()
    seconds -= sum(compress_s.values())
    caches: dict = {None: full}
    for job, layers in compressed.items():
        caches[job] = DynamicCache()
        for index, (keys, values) in enumerate(layers):
            caches[job].update(keys, values, index)
    return caches, seconds, compress_s


def crop(cache, lengths: list[int]) -> None:
    """Cut every layer back to ``lengths`` (kvpress's ``_remove_answer_from_cache``)."""
    for layer, length in zip(cache.layers, lengths):
        layer.keys = layer.keys[:, :, :length]
        layer.values = layer.values[:, :, :length]


def layer_lengths(cache) -> list[int]:
    return [cache.get_seq_length(i) for i in range(len(cache.layers))]


def positions(start: int, count: int) -> torch.Tensor:
    """Position ids ``start .. start + count - 1``, shape (1, count)."""
    return torch.arange(start, start + count).unsqueeze(0)


def greedy(model, cache, tail_ids, context_length, max_new_tokens, stop_ids) -> tuple[list[int], list[float]]:
    """Greedy answer ids (stop token included) and the seconds of each one-token decode step.

    Positions continue from the original ``context_length`` (``generate_answer`` in kvpress).
    Unlike kvpress, the first answer token is checked for a stop token too.
    """
    logits = model(
        input_ids=torch.tensor([tail_ids]),
        past_key_values=cache,
        position_ids=positions(context_length, len(tail_ids)),
        logits_to_keep=1,
    ).logits
    ids, steps, position = [int(logits[0, -1].argmax())], [], context_length + len(tail_ids)
    while ids[-1] not in stop_ids and len(ids) < max_new_tokens:
        started = time.perf_counter()
        logits = model(
            input_ids=torch.tensor([[ids[-1]]]),
            past_key_values=cache,
            position_ids=positions(position, 1),
        ).logits
        ids.append(int(logits[0, -1].argmax()))
        steps.append(time.perf_counter() - started)
        position += 1
    return ids, steps


def teacher_forced_logprobs(model, cache, tail_ids, answer_ids, context_length) -> torch.Tensor:
    """Log-distributions predicting each of ``answer_ids`` after ``tail_ids``, shape (n, vocab)."""
    fed = tail_ids + answer_ids[:-1]
    logits = model(
        input_ids=torch.tensor([fed]),
        past_key_values=cache,
        position_ids=positions(context_length, len(fed)),
    ).logits
    return torch.log_softmax(logits[0, len(tail_ids) - 1 :].float(), dim=-1)


def mean_kl(reference: torch.Tensor, logprobs: torch.Tensor) -> float:
    """Mean over positions of KL(reference || logprobs); both (n, vocab) log-probabilities."""
    kl = (reference.exp() * (reference - logprobs)).sum(dim=-1)
    return float(kl.mean())


def answer_question(model, cache, question, context_length, args, stop_ids, reference=None) -> dict:
    """Greedy answer, decode timing and teacher-forced log-probs for one question.

    ``reference`` (the full-cache answer ids and log-probs) selects what is teacher-forced;
    without it the own greedy answer is (the full-cache run builds its reference this way).
    The cache is cropped back to its compressed context after each pass.
    """
    lengths, tail = layer_lengths(cache), question["tail_ids"]
    ids, steps = greedy(model, cache, tail, context_length, args.max_new_tokens, stop_ids)
    crop(cache, lengths)
    forced = reference["ids"] if reference else ids
    logprobs = teacher_forced_logprobs(model, cache, tail, forced, context_length)
    crop(cache, lengths)
    if reference is None and logprobs.argmax(dim=-1).tolist() != ids:
        # Incremental and teacher-forced passes should agree; a mismatch means near-ties or a bug.
        logger.warning("question %s: teacher-forced argmax differs from the greedy answer", question["qid"])
    return {
        "ids": ids,
        "logprobs": logprobs,
        "decode_ms_per_token": round(1000 * sum(steps) / len(steps), 2) if steps else None,
        "kl": mean_kl(reference["logprobs"], logprobs) if reference else 0.0,
    }


def run_press(model, tokenizer, stop_ids, task, press_name, ratio, args, references=None, prefilled=None):
    """Rows for one context under one press; also the per-question results (references).

    ``prefilled`` is the press's (cache, seconds) from a shared prefill; without it the context is
    prefilled here with the press applied.
    """
    if prefilled is None:
        prefilled = prefill(model, task["prefix_ids"], build_press(press_name, ratio))
    cache, seconds = prefilled
    kv_bytes, context_length = cache_nbytes(cache), len(task["prefix_ids"])
    rows, results = [], {}
    for question in task["questions"]:
        reference = references[question["qid"]] if references else None
        result = answer_question(model, cache, question, context_length, args, stop_ids, reference)
        results[question["qid"]] = result
        rows.append(
            {
                "method": f"kvpress:{press_name}",
                "ratio": float(ratio),
                "context_id": task["context_id"],
                "qid": question["qid"],
                "task": task["task"],
                "length": task["length"],
                "answer": tokenizer.decode(result["ids"], skip_special_tokens=True).strip(),
                "kv_bytes": kv_bytes,
                "full_kv_bytes": None,
                "prefill_compress_s": round(seconds, 4),
                "decode_ms_per_token": result["decode_ms_per_token"],
                "kl": round(result["kl"], 6),
            }
        )
    return rows, results


def jobs(presses: list[str], ratios: list[float]) -> list[tuple[str, float]]:
    """(press, ratio) pairs after the full-cache reference; ``none`` runs once, at ratio 0."""
    return [(name, ratio) for name in dict.fromkeys(presses) if name != "none" for ratio in ratios]


def run_context(model, tokenizer, stop_ids, task, args, progress) -> list[dict]:
    """All rows for one context: the full-cache reference first, then every press and ratio.

    With ``args.prefill == "shared"`` one prefill serves them all; a press's seconds are that
    prefill's plus its own compression's, what a prefill of its own would take.
    """
    todo = jobs(args.presses, args.ratios)
    prefilled: dict = {}
    if args.prefill == "shared":
        caches, seconds, compress_s = prefill_shared(model, task["prefix_ids"], {j: build_press(*j) for j in todo})
        prefilled = {job: (caches[job], seconds + compress_s.get(job, 0.0)) for job in caches}
    rows, references = run_press(
        model, tokenizer, stop_ids, task, "none", 0.0, args, prefilled=prefilled.pop(None, None)
    )
    full_kv_bytes = rows[0]["kv_bytes"] if rows else None
    if "none" not in args.presses:
        rows = []
    progress.step(f"{task['context_id']} none")
    for name, ratio in todo:
        job = prefilled.pop((name, ratio), None)
        press_rows, _ = run_press(model, tokenizer, stop_ids, task, name, ratio, args, references, prefilled=job)
        rows.extend(press_rows)
        progress.step(f"{task['context_id']} {name}@{ratio}")
    for row in rows:
        row["full_kv_bytes"] = full_kv_bytes
    return rows


class Progress:
    """tqdm bar on stderr when tqdm is installed, else one plain line per step."""

    def __init__(self, total: int):
        try:
            from tqdm import tqdm
        except ImportError:
            self.bar = None
        else:
            self.bar = tqdm(total=total, file=sys.stderr, desc="kvpress", dynamic_ncols=True)
        self.done, self.total, self.started = 0, total, time.perf_counter()

    def step(self, label: str) -> None:
        self.done += 1
        if self.bar is not None:
            self.bar.set_postfix_str(label)
            self.bar.update(1)
        else:
            elapsed = time.perf_counter() - self.started
            sys.stderr.write(f"kvpress [{self.done}/{self.total}] {label} ({elapsed:.0f}s)\n")
            sys.stderr.flush()

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def load_tasks(path: Path) -> list[dict]:
    with path.open() as handle:
        return [json.loads(line) for line in handle if line.strip()]


def main(argv=None) -> None:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(name)s: %(message)s")
    hf_logging.disable_progress_bar()  # the weight-loading bar would drown our own progress
    torch.manual_seed(0)
    tasks = load_tasks(args.tasks)
    model, tokenizer, stop_ids = load_model(args.model)
    logger.info("%d contexts, presses %s, ratios %s", len(tasks), args.presses, args.ratios)
    progress = Progress(len(tasks) * (1 + len(jobs(args.presses, args.ratios))))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with args.out.open("w") as out, torch.inference_mode():
        for task in tasks:
            for row in run_context(model, tokenizer, stop_ids, task, args, progress):
                out.write(json.dumps(row) + "\n")
            out.flush()
    progress.close()


if __name__ == "__main__":
    main()
