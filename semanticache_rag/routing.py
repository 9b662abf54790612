"""Which sections of a long document a question needs.

- ``bm25``: BM25 (Robertson and Zaragoza 2009) over the sections' text, from ``bm25s`` (numpy
  only; the library LlamaIndex's BM25 retriever uses). Indexing a 150K-token document's ~150
  sections takes milliseconds, so the index is built when a sectioned cache is first asked.
- ``attention``: the model's own attention from the question to a summary of every section
  (:class:`AttentionRouter`), one forward pass over the question's tokens.
- ``hybrid``: the two rankings fused (reciprocal rank fusion).
"""

from __future__ import annotations

import numpy as np
import torch

# Words: runs of two or more word characters, except Chinese and Japanese characters, which are
# written without spaces and count one character a word (bm25s's default pattern would make a whole
# unspaced sentence one word, which no question matches).
_HAN_KANA = "\u3040-\u30ff\u3400-\u4dbf\u4e00-\u9fff\uf900-\ufaff"
TOKEN_PATTERN = rf"(?u)[{_HAN_KANA}]|(?:(?![{_HAN_KANA}])\w){{2,}}"


class BM25Router:
    """Scores sections against a question with BM25.

    Parameters
    ----------
    texts : list of str
        One text per section.
    """

    name = "bm25"

    def __init__(self, texts: list[str]):
        import bm25s

        self._bm25s = bm25s
        self.size = len(texts)
        tokens = bm25s.tokenize(texts, stopwords="en", show_progress=False, token_pattern=TOKEN_PATTERN)
        self._index = None  # a document of stopwords and numbers only has nothing to index: nothing matches
        if tokens.vocab:
            self._index = bm25s.BM25()
            self._index.index(tokens, show_progress=False)

    def scores(self, question: str) -> np.ndarray:
        """BM25 score of every section (S,), 0 where it shares no word with ``question``."""
        tokenize = self._bm25s.tokenize
        words = tokenize([question], stopwords="en", show_progress=False, return_ids=False, token_pattern=TOKEN_PATTERN)
        if self._index is None or not words[0]:
            return np.zeros(self.size, dtype=np.float32)
        return np.asarray(self._index.get_scores(words[0]), dtype=np.float32)


def ranking(scores: np.ndarray) -> list[int]:
    """Section indices by score, best first; ties in document order."""
    return sorted(range(len(scores)), key=lambda i: (-float(scores[i]), i))


def summarise(layer, window: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One summary entry per ``window`` entries of a layer: size-weighted mean keys and values (1, H, E, D)
    and the sizes they stand for (1, H, E) (exact for duplicates, as semantic cores are)."""
    keys, values = layer.keys.float(), layer.values.float()
    sizes = layer.sizes.float() if layer.sizes is not None else keys.new_ones(keys.shape[:3])
    count = -(-keys.shape[2] // window)
    pad = count * window - keys.shape[2]
    sizes = torch.nn.functional.pad(sizes, (0, pad)).unflatten(2, (count, window))  # (1, H, E, W)
    total = sizes.sum(-1)
    weights = (sizes / total.clamp(min=1)[..., None])[..., None]
    means = [
        (torch.nn.functional.pad(x, (0, 0, 0, pad)).unflatten(2, (count, window)) * weights).sum(3)
        for x in (keys, values)
    ]
    return means[0].to(layer.keys.dtype), means[1].to(layer.values.dtype), total


class AttentionRouter:
    """Scores sections by the attention the question gives their summaries (SeKV's zoom scoring).

    Every ``window`` entries of a section become one summary entry (mean key and value, bias
    ``log`` of the tokens it stands for); the question runs once over the prompt head and every
    section's summary (each at its own positions, as it was read); a section scores the largest
    attention one of its entries gets in each layer (max over heads and question tokens), summed over layers.
    """

    name = "attention"

    def __init__(self, head, sections, window: int = 64):
        from semanticache_rag.kv import LayerKV

        self.size, layers = len(sections), []
        self.owners = []  # per layer, the section of each summary entry (-1: the head); layers may differ in entries
        for i, head_layer in enumerate(head.layers):
            parts = [summarise(section.layers[i], window) for section in sections]
            keys = torch.cat([head_layer.keys] + [p[0] for p in parts], 2)
            values = torch.cat([head_layer.values] + [p[1] for p in parts], 2)
            ones = keys.new_ones(head_layer.keys.shape[:3], dtype=torch.float32)
            sizes = torch.cat([ones] + [p[2] for p in parts], 2)
            layers.append(LayerKV(keys, values, sizes.round().to(torch.int32)))
            counts = torch.tensor([head_layer.keys.shape[2]] + [p[0].shape[2] for p in parts])
            self.owners.append(torch.repeat_interleave(torch.arange(-1, len(sections)), counts))
        self.layers = tuple(layers)
        self.start = head.length + max(section.length for section in sections)

    def scores(self, engine, tail: list[int]) -> np.ndarray:
        """Score of every section (S,) for the question's tokens ``tail``."""
        from semanticache_rag.compressors.zoom import question_attention

        total = torch.zeros(self.size)

        def best_entry(layer_idx, attention):  # (H, E): each section's best entry, max over heads
            owners = self.owners[layer_idx]
            mask = owners >= 0
            best = torch.zeros(self.size).scatter_reduce_(0, owners[mask], attention.amax(0)[mask], reduce="amax")
            total.add_(best)

        question_attention(engine, self.layers, self.start, tail, best_entry)
        return total.numpy()


def fused_ranking(*score_lists: np.ndarray, k: int = 60) -> list[int]:
    """Reciprocal rank fusion (Cormack et al. 2009) of several scorings, best first.

    Equal scores share a rank (sections BM25 scores 0 are all last, not ranked in document order).
    """
    fused = np.zeros(len(score_lists[0]))
    for scores in score_lists:
        rank, previous = 0, None
        for position, index in enumerate(ranking(scores)):
            if scores[index] != previous:
                rank, previous = position, scores[index]
            fused[index] += 1 / (k + rank + 1)
    return ranking(fused)
