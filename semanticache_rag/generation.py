"""Decoding options, token sampling and incremental detokenisation."""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from tokenizers.decoders import DecodeStream
from transformers.generation.logits_process import (
    NoRepeatNGramLogitsProcessor,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopPLogitsWarper,
)

from semanticache_rag.errors import ConfigError


@dataclass(frozen=True)
class GenerationOptions:
    """How answers are decoded. Greedy by default (``temperature=0``).

    Attributes
    ----------
    max_new_tokens : int
        Most tokens an answer may have (also capped by the model's context).
    temperature : float
        0 for greedy decoding; > 0 samples.
    top_p : float
        Nucleus sampling mass in (0, 1]; used only when sampling.
    stop : tuple of str
        Strings that end the answer (not included in it).
    seed : int or None
        Seed for sampling, for reproducible samples.
    repetition_penalty : float
        > 0; above 1 makes tokens already in the answer less likely (transformers'
        ``RepetitionPenaltyLogitsProcessor``, applied to the answer's own tokens, so that quoting
        the document is not penalised). 1 (the default) leaves the logits as they are.
    no_repeat_ngram_size : int
        >= 0; when > 0, no n-gram of this size appears twice in an answer (transformers'
        ``NoRepeatNGramLogitsProcessor`` over the answer's tokens). 0 (the default): off.
    loop_guard : bool
        End the answer, with ``finish_reason="repetition"``, once it repeats a sentence or line it
        already gave, or a run of tokens over and over (:class:`LoopGuard`). On by default; it never
        changes the tokens chosen, only where the answer ends.
    """

    max_new_tokens: int = 256
    temperature: float = 0.0
    top_p: float = 1.0
    stop: tuple[str, ...] = field(default_factory=tuple)
    seed: int | None = None
    repetition_penalty: float = 1.0
    no_repeat_ngram_size: int = 0
    loop_guard: bool = True

    def __post_init__(self):
        if not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 1:
            raise ConfigError(f"max_new_tokens must be an integer >= 1, got {self.max_new_tokens!r}")
        if not self.temperature >= 0:
            raise ConfigError(f"temperature must be >= 0 (0 = greedy), got {self.temperature!r}")
        if not 0 < self.top_p <= 1:
            raise ConfigError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not self.repetition_penalty > 0:
            raise ConfigError(f"repetition_penalty must be > 0 (1 = off), got {self.repetition_penalty!r}")
        if not isinstance(self.no_repeat_ngram_size, int) or self.no_repeat_ngram_size < 0:
            raise ConfigError(
                f"no_repeat_ngram_size must be an integer >= 0 (0 = off), got {self.no_repeat_ngram_size!r}"
            )
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        object.__setattr__(self, "stop", tuple(s for s in self.stop if s))


class Sampler:
    """Picks the next token from logits according to :class:`GenerationOptions`."""

    def __init__(self, options: GenerationOptions, device: torch.device | str = "cpu"):
        self.greedy = options.temperature == 0
        self.processors: list = []
        if options.repetition_penalty != 1:
            self.processors.append(RepetitionPenaltyLogitsProcessor(options.repetition_penalty))
        if options.no_repeat_ngram_size > 0:
            self.processors.append(NoRepeatNGramLogitsProcessor(options.no_repeat_ngram_size))
        self.warpers: list = [TemperatureLogitsWarper(options.temperature)] if not self.greedy else []
        if not self.greedy and options.top_p < 1:
            self.warpers.append(TopPLogitsWarper(options.top_p))
        self.generator = torch.Generator(device=device)
        if options.seed is not None:
            self.generator.manual_seed(options.seed)
        else:
            self.generator.seed()

    @property
    def argmax_only(self) -> bool:
        """Whether every choice is the largest logit's token, whatever came before (greedy, no processors): a
        step may then choose it where the logits are made (:meth:`~semanticache_rag.engine.Engine.greedy`)."""
        return self.greedy and not self.processors

    def __call__(self, logits: torch.Tensor, history: Sequence[int] = ()) -> int:
        """``logits`` (V,) of the last position, ``history`` the answer's tokens so far -> token id."""
        if self.processors:
            ids = torch.tensor([list(history)], dtype=torch.long, device=logits.device)
            scores = logits.float()[None]
            for process in self.processors:
                scores = process(ids, scores)
            logits = scores[0]
        if self.greedy:
            return int(logits.argmax())
        scores = logits.float()[None]
        for warp in self.warpers:
            scores = warp(None, scores)
        probs = torch.softmax(scores, dim=-1)
        return int(torch.multinomial(probs, 1, generator=self.generator))


