"""Kaizen calibration: how much each layer's answers change under each storage option, once per model.

A calibration text is cut into a *document* (prefilled into a full cache) and a *continuation*.
For every layer and option, that one layer of the cache is stored with the option and the
continuation is run over the cache; the sensitivity is the mean KL(full || changed) of the
next-token distributions over the continuation (the fidelity metric of ``benchmarks/ruler.py``).
That is ``layers x options`` short forward passes (a few minutes for the default model on an idle
CPU). The table is a small JSON file that :class:`~semanticache_rag.compressors.kaizen.KaizenCompressor`
finds by the model's name::

    python -m semanticache_rag.compressors.kaizen_calibration                 # default model
    python -m semanticache_rag.compressors.kaizen_calibration --model DIR --text FILE
    python -m semanticache_rag.compressors.kaizen_calibration --options int3 --update TABLE   # one option more
"""

from __future__ import annotations

import argparse
import json
import logging
from pathlib import Path

import torch
from tqdm.auto import tqdm

from semanticache_rag.compressors.kaizen import (
    DEFAULT_OPTIONS,
    TABLE_FORMAT,
    encode_layer,
    table_path,
)
from semanticache_rag.documents import load_document
from semanticache_rag.errors import ConfigError
from semanticache_rag.kv import ConversationKV, LayerKV

logger = logging.getLogger(__name__)

DEFAULT_TEXT = Path(__file__).resolve().parent.parent / "data" / "cyrguide.pdf"  # the packaged demo PDF


def _logprobs(engine, layers, tail: list[int], start: int) -> torch.Tensor:
    """Next-token log-distributions (T, V) over ``tail`` read after the document ``layers``."""
    kv = ConversationKV(layers, capacity=len(tail))
    return torch.log_softmax(engine.forward(kv, tail, start, logits_to_keep=len(tail)).float(), dim=-1)


def _kl(reference: torch.Tensor, other: torch.Tensor) -> float:
    return float((reference.exp() * (reference - other)).sum(-1).mean())


def calibrate(
    engine,
    source=DEFAULT_TEXT,
    *,
    document_tokens: int = 1024,
    eval_tokens: int = 128,
    options: tuple[str, ...] = DEFAULT_OPTIONS,
    group_size: int = 32,
    progress: bool = True,
) -> dict:
    """Measure each layer's sensitivity to each option with ``engine``'s model; return the table.

    ``source`` is a path or text with at least ``document_tokens + eval_tokens`` tokens.
    """
    document = load_document(source)
    ids, pages = engine.tokenize_prefix(document)
    if len(ids) < document_tokens + eval_tokens:
        raise ConfigError(
            f"the calibration text has {len(ids)} tokens; it needs document_tokens + eval_tokens = "
            f"{document_tokens + eval_tokens}"
        )
    prefill = engine.prefill_tokens(
        document, ids[:document_tokens], pages[:document_tokens], progress=False, surprisal=False
    )
    layers = [LayerKV(keys, values) for keys, values in prefill.keys_values]
    tail = ids[document_tokens : document_tokens + eval_tokens]
    reference = _logprobs(engine, layers, tail, document_tokens)
    rows = []
    for i, layer in enumerate(tqdm(layers, desc="Calibrating layers", disable=not progress, leave=False)):
        row: dict[str, float | None] = {}
        for option in options:
            if option == "share" and i == 0:
                row[option] = None
                continue
            changed = list(layers)
            changed[i] = encode_layer(option, layer, layers[i - 1] if i else None, group_size)
            row[option] = round(_kl(reference, _logprobs(engine, changed, tail, document_tokens)), 8)
        rows.append(row)
    _, heads, _, dim = layers[0].keys.shape
    return {
        "format": TABLE_FORMAT,
        "model": Path(str(engine.tokenizer.name_or_path)).name or engine.model_name,
        "num_layers": len(layers),
        "kv_heads": heads,
        "head_dim": dim,
        "dtype": str(layers[0].keys.dtype).removeprefix("torch."),
        "group_size": group_size,
        "options": list(options),
        "calibration": {
            "text": document.name,
            "document_tokens": document_tokens,
            "eval_tokens": eval_tokens,
            "metric": "mean KL(full || one layer changed) of next-token distributions, nats per token",
        },
        "sensitivity": rows,
    }


def merge_tables(table: dict, added: dict) -> dict:
    """``table`` with the options measured in ``added`` (same model, layers and calibration) put in."""
    fixed = ("format", "model", "num_layers", "kv_heads", "head_dim", "dtype", "group_size", "calibration")
    different = [key for key in fixed if table.get(key) != added.get(key)]
    if different:
        raise ConfigError(f"the tables differ in {different}: calibrate every option again instead")
    options = list(dict.fromkeys([*table["options"], *added["options"]]))
    rows = [{**old, **new} for old, new in zip(table["sensitivity"], added["sensitivity"], strict=True)]
    return {**table, "options": options, "sensitivity": rows}


def save_table(table: dict, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(table, indent=1) + "\n")
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="model id or directory (default: SmolLM2-135M-Instruct)")
    parser.add_argument("--text", default=str(DEFAULT_TEXT), help="calibration document (default: the demo PDF)")
    parser.add_argument("--document-tokens", type=int, default=1024)
    parser.add_argument("--eval-tokens", type=int, default=128)
    parser.add_argument("--group-size", type=int, default=32)
    parser.add_argument("--options", nargs="+", default=list(DEFAULT_OPTIONS), help="options to measure")
    parser.add_argument("--update", type=Path, default=None, help="an existing table to add the measured options to")
    parser.add_argument("--out", type=Path, default=None, help="table path (default: --update, or where Kaizen looks)")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    from semanticache_rag.engine import Engine

    engine = Engine.from_pretrained(args.model)
    table = calibrate(
        engine,
        args.text,
        document_tokens=args.document_tokens,
        eval_tokens=args.eval_tokens,
        options=tuple(args.options),
        group_size=args.group_size,
    )
    if args.update is not None:
        from semanticache_rag.compressors.kaizen import load_table

        table = merge_tables(load_table(args.update), table)
    path = save_table(table, args.out or args.update or table_path(table["model"]))
    logger.info("Kaizen sensitivity table for %s written to %s", table["model"], path)


if __name__ == "__main__":
    main()
