"""Long document chat: Kara vs a plain sliding window vs no decode-time compression.

One chat over the bundled PDF's first pages, ``--turns`` turns long: the user greets, states a
fact in turn 2 ("My locker code is 4812. Please remember it."), then asks questions about the
document. After chosen turns the chat is probed for the fact ("What is my locker code?"); a probe
is answered and then taken back (not kept in the history), so it does not remind later turns.
Per turn: seconds, and the bytes the appended turns take in the working cache; per probe: whether
the fact came back. Each method runs ``--chats`` chats with different facts (fixed seed).

- ``none``: every appended entry is kept (the cache grows without bound);
- ``kara``: :class:`~semanticache_rag.compressors.kara.KaraCompressor` at ``--budget`` entries;
- ``window``: a plain sliding window at the same budget: the oldest appended window is dropped
  whole instead of compressed.

    python -m benchmarks.long_chat [--turns 30] [--chats 3] [--budget 64] [--window 32]
"""

from __future__ import annotations

import argparse
import json
import random
import time
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import ClassVar

import torch
from tqdm import tqdm

from benchmarks.report import environment
from semanticache_rag import Engine, KaraCompressor, NoCompression
from semanticache_rag.documents import read_pdf

RESULTS = Path(__file__).parent / "results" / "kara"
FACTS = (
    ("My locker code is {}. Please remember it.", "What is my locker code?"),
    ("My room number is {}. Please remember it.", "What is my room number?"),
    ("My bike lock code is {}. Please remember it.", "What is my bike lock code?"),
)
GREETING = "Hello! I have a question about this guide."
FILLER = (
    "What is this document about?",
    "Which fonts does the document mention?",
    "How do I write Russian text in LaTeX?",
    "What is an input encoding?",
    "Which packages does the document recommend?",
    "What does the document say about hyphenation?",
    "What is koi8-r?",
    "Who wrote this document?",
)


@dataclass(frozen=True)
class SlidingWindow(KaraCompressor):
    """Baseline: Kara's trigger and budget, but the oldest window is dropped whole."""

    name: ClassVar[str] = "sliding_window"

    @property
    def kept_per_window(self) -> int:
        return 0

    def select(self, keys: torch.Tensor) -> torch.Tensor:
        return torch.empty(keys.shape[0], 0, dtype=torch.long)


def script(turns: int, chat: int, rng: random.Random) -> tuple[list[str], str, str]:
    """The user's messages, the probe question and the value it should bring back."""
    statement, probe = FACTS[chat % len(FACTS)]
    value = str(rng.randrange(1000, 10000))
    filler = [FILLER[(chat + i) % len(FILLER)] for i in range(turns - 2)]
    return [GREETING, statement.format(value)] + filler, probe, value


def methods(budget: int, window: int) -> dict:
    recent = window // 2
    return {
        "none": NoCompression(),
        "kara": KaraCompressor(budget_tokens=budget, window_tokens=window, recent_tokens=recent),
        "window": SlidingWindow(budget_tokens=budget, window_tokens=window, recent_tokens=recent),
    }


def run_chat(engine: Engine, cache, messages: list[str], probe: str, value: str, args, bar) -> dict:
    conversation = engine.conversation(cache, max_new_tokens=args.max_new_tokens)
    seconds, tokens, conversation_bytes, recalled, probes = [], [], [], {}, {}
    for turn, message in enumerate(messages, 1):
        started = time.perf_counter()
        answer = conversation.ask(message)
        seconds.append(round(time.perf_counter() - started, 3))
        tokens.append(answer.completion_tokens)
        conversation_bytes.append(answer.conversation_bytes)
        if turn in args.probe_turns:
            reply = conversation.ask(probe, max_new_tokens=16)
            conversation.turns.pop()  # taken back: the next turn's prompt does not contain the probe
            recalled[turn], probes[turn] = value in reply.answer, reply.answer
        bar.update()
    return {
        "seconds": seconds,
        "answer_tokens": tokens,
        "conversation_bytes": conversation_bytes,
        "recalled": recalled,
        "probe_answers": probes,
        "prompt_tokens": answer.prompt_tokens,
    }