# Two ways to cut an answer into units: sentences (. ! ? before white space, or a blank line; a
# single line break is white space, since answers imitate the hard-wrapped lines of PDF text) and lines.
_SENTENCE_END = re.compile(r"[.!?](?=\s)|\n\s*\n")
_LINE_END = re.compile(r"\n")


class LoopGuard:
    """Tells when an answer started repeating itself, and where to cut it.

    Two signs, both within one answer: a sentence or a line (at least ``min_chars`` characters and
    two words, white space ignored) that equals an earlier one, and a block of ``period`` tokens
    repeated ``repeats`` times in a row (``period * repeats >= min_run`` tokens: "1000000" is not a
    loop, "-S-GUID-S-GUID-S-GUID" is). Small models loop on long contexts; llama.cpp and
    transformers guard against it with repetition penalties, which change every later token: this
    only decides where to stop.
    """

    def __init__(
        self, min_chars: int = 12, min_run: int = 12, max_period: int = 16, repeats: int = 3, said: tuple[str, ...] = ()
    ):
        self.min_chars, self.min_run, self.max_period, self.repeats = min_chars, min_run, max_period, repeats
        # sentences and lines of the conversation's earlier answers: a new answer that says one again has
        # started repeating them (the reported chat appended the first answer to every later one)
        self.said = {u for text in said for u in self._units(text)} - {None}

    def _units(self, text: str) -> set[str | None]:
        units = set()
        for pattern in (_SENTENCE_END, _LINE_END):
            spans, start = self.segments(text + "\n\n", pattern)
            units |= {self._unit(text[a:b]) for a, b in spans}
        return units

    def _unit(self, text: str) -> str | None:
        unit = " ".join(text.split())
        return unit if len(unit) >= self.min_chars and " " in unit else None

    @staticmethod
    def segments(text: str, pattern: re.Pattern = _SENTENCE_END) -> tuple[list[tuple[int, int]], int]:
        """Spans of the finished units of ``text`` (white space alone is none), and where the unfinished one starts."""
        spans, start = [], 0
        for match in pattern.finditer(text):
            if text[start : match.end()].strip():
                spans.append((start, match.end()))
            start = match.end()
        return spans, start

    def repeated_sentence(self, text: str) -> int | None:
        """Where the last finished sentence or line starts when it repeats an earlier one, else ``None``."""
        found = []
        for pattern in (_SENTENCE_END, _LINE_END):
            spans, _ = self.segments(text, pattern)
            if len(spans) < 2:  # an answer's first sentence may say what an earlier answer said
                continue
            last = self._unit(text[spans[-1][0] : spans[-1][1]])
            earlier = {self._unit(text[a:b]) for a, b in spans[:-1]} | self.said
            if last is not None and last in earlier:
                found.append(spans[-1][0])
        return min(found, default=None)

    def may_repeat(self, text: str) -> int | None:
        """Where the unfinished sentence starts when it is so far the start of an earlier one (hold it back)."""
        spans, start = self.segments(text)
        partial = " ".join(text[start:].split())
        if not partial:
            return None
        earlier = {self._unit(text[a:b]) for a, b in spans} | (self.said if spans else set())
        return start if any(s is not None and s.startswith(partial) for s in earlier) else None

    def repeated_run(self, ids: list[int]) -> int | None:
        """How many trailing tokens repeat a block of up to ``max_period`` tokens (all but its first copy)."""
        for period in range(1, self.max_period + 1):
            span = period * max(self.repeats, -(-self.min_run // period))
            if len(ids) < span:
                break
            block = ids[-period:]
            if all(ids[-span + i] == block[i % period] for i in range(span)):
                while len(ids) >= span + period and ids[-span - period : -span] == block:
                    span += period  # the whole run, back to its first copy
                return span - period
        return None


class TextStream:
    """Turns generated token ids into text pieces, holding back what may be a stop string or a repeat.

    Tokens are decoded incrementally (``tokenizers``' ``DecodeStream``: O(1) per token, multi-byte
    characters and the tokenizer's own spacing kept right); tokenizers without a fast backend
    decode the whole answer each step. With a :class:`LoopGuard`, an answer that repeats itself
    ends (:attr:`reason` ``"repetition"``) before the repeat: a sentence that may be starting to
    repeat an earlier one is held back until it differs, and a repeated run of tokens is cut.
    """

    def __init__(self, tokenizer, stop: tuple[str, ...] = (), guard: LoopGuard | None = None):
        self.tokenizer = tokenizer
        self.stop = stop
        self.guard = guard
        self.ids: list[int] = []
        self.text = ""
        self.emitted = 0
        self.stopped = False
        self.reason = "stop"
        backend = getattr(tokenizer, "backend_tokenizer", None)
        self._backend = backend
        self._decoder = DecodeStream(skip_special_tokens=True) if backend is not None else None

    def _decode(self, token_id: int) -> None:
        if self._decoder is None or self._backend is None:
            self.text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
            return
        piece = self._decoder.step(self._backend, token_id)
        if piece:
            self.text += piece

    def push(self, token_id: int) -> str:
        """Add a token; return the newly final text (may be empty)."""
        self.ids.append(token_id)
        self._decode(token_id)
        for s in self.stop:
            at = self.text.find(s)
            if at >= 0:
                self.text, self.stopped = self.text[:at], True
        hold = len(self.text)
        if self.guard is not None and not self.stopped:
            hold = self._guard(self.guard)
        if self.text.endswith("\ufffd") and not self.stopped:  # an incomplete multi-byte character
            return ""
        if not self.stopped:
            hold = min(hold, len(self.text) - max((len(s) - 1 for s in self.stop), default=0))
        return self._emit(hold)

    def _guard(self, guard: LoopGuard) -> int:
        """Apply the loop guard; return how much of the text may be emitted now."""
        repeat = guard.repeated_sentence(self.text)
        run = guard.repeated_run(self.ids) if repeat is None else None
        if repeat is not None or run is not None:
            cut = repeat if repeat is not None else self._text_without_last(run or 0)
            self.text, self.stopped, self.reason = self.text[: max(cut, self.emitted)], True, "repetition"
            return len(self.text)
        held = guard.may_repeat(self.text)
        return len(self.text) if held is None else held

    def _text_without_last(self, tokens: int) -> int:
        """Length of the text of all but the last ``tokens`` ids (where a repeated run started)."""
        return len(self.tokenizer.decode(self.ids[:-tokens], skip_special_tokens=True))

    def flush(self, cut_off: bool = False) -> str:
        """Return whatever is still held back once decoding has ended (``cut_off``: by the token limit, not by the
        model).

        A trailing incomplete multi-byte character (decoded as U+FFFD) is dropped from the text; with the loop
        guard, so is a last sentence that repeats an earlier one, and one the limit cut off while it was still the
        start of an earlier one (held back so far).
        """
        self.text = self.text.rstrip("\ufffd")
        if self.guard is not None and not self.stopped:
            repeat = self.guard.repeated_sentence(self.text + "\n")  # the last sentence, ended by the end
            if repeat is None and cut_off:
                repeat = self.guard.may_repeat(self.text)
            if repeat is not None:
                self.text, self.reason = self.text[: max(repeat, self.emitted)], "repetition"
        return self._emit(len(self.text))

    def _emit(self, upto: int) -> str:
        if upto <= self.emitted:
            return ""
        piece, self.emitted = self.text[self.emitted : upto], upto
        return piece
