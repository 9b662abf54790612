"""Semantic chunks: runs of tokens closed by a delimiter (SemantiCache step 1).

Whether a token closes a chunk is decided per vocabulary id from its decoded text, because BPE
vocabularies fuse punctuation into other tokens (``".\n"``, ``"),"``): matching only the bare
delimiter ids would miss most boundaries.
"""

from __future__ import annotations

import torch

DELIMITERS = frozenset(".,;:!?\n\t。，；：！？")
_SENTENCE_ENDS = frozenset(".!?:;\n。！？")
_OPENERS, _CLOSERS = "\"'([{“‘«", "\"')]}”’»"


def _token_texts(token_ids: torch.Tensor, tokenizer) -> tuple[list[str], torch.Tensor]:
    """The text of each distinct id (decoded once) and, per token, the index of its id's text."""
    unique, inverse = torch.unique(token_ids, return_inverse=True)
    return tokenizer.batch_decode(unique[:, None].tolist()), inverse


def _token_test(token_ids: torch.Tensor, tokenizer, test) -> torch.Tensor:
    """(N,) bool: ``test(text)`` of each token's text, decoding each distinct id once."""
    texts, inverse = _token_texts(token_ids, tokenizer)
    return torch.tensor([bool(test(text)) for text in texts], dtype=torch.bool)[inverse]


def delimiter_mask(token_ids: torch.Tensor, tokenizer) -> torch.Tensor:
    """(N,) bool: the token's text contains a delimiter."""
    return _token_test(token_ids, tokenizer, lambda text: any(ch in DELIMITERS for ch in text))


def digit_mask(token_ids: torch.Tensor, tokenizer) -> torch.Tensor:
    """(N,) bool: the token's text contains a digit (numbers, dates, versions, codes)."""
    return _token_test(token_ids, tokenizer, lambda text: any(ch.isdigit() for ch in text))


def word_ids(token_ids: torch.Tensor, tokenizer) -> torch.Tensor:
    """(N,) long: index of the whitespace-delimited word each token belongs to ("Q7-TANGERINE-318"
    is one word however many tokens it takes). A token starts a word when its text starts with white
    space or the previous token's text ends with it."""
    if token_ids.numel() == 0:
        return torch.zeros(0, dtype=torch.long)
    return _word_ids(*_token_texts(token_ids, tokenizer))


def _word_ids(texts: list[str], inverse: torch.Tensor) -> torch.Tensor:
    """:func:`word_ids` from :func:`_token_texts` (decoded once by the caller)."""
    leads = torch.tensor([text[:1].isspace() for text in texts], dtype=torch.bool)[inverse]
    trails = torch.tensor([text[-1:].isspace() for text in texts], dtype=torch.bool)[inverse]
    starts = leads.clone()
    starts[1:] |= trails[:-1]
    starts[0] = True
    return starts.long().cumsum(0) - 1


def name_mask(token_ids: torch.Tensor, tokenizer) -> torch.Tensor:
    """(N,) bool: every token of a capitalised word inside a sentence: names, places, titles.

    A word after sentence-ending punctuation (a closing quote or bracket after it too) or a line
    break, or the text's first word, starts a sentence, so its capital says nothing and it is left
    out; so is "I". Opening quotes and brackets before a capital do not hide it: "(Paris)" counts.
    """
    if token_ids.numel() == 0:
        return torch.zeros(0, dtype=torch.bool)
    texts, inverse = _token_texts(token_ids, tokenizer)
    words = _word_ids(texts, inverse)
    spelled = [""] * (int(words[-1]) + 1)
    for word, index in zip(words.tolist(), inverse.tolist()):
        spelled[word] += texts[index]
    capital, before = [False] * len(spelled), ""  # the text since the last word that was not white space
    for word, text in enumerate(spelled):
        tail, leading = before.rstrip(" \t").rstrip(_CLOSERS), text[: len(text) - len(text.lstrip())]
        starts_sentence = not tail.strip() or tail[-1] in _SENTENCE_ENDS or "\n" in leading
        bare = text.strip().lstrip(_OPENERS)
        capital[word] = bare[:1].isupper() and bare.rstrip(_CLOSERS + ".,;:!?") != "I" and not starts_sentence
        before = before + text if not text.strip() else text
    return torch.tensor(capital, dtype=torch.bool)[words]


def semantic_chunks(delimiters: torch.Tensor, min_length: int = 1, max_length: int = 64) -> torch.Tensor:
    """Chunk index per token.

    A chunk closes after a delimiter token once it holds at least ``min_length`` tokens, and
    always at ``max_length`` tokens, so unpunctuated runs still split.

    Parameters
    ----------
    delimiters : Tensor (N,) bool
        From :func:`delimiter_mask`.

    Returns
    -------
    Tensor (N,) long
        Non-decreasing chunk index of each token.
    """
    if not 1 <= min_length <= max_length:
        raise ValueError(f"need 1 <= min_length <= max_length, got {min_length}, {max_length}")
    ids, chunk, length = [], 0, 0
    for closes in delimiters.tolist():
        ids.append(chunk)
        length += 1
        if (closes and length >= min_length) or length >= max_length:
            chunk, length = chunk + 1, 0
    return torch.tensor(ids, dtype=torch.long)
