"""Shared fixtures: tiny random models with a small trained tokenizer (fast, no network)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

# Without CUDA, Triton kernels run in its CPU interpreter (the `interpret` tests). The mode is fixed
# when triton is first imported, which transformers does while test modules are collected.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# Under pytest-xdist (`pytest -n 2`, what CI runs) each worker gets its share of the cores: a small
# model computes more per core in two one-thread processes than in one two-thread process.
if os.environ.get("PYTEST_XDIST_WORKER"):
    _threads = max(1, (os.cpu_count() or 1) // int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")))
    torch.set_num_threads(_threads)
    os.environ["OMP_NUM_THREADS"] = str(_threads)  # and the examples and CLI runs they start

LICENSE = Path("/usr/share/common-licenses/GPL-3")
CHATML = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def corpus_text() -> str:
    """Real English text for tokenizer training and test documents."""
    if LICENSE.is_file():
        return LICENSE.read_text()
    return " ".join(f"Section {i}. The licensee may copy, modify and distribute the work." for i in range(400))


@pytest.fixture(autouse=True)
def _private_document_store(tmp_path_factory, monkeypatch):
    """Command-line runs keep document caches in a fresh folder, never in the user's store."""
    monkeypatch.setenv("SEMANTICACHE_STORE_DIR", str(tmp_path_factory.mktemp("document-store")))


@pytest.fixture(scope="session")
def tiny_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    trainer = trainers.BpeTrainer(
        vocab_size=400, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator([corpus_text()], trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        unk_token="<|endoftext|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=specials[1:],
    )
    fast.chat_template = CHATML
    return fast


def _tiny_model(kind: str, vocab_size: int, **overrides):
    """A random tiny Llama or Qwen2 (seed 0) with our attention; ``overrides`` change its config."""
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config

    from semanticache_rag.attention import register_attention

    common = dict(
        vocab_size=vocab_size,
        hidden_size=96,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=6,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=2048,
        eos_token_id=2,
        bos_token_id=None,
        pad_token_id=0,
    )
    common.update(overrides)
    config = LlamaConfig(**common) if kind == "llama" else Qwen2Config(**common)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, attn_implementation=register_attention())
    return model.eval()


@pytest.fixture(scope="session", params=["llama", "qwen2"])
def tiny_model(request, tiny_tokenizer):
    return _tiny_model(request.param, len(tiny_tokenizer))


@pytest.fixture(scope="session")
def tiny_llama(tiny_tokenizer):
    return _tiny_model("llama", len(tiny_tokenizer))


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory, tiny_llama, tiny_tokenizer):
    """The tiny Llama saved as a local model directory (what ``--model DIR`` loads)."""
    path = tmp_path_factory.mktemp("tiny-llama")
    tiny_llama.save_pretrained(path)
    tiny_tokenizer.save_pretrained(path)
    return path


@pytest.fixture()
def tiny_engine(tiny_model, tiny_tokenizer):
    from semanticache_rag import Engine

    return Engine(tiny_model, tiny_tokenizer, model_name="tiny", prefill_chunk=64)


@pytest.fixture()
def document_text() -> str:
    return corpus_text()[:3000]


@pytest.fixture()
def tiny_llama_engine(tiny_llama, tiny_tokenizer):
    """An engine on the tiny Llama only (framework adapter tests)."""
    from semanticache_rag import Engine

    return Engine(tiny_llama, tiny_tokenizer, model_name="tiny", prefill_chunk=64)
