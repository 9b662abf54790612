"""RULER-style tasks built offline from RULER's own corpora (see :mod:`benchmarks.data`).

Faithful to RULER's generators (``long_context_eval/data/synthetic/{niah,qa}.py`` and
``synthetic.yaml``): the same needle sentence, haystacks (repeated filler, Paul Graham essays),
SQuAD / HotpotQA documents with distractors, and the same scoring. Two changes for the
question-agnostic setting: the question is *not* part of the document, and every context carries
several questions (all keys of a multikey haystack, several QA pairs) so each compressed cache is
asked more than once.
"""

from __future__ import annotations

import random
import re
import uuid
from dataclasses import dataclass, field

from benchmarks.data import paul_graham_essays, ruler_json

NIAH_PREAMBLE = (
    "Some special magic numbers are hidden within the following text. Make sure to memorize it. "
    "I will quiz you about the numbers afterwards.\n"
)
NEEDLE = "One of the special magic numbers for {key} is: {value}."
NIAH_QUESTION = "What is the special magic number for {key} mentioned in the provided text?"
REPEAT_HAYSTACK = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
QA_PREAMBLE = "The following are given documents.\n\n"
QA_QUESTION = (
    "Answer the question based on the given documents. Only give me the answer and do not output any "
    "other words.\n\nQuestion: {query}"
)
TASKS = ("niah_single_1", "niah_single_2", "niah_single_3", "niah_facts", "niah_multikey_1", "qa_1", "qa_2")
# niah_single_3 is RULER's (word keys, uuid values); niah_facts is ours: one person's name, one city
# and one letter-and-digit code per haystack, the facts that are not numbers.
UUID_PREAMBLE = NIAH_PREAMBLE.replace("numbers", "uuids")
UUID_NEEDLE = "One of the special magic uuids for {key} is: {value}."
UUID_QUESTION = "What is the special magic uuid for {key} mentioned in the provided text?"
FACT_PREAMBLE = NIAH_PREAMBLE.replace("magic numbers", "facts").replace("the numbers", "the facts")
FACTS = {  # kind: (needle, question)
    "name": ("The special person for {key} is {value}.", "Who is the special person for {key}?"),
    "city": ("The special city for {key} is {value}.", "What is the special city for {key}?"),
    "code": ("The special code for {key} is {value}.", "What is the special code for {key}?"),
}
FIRST_NAMES = (
    "Amara Bartholomew Cecilia Dmitri Esperanza Florian Giulietta Hiroshi Ingrid Jasper Katarina Leopold "
    "Magnolia Nikolai Ottilie Percival Rosalind Sebastian Theodora Ulrich Valentina Wilhelmina Xavier Yolanda"
).split()
LAST_NAMES = (
    "Abernathy Blackwood Castellano Delacroix Esterhazy Fairweather Gallagher Hawthorne Ivanova Jablonski "
    "Kowalczyk Lindqvist Montgomery Nakamura Okonkwo Petrakis Quennell Rasmussen Szymanski Thornbury "
    "Underhill Vasquez Whitlock Yamamoto"
).split()
CITIES = (
    "Reykjavik|Valparaiso|Thessaloniki|Ouagadougou|Vladivostok|Trondheim|Antananarivo|Cartagena|Ljubljana|"
    "Samarkand|Wollongong|Bratislava|Montevideo|Kaohsiung|Zanzibar|Innsbruck|Guadalajara|Timbuktu|"
    "Tbilisi|Saskatoon|Marrakesh|Bucharest|Chattanooga|Dubrovnik"
).split("|")


@dataclass
class Question:
    qid: str
    text: str
    refs: list[str]
    metric: str  # "all" (NIAH: every reference) or "part" (QA: any reference)
    evidence: list[str] = field(default_factory=list)  # passages of the document that hold the answer
    kind: str = "answer"  # what is asked: number, uuid, name, city, code or answer (QA)


