"""Which sections of a long document a question needs: lexical routing with BM25.

BM25 (Robertson and Zaragoza 2009) over the sections' text, from ``bm25s`` (numpy only; the
library LlamaIndex's BM25 retriever uses). Indexing a 150K-token document's ~150 sections takes
milliseconds, so the index is built when a sectioned cache is first asked, never stored.
"""

from __future__ import annotations

import numpy as np


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
        tokens = bm25s.tokenize(texts, stopwords="en", show_progress=False)
        self._index = bm25s.BM25()
        self._index.index(tokens, show_progress=False)
        self.size = len(texts)

    def scores(self, question: str) -> np.ndarray:
        """BM25 score of every section (S,), 0 where it shares no word with ``question``."""
        words = self._bm25s.tokenize([question], stopwords="en", show_progress=False, return_ids=False)[0]
        if not words:
            return np.zeros(self.size, dtype=np.float32)
        return np.asarray(self._index.get_scores(words), dtype=np.float32)


def ranking(scores: np.ndarray) -> list[int]:
    """Section indices by score, best first; ties in document order."""
    return sorted(range(len(scores)), key=lambda i: (-float(scores[i]), i))
