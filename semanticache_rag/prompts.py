"""Prompt layout: a template head, the document, then a tail that grows with the conversation.

The document is tokenised on its own and prefilled once; everything after it (the question, the
answers and later turns) is the *tail*, rendered from the model's own chat template. The head and
tail come from rendering the template once with sentinels in place of the document and splitting
there, so any chat model's template works unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass

DEFAULT_SYSTEM_PROMPT = (
    "You are a helpful assistant. Answer questions about the document using only its content. "
    "Be brief and quote the document's exact words where you can."
)
_DOC = "\x00SEMANTICACHE_DOCUMENT\x00"
_INTRO = "Read the document and answer the question.\n\n<document>\n"
_OUTRO = "\n</document>\n\nQuestion: "


@dataclass(frozen=True)
class Turn:
    """One question and, once answered, its answer."""

    question: str
    answer: str | None = None


class PromptFormat:
    """Renders the head (before the document) and the tail (after it) for a tokenizer.

    Parameters
    ----------
    tokenizer : PreTrainedTokenizerBase
        The model's tokenizer; its chat template is used when it has one.
    system_prompt : str or None
        System message, when the template supports one.
    """

    def __init__(self, tokenizer, system_prompt: str | None = DEFAULT_SYSTEM_PROMPT):
        self.tokenizer = tokenizer
        self.system_prompt = system_prompt
        self.chat = bool(getattr(tokenizer, "chat_template", None))
        self.head = self._split(self._render([Turn("?")]))[0]

    def _messages(self, turns: list[Turn], with_system: bool) -> list[dict]:
        messages = [{"role": "system", "content": self.system_prompt}] if with_system else []
        for i, turn in enumerate(turns):
            content = f"{_INTRO}{_DOC}{_OUTRO}{turn.question}" if i == 0 else turn.question
            messages.append({"role": "user", "content": content})
            if turn.answer is not None:
                messages.append({"role": "assistant", "content": turn.answer})
        return messages

    def _render(self, turns: list[Turn]) -> str:
        if not self.chat:
            return (
                _INTRO
                + _DOC
                + "".join(
                    (_OUTRO if i == 0 else "\n\nQuestion: ")
                    + t.question
                    + "\nAnswer:"
                    + (f" {t.answer}" if t.answer else "")
                    for i, t in enumerate(turns)
                )
            )
        kwargs = {"tokenize": False, "add_generation_prompt": turns[-1].answer is None}
        if self.system_prompt:
            try:
                return self.tokenizer.apply_chat_template(self._messages(turns, True), **kwargs)
            except Exception:  # noqa: BLE001 - templates without a system role raise their own errors
                pass
        return self.tokenizer.apply_chat_template(self._messages(turns, False), **kwargs)

    @staticmethod
    def _split(text: str) -> tuple[str, str]:
        head, sep, tail = text.partition(_DOC)
        if not sep:
            raise ValueError("the chat template dropped the document; pass a system_prompt=None or another model")
        return head, tail

    def tail(self, turns: list[Turn]) -> str:
        """Text after the document for ``turns`` (the last one unanswered)."""
        head, tail = self._split(self._render(turns))
        if head != self.head:
            raise ValueError("the chat template renders the document differently from turn to turn")
        return tail

    @property
    def stop_strings(self) -> tuple[str, ...]:
        """Strings that end an answer for models without a chat template."""
        return () if self.chat else ("\n\nQuestion:", "\nQuestion:")