@dataclass
class Context:
    context_id: str
    task: str
    length: int
    document: str
    questions: list[Question] = field(default_factory=list)


def score(prediction: str, refs: list[str], metric: str) -> float:
    """RULER's string match: ``all`` = share of refs found, ``part`` = any ref found (case-insensitive)."""
    found = [ref.lower() in prediction.lower() for ref in refs]
    return sum(found) / len(found) if metric == "all" else float(any(found))


def _words(rng: random.Random, count: int) -> list[str]:
    """RULER keys are random words; draw ``word-word`` keys from the essays' vocabulary."""
    vocab = sorted(set(re.findall(r"\b[a-z]{5,9}\b", paul_graham_essays()[:200_000])))
    return [f"{rng.choice(vocab)}-{rng.choice(vocab)}" for _ in range(count)]


def _fit(count_tokens, pieces: list[str], target: int, joiner: str) -> int:
    """How many leading ``pieces``, joined, fit ``target`` tokens (binary search; at least 1)."""
    low, high = 1, len(pieces)
    while low < high:
        mid = (low + high + 1) // 2
        if count_tokens(joiner.join(pieces[:mid])) <= target:
            low = mid
        else:
            high = mid - 1
    return low


def _needles(task: str, rng: random.Random) -> list[tuple[str, str, str, str]]:
    """(kind, value, needle, question) of each needle a ``task`` haystack holds."""
    if task == "niah_facts":
        keys, kinds = _words(rng, 3), list(FACTS)
        values = [
            f"{rng.choice(FIRST_NAMES)} {rng.choice(LAST_NAMES)}",
            rng.choice(CITIES),
            f"{rng.choice('ABCDEFGHJKLMNPQRSTUVWXYZ')}{rng.randrange(10)}-{_words(rng, 1)[0].split('-')[0].upper()}"
            f"-{rng.randrange(100, 1000)}",
        ]
        return [
            (kind, value, FACTS[kind][0].format(key=key, value=value), FACTS[kind][1].format(key=key))
            for kind, key, value in zip(kinds, keys, values)
        ]
    keys = _words(rng, 4 if task == "niah_multikey_1" else 1)
    if task == "niah_single_3":
        values = [str(uuid.UUID(int=rng.getrandbits(128), version=4)) for _ in keys]
        return [
            ("uuid", v, UUID_NEEDLE.format(key=k, value=v), UUID_QUESTION.format(key=k)) for k, v in zip(keys, values)
        ]
    values = [str(rng.randrange(1_000_000, 10_000_000)) for _ in keys]
    return [("number", v, NEEDLE.format(key=k, value=v), NIAH_QUESTION.format(key=k)) for k, v in zip(keys, values)]