def table(rows: list[dict]) -> str:
    probe_turns = list(rows[0]["recalled"])
    lines = [
        "| method | "
        + " | ".join(f"recall after turn {t}" for t in probe_turns)
        + " | mean s/turn | s/turn, last 5 | ms per answer token | appended KV, last turn |",
        "|---|" + "---|" * (len(probe_turns) + 4),
    ]
    for name in dict.fromkeys(r["method"] for r in rows):
        group = [r for r in rows if r["method"] == name]
        recall = [f"{sum(r['recalled'][t] for r in group)}/{len(group)}" for t in probe_turns]
        per_turn = [s for r in group for s in r["seconds"]]
        late = [s for r in group for s in r["seconds"][-5:]]
        last = max(r["conversation_bytes"][-1] for r in group)
        per_token = 1000 * sum(per_turn) / sum(t for r in group for t in r["answer_tokens"])
        lines.append(
            f"| {name} | {' | '.join(recall)} | {sum(per_turn) / len(per_turn):.2f} | "
            f"{sum(late) / len(late):.2f} | {per_token:.0f} | {last / 2**20:.1f} MiB |"
        )
    return "\n".join(lines)


def _mean_per_turn(group: list[dict], key: str) -> list[float]:
    return [sum(values) / len(values) for values in zip(*(r[key] for r in group))]


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.8))
    for name in dict.fromkeys(r["method"] for r in rows):
        group = [r for r in rows if r["method"] == name]
        turns = range(1, len(group[0]["seconds"]) + 1)
        left.plot(turns, [b / 2**20 for b in _mean_per_turn(group, "conversation_bytes")], label=name)
        right.plot(turns, _mean_per_turn(group, "seconds"), label=name)
    left.set(xlabel="turn", ylabel="appended KV (MiB)", title="Cache the chat appends")
    right.set(xlabel="turn", ylabel="seconds", title="Time per turn")
    left.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="model id or directory (default: SmolLM2-135M-Instruct)")
    parser.add_argument("--turns", type=int, default=30)
    parser.add_argument("--chats", type=int, default=3)
    parser.add_argument("--budget", type=int, default=64, help="appended entries per head for kara and window")
    parser.add_argument("--window", type=int, default=32, help="entries compressed (or dropped) at a time")
    parser.add_argument("--probe-turns", type=int, nargs="+", default=[3, 4, 5, 10, 20, 30])
    parser.add_argument("--document-tokens", type=int, default=300)
    parser.add_argument("--max-new-tokens", type=int, default=24)
    parser.add_argument("--methods", nargs="+", default=["none", "kara", "window"], choices=["none", "kara", "window"])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    if args.turns < 3:
        parser.error("--turns must be at least 3")
    args.probe_turns = [t for t in args.probe_turns if 2 < t <= args.turns]
    started = time.perf_counter()
    engine = Engine.from_pretrained(args.model)
    pdf = resources.files("semanticache_rag") / "data" / "cyrguide.pdf"
    with resources.as_file(pdf) as path:
        text = read_pdf(path).text
    ids = engine.tokenizer(text, add_special_tokens=False)["input_ids"][: args.document_tokens]
    cache = engine.read(engine.tokenizer.decode(ids), progress=False)
    rng = random.Random(args.seed)
    scripts = [script(args.turns, chat, rng) for chat in range(args.chats)]
    rows = []
    chosen = {k: v for k, v in methods(args.budget, args.window).items() if k in args.methods}
    with tqdm(total=len(chosen) * args.chats * args.turns, desc="turns", unit="turn") as bar:
        for name, compressor in chosen.items():
            engine.compressor = compressor
            for chat, (messages, probe, value) in enumerate(scripts):
                row = run_chat(engine, cache, messages, probe, value, args, bar)
                rows.append({"method": name, "chat": chat, "budget": args.budget, **row})
    args.out.mkdir(parents=True, exist_ok=True)
    with open(args.out / "long_chat.jsonl", "w") as out:
        for row in rows:
            out.write(json.dumps(row) + "\n")
    header = (
        f"# Long document chat ({args.turns} turns, {args.chats} chats, document {cache.length} tokens)\n\n"
        f"A fact stated in turn 2 is asked for (and the probe taken back) after turns {args.probe_turns}; "
        f"{args.max_new_tokens} new tokens per answer, greedy; kara and window keep {args.budget} appended "
        f"entries per head and compress (kara) or drop (window) {args.window} at a time, never the newest "
        f"{args.window // 2}.\n\n"
    )
    (args.out / "long_chat.md").write_text(header + table(rows) + "\n\n" + environment(started) + "\n")
    plot(rows, args.out / "long_chat.png")
    print(header + table(rows))


if __name__ == "__main__":
    main()
