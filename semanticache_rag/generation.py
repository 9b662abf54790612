"""Decoding options, token sampling and incremental detokenisation."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from transformers.generation.logits_process import TemperatureLogitsWarper, TopPLogitsWarper

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
    """

    max_new_tokens: int = 256
    temperature: float = 0.0
    top_p: float = 1.0
    stop: tuple[str, ...] = field(default_factory=tuple)
    seed: int | None = None

    def __post_init__(self):
        if not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 1:
            raise ConfigError(f"max_new_tokens must be an integer >= 1, got {self.max_new_tokens!r}")
        if not self.temperature >= 0:
            raise ConfigError(f"temperature must be >= 0 (0 = greedy), got {self.temperature!r}")
        if not 0 < self.top_p <= 1:
            raise ConfigError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        object.__setattr__(self, "stop", tuple(s for s in self.stop if s))


class Sampler:
    """Picks the next token from logits according to :class:`GenerationOptions`."""

    def __init__(self, options: GenerationOptions, device: torch.device | str = "cpu"):
        self.greedy = options.temperature == 0
        self.warpers = [TemperatureLogitsWarper(options.temperature)] if not self.greedy else []
        if not self.greedy and options.top_p < 1:
            self.warpers.append(TopPLogitsWarper(options.top_p))
        self.generator = torch.Generator(device=device)
        if options.seed is not None:
            self.generator.manual_seed(options.seed)
        else:
            self.generator.seed()

    def __call__(self, logits: torch.Tensor) -> int:
        """``logits`` (V,) of the last position -> token id."""
        if self.greedy:
            return int(logits.argmax())
        scores = logits.float()[None]
        for warp in self.warpers:
            scores = warp(None, scores)
        probs = torch.softmax(scores, dim=-1)
        return int(torch.multinomial(probs, 1, generator=self.generator))


class TextStream:
    """Turns generated token ids into text pieces, holding back what may be a stop string.

    Decoding the whole answer each step (answers are short) keeps multi-byte characters and
    tokenizer-specific spacing right, which per-token decoding gets wrong.
    """

    def __init__(self, tokenizer, stop: tuple[str, ...] = ()):
        self.tokenizer = tokenizer
        self.stop = stop
        self.ids: list[int] = []
        self.text = ""
        self.emitted = 0
        self.stopped = False

    def push(self, token_id: int) -> str:
        """Add a token; return the newly final text (may be empty)."""
        self.ids.append(token_id)
        self.text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        for s in self.stop:
            at = self.text.find(s)
            if at >= 0:
                self.text, self.stopped = self.text[:at], True
        if self.text.endswith("\ufffd") and not self.stopped:  # an incomplete multi-byte character
            return ""
        hold = 0 if self.stopped else max((len(s) - 1 for s in self.stop), default=0)
        return self._emit(len(self.text) - hold)

    def flush(self) -> str:
        """Return whatever is still held back once decoding has ended.

        A trailing incomplete multi-byte character (decoded as U+FFFD) is dropped from the text.
        """
        self.text = self.text.rstrip("\ufffd")
        return self._emit(len(self.text))

    def _emit(self, upto: int) -> str:
        if upto <= self.emitted:
            return ""
        piece, self.emitted = self.text[self.emitted : upto], upto
        return piece