def niah(task: str, length: int, index: int, count_tokens, rng: random.Random) -> Context:
    """``niah_single_1`` (repeated filler), ``niah_single_2`` (essays), ``niah_single_3`` (essays, uuids),
    ``niah_facts`` (essays; a name, a city and a code), ``niah_multikey_1`` (essays, 4 keys)."""
    needles = _needles(task, rng)
    preamble = {"niah_single_3": UUID_PREAMBLE, "niah_facts": FACT_PREAMBLE}.get(task, NIAH_PREAMBLE)
    budget = length - sum(count_tokens(n[2]) for n in needles) - count_tokens(preamble) - 8
    if task == "niah_single_1":
        sentences = [REPEAT_HAYSTACK] * (length // 10)
    else:
        essays = paul_graham_essays()
        start = rng.randrange(0, len(essays) - length * 8)
        sentences = re.split(r"(?<=[.!?])\s+", essays[start : start + length * 8])
    haystack = sentences[: _fit(count_tokens, sentences, budget, " ")]
    for needle in needles:
        haystack.insert(rng.randrange(0, len(haystack) + 1), needle[2])
    context = Context(f"{task}-{length}-{index}", task, length, preamble + " ".join(haystack))
    for i, (kind, value, needle, question) in enumerate(needles):
        if task != "niah_multikey_1" or i < 2:  # RULER asks one key; two keys per haystack here
            context.questions.append(Question(f"{context.context_id}-q{i}", question, [value], "all", [needle], kind))
    return context


def _squad():
    data = ruler_json("squad")
    docs, qas = [], []
    for article in data["data"]:
        for paragraph in article["paragraphs"]:
            docs.append(paragraph["context"])
            for qa in paragraph["qas"]:
                if not qa["is_impossible"]:
                    gold = [paragraph["context"]]
                    qas.append((qa["question"], [a["text"] for a in qa["answers"]], gold, gold))
    return sorted(set(docs)), qas


def _hotpotqa():
    data = ruler_json("hotpotqa")
    docs = sorted({f"{t}\n{''.join(p)}" for d in data for t, p in d["context"]})
    qas = []
    for d in data:  # every paragraph of the question's context goes in (as RULER does); 2 of them hold the answer
        paragraphs = {t: f"{t}\n{''.join(p)}" for t, p in d["context"]}
        supporting = dict.fromkeys(t for t, _ in d["supporting_facts"] if t in paragraphs)
        qas.append((d["question"], [d["answer"]], list(paragraphs.values()), [paragraphs[t] for t in supporting]))
    return docs, qas


def qa(task: str, length: int, index: int, count_tokens, rng: random.Random) -> Context:
    """``qa_1`` (SQuAD) and ``qa_2`` (HotpotQA): gold documents of 2 QA pairs (1 if short) plus distractors."""
    docs, qas = _squad() if task == "qa_1" else _hotpotqa()
    questions = 2 if length >= 2000 else 1
    chosen = rng.sample(qas, questions)
    gold = list(dict.fromkeys(d for _, _, ds, _ in chosen for d in ds))
    pool_size = 400 if length <= 20_000 else length // 40  # enough paragraphs for 16K-128K contexts too
    distractors = [d for d in rng.sample(docs, min(len(docs), pool_size)) if d not in gold]
    budget = length - count_tokens(QA_PREAMBLE) - 8
    pool = gold + distractors  # gold first: always kept
    kept = pool[: max(len(gold), _fit(count_tokens, pool, budget, "\n\n"))]
    rng.shuffle(kept)
    text = "\n\n".join(f"Document {i + 1}:\n{d}" for i, d in enumerate(kept))
    context = Context(f"{task}-{length}-{index}", task, length, QA_PREAMBLE + text)
    for i, (query, refs, _, evidence) in enumerate(chosen):
        text = QA_QUESTION.format(query=query)
        context.questions.append(Question(f"{context.context_id}-q{i}", text, refs, "part", list(evidence)))
    return context


def token_counter(tokenizer):
    """``count_tokens`` for :func:`build`: the tokens of a text, without special tokens."""
    return lambda text: len(tokenizer(text, add_special_tokens=False)["input_ids"])


def add_context_options(parser, lengths: list[int], samples: int) -> None:
    """The options a benchmark over these contexts shares: model, tasks, lengths, ratios, samples."""
    parser.add_argument("--model", default=None, help="model id or directory (default: SmolLM2-135M-Instruct)")
    parser.add_argument("--tasks", nargs="+", default=list(TASKS), choices=TASKS)
    parser.add_argument("--lengths", type=int, nargs="+", default=lengths)
    parser.add_argument("--ratios", type=float, nargs="+", default=[0.5, 0.75, 0.9])
    parser.add_argument("--samples", type=int, default=samples, help="contexts per task and length")


def build(tasks, lengths, samples: int, count_tokens, seed: int = 0) -> list[Context]:
    """Every task x length x sample context, reproducibly from ``seed``."""
    contexts = []
    for task in tasks:
        for length in lengths:
            for index in range(samples):
                rng = random.Random(f"{seed}-{task}-{length}-{index}")
                make = niah if task.startswith("niah") else qa
                contexts.append(make(task, length, index, count_tokens, rng))
    return contexts
