"""Triton kernels against their torch twins; the dispatcher's backend rules.

``interpret`` tests run the kernels in Triton's CPU interpreter on tiny odd shapes; ``conftest.py``
sets ``TRITON_INTERPRET=1`` on machines without CUDA before anything imports triton. ``gpu`` tests
need CUDA and a process without ``TRITON_INTERPRET=1``. Attention may be at most 2x as far from an
fp64 reference as the torch twin in the same dtype; clustering must give the same assignment.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest
import torch

from semanticache_rag import ConfigError, SemantiCacheCompressor
from semanticache_rag.compressors import semanticache
from semanticache_rag.kernels import dispatch, gsc_ref
from semanticache_rag.kernels.proportional_attention_ref import proportional_attention as attention_ref

HAS_TRITON = importlib.util.find_spec("triton") is not None
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
HAS_CUDA = torch.cuda.is_available()


def interpret(test):
    """Marker ``interpret``; skipped without triton or without the interpreter."""
    test = pytest.mark.skipif(not HAS_TRITON, reason='triton is not installed (pip install -e ".[triton]")')(test)
    test = pytest.mark.skipif(not INTERPRET, reason="TRITON_INTERPRET=1 not set (the default only without CUDA)")(test)
    return pytest.mark.interpret(test)


def gpu(test):
    """Marker ``gpu``; skipped without CUDA, triton, or with the interpreter on."""
    test = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")(test)
    test = pytest.mark.skipif(not HAS_TRITON, reason='triton is not installed (pip install -e ".[triton]")')(test)
    test = pytest.mark.skipif(INTERPRET, reason="TRITON_INTERPRET=1 runs kernels on the CPU; unset it")(test)
    return pytest.mark.gpu(test)


def decode_inputs(batch, heads, kv_heads, q_len, t_len, l_len, dim, dtype, device="cpu", seed=0):
    """Random query, appended and document K/V, and log sizes with -inf padding: zero-size entries
    inside, and ragged heads padded at the end (what a compressed cache's heads look like)."""
    g = torch.Generator().manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=g).to(device=device, dtype=dtype)

    sizes = torch.randint(0, 5, (batch, kv_heads, l_len), generator=g).float()  # 0: padding
    lengths = torch.randint(l_len // 2, l_len + 1, (batch, kv_heads), generator=g)
    sizes[torch.arange(l_len) >= lengths[:, :, None]] = 0  # each head's own length
    return dict(
        query=randn(batch, heads, q_len, dim),
        new_keys=randn(batch, kv_heads, t_len, dim),
        new_values=randn(batch, kv_heads, t_len, dim),
        doc_keys=randn(batch, kv_heads, l_len, dim),
        doc_values=randn(batch, kv_heads, l_len, dim),
        doc_log_sizes=sizes.log().to(device),
    )


def errors_vs_fp64(kernel, inputs):
    """Max abs error of the kernel and of the torch twin (same dtype) against the twin in fp64."""
    wide = {name: t.double() if t is not None and t.is_floating_point() else t for name, t in inputs.items()}
    exact = attention_ref(**wide)
    torch_error = (attention_ref(**inputs).double() - exact).abs().max().item()
    kernel_error = (kernel(**inputs).double() - exact).abs().max().item()
    return kernel_error, torch_error


def gsc_inputs(batch, kv_heads, num_tokens, dim, dtype, device="cpu", seed=0):
    """Keys with a shared direction (so clusters form), ragged chunks up to 19 tokens, some protected."""
    g = torch.Generator().manual_seed(seed)
    keys = torch.randn(batch, kv_heads, 1, dim, generator=g) + 0.8 * torch.randn(
        batch, kv_heads, num_tokens, dim, generator=g
    )
    keys[0, 0, 5] = 0  # a zero key: self-similarity 0, so it never joins its own cluster
    values = torch.randn(batch, kv_heads, num_tokens, dim, generator=g)
    chunk_ids = torch.stack(
        [
            torch.repeat_interleave(torch.arange(num_tokens), torch.randint(1, 20, (num_tokens,), generator=g))[
                :num_tokens
            ]
        ]
        + [torch.arange(num_tokens) // 7] * (batch - 1)
    )
    protected = torch.rand(batch, num_tokens, generator=g) < 0.2
    tau = torch.linspace(0.2, 0.7, batch * kv_heads).reshape(batch, kv_heads)
    return [t.to(device) for t in (keys.to(dtype), values.to(dtype), chunk_ids, tau, protected)]


# -- dispatcher rules (no triton needed)


_NO_TRITON = """
import importlib.abc, sys, torch
class Blocker(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "triton" or name.startswith("triton."):
            raise ModuleNotFoundError(f"No module named {name!r}")
sys.meta_path.insert(0, Blocker())
import semanticache_rag
from semanticache_rag import *  # every public name, each imported on first use
from semanticache_rag.kernels.dispatch import proportional_attention
q, k = torch.randn(1, 4, 1, 8), torch.randn(1, 2, 3, 8)
proportional_attention(q, k, k, k, k)
try:
    proportional_attention(q, k, k, k, k, backend="triton")
except semanticache_rag.ConfigError as error:
    assert "pip install" in str(error), error
else:
    raise AssertionError("forcing triton without triton did not raise")
"""

_WHO_IMPORTS_TRITON = """
import builtins, os, sys, torch
importers, real_import = [], builtins.__import__
def recording_import(name, globals=None, *args, **kwargs):
    if name == "triton" or name.startswith("triton."):
        importers.append((globals or {}).get("__file__") or "?")
    return real_import(name, globals, *args, **kwargs)
builtins.__import__ = recording_import
import semanticache_rag
from semanticache_rag import *  # every public name, each imported on first use
import semanticache_rag.kernels
from semanticache_rag.kernels.dispatch import proportional_attention
q, k = torch.randn(1, 4, 1, 8), torch.randn(1, 2, 3, 8)
proportional_attention(q, k, k, k, k)
ours = tuple(os.path.dirname(m.__file__) for m in (semanticache_rag, semanticache_rag.kernels))
ours_importing = [f for f in importers if f.startswith(ours)]
assert not ours_importing, ours_importing
"""


def test_import_never_imports_triton():
    """Without triton everything imports and runs on torch; with it, none of our modules imports it.

    (transformers itself imports triton, when installed, through ``torch._dynamo``.)
    """
    subprocess.run([sys.executable, "-c", _NO_TRITON], check=True, timeout=300)
    if HAS_TRITON:
        subprocess.run([sys.executable, "-c", _WHO_IMPORTS_TRITON], check=True, timeout=300)


def test_auto_is_torch_on_cpu_and_bad_names_raise():
    assert dispatch.resolve_backend("auto", torch.zeros(1)) == "torch"
    assert dispatch.resolve_backend("torch", torch.zeros(1)) == "torch"
    with pytest.raises(ConfigError, match="backend must be one of"):
        dispatch.resolve_backend("cuda", torch.zeros(1))
    with pytest.raises(ConfigError, match="backend must be one of"):
        SemantiCacheCompressor(backend="cuda")
    with pytest.raises(ConfigError, match="torch backend only"):
        SemantiCacheCompressor(value_similarity=True, backend="triton")


def test_forcing_triton_on_cpu_without_interpreter_raises(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    monkeypatch.setattr(dispatch, "triton_installed", lambda: True)
    inputs = decode_inputs(1, 4, 2, 1, 2, 5, 8, torch.float32)
    with pytest.raises(ConfigError, match="needs CUDA tensors"):
        dispatch.proportional_attention(**inputs, backend="triton")
    keys, values, chunk_ids, tau, protected = gsc_inputs(1, 2, 9, 8, torch.float32)
    with pytest.raises(ConfigError, match="needs CUDA tensors"):
        dispatch.semantic_cores(keys, values, chunk_ids, tau, protected, backend="triton")


def test_forcing_triton_without_triton_raises_and_auto_is_silent(monkeypatch):
    monkeypatch.setattr(dispatch, "triton_installed", lambda: False)
    inputs = decode_inputs(1, 4, 2, 1, 2, 5, 8, torch.float32)
    with pytest.raises(ConfigError, match=r"pip install \"semanticache-rag\[triton\]\""):
        dispatch.proportional_attention(**inputs, backend="triton")
    torch.testing.assert_close(dispatch.proportional_attention(**inputs), attention_ref(**inputs))


def test_batched_torch_twin_sizes_sum_and_match_per_head_clustering():
    keys, values, chunk_ids, tau, protected = gsc_inputs(2, 3, 77, 16, torch.float32)
    seeds, core_keys, core_values, sizes = gsc_ref.semantic_cores(keys, values, chunk_ids, tau, protected)
    assert core_keys.shape[:3] == sizes.shape and (sizes.sum(-1) == 77).all()
    layout = gsc_ref.ChunkLayout.from_chunk_ids(chunk_ids[1])
    similarity = gsc_ref.chunk_similarity(keys[1], layout)
    assert torch.equal(seeds[1], gsc_ref.greedy_seed_clustering(similarity, layout, tau[1], protected[1]))


def _greedy_by_definition(similarity, chunk_ids, tau, protected):
    """GSC as the paper states it, one head and chunk at a time in Python: (N,) seeds."""
    seeds = list(range(len(chunk_ids)))
    ids = chunk_ids.tolist()
    for chunk in sorted(set(ids)):
        members = [t for t, c in enumerate(ids) if c == chunk]
        free = [t for t in members if not protected[t]]
        while free:
            seed = free.pop(0)
            for t in list(free):
                if similarity[seed, t] >= tau:
                    seeds[t] = seed
                    free.remove(t)
    return torch.tensor(seeds)


# one int32 word, a full one (31 tokens), one int64 word (32 tokens), a full one, three (the unsorted path)
@pytest.mark.parametrize("longest", [9, 31, 32, 64, 150])
def test_packed_greedy_clustering_matches_its_definition(longest):
    g = torch.Generator().manual_seed(longest)
    num_tokens, heads = 300, 2
    keys = torch.randn(heads, 1, 8, generator=g) + 0.7 * torch.randn(heads, num_tokens, 8, generator=g)
    keys[0, 3] = 0  # a zero key: its self-similarity is 0, below tau, and it still seeds its own cluster
    lengths = torch.randint(1, longest + 1, (num_tokens,), generator=g)
    chunk_ids = torch.repeat_interleave(torch.arange(num_tokens), lengths)[:num_tokens]
    protected = torch.rand(num_tokens, generator=g) < 0.15
    layout = gsc_ref.ChunkLayout.from_chunk_ids(chunk_ids)
    tau = torch.tensor([[0.1, 0.3], [0.45, 0.5], [0.8, 0.9]])  # (K, H)
    table = gsc_ref.JoinTable.build([gsc_ref.chunk_similarity(keys, layout)], heads, layout)
    assert (table.masks is None) == (layout.width > 64)
    assert table.masks is None or table.masks.dtype == (torch.int32 if layout.width <= 31 else torch.int64)
    clusters = gsc_ref.greedy_clusters(table, layout, tau, protected)
    seeds = clusters.seeds()
    unit = torch.nn.functional.normalize(keys, dim=-1)
    for row, (k, h) in enumerate((k, h) for k in range(3) for h in range(heads)):
        want = _greedy_by_definition(unit[h] @ unit[h].T, chunk_ids, float(tau[k, h]), protected)
        assert torch.equal(seeds[row], want), (k, h)
    assert torch.equal(clusters.counts, gsc_ref.count_clusters(seeds))
    assert torch.equal(clusters.seeds(torch.tensor([5, 0])), seeds[[5, 0]])
    assert 1 < len(set(clusters.counts.tolist()))  # the thresholds cluster differently


def test_pack_rows_sets_one_bit_per_true_entry():
    mask = torch.zeros(2, 130, dtype=torch.bool)
    mask[0, [0, 63, 64, 129]] = True
    mask[1, 5] = True
    words = gsc_ref.pack_rows(mask)
    assert words.shape == (2, 3) and words.dtype == torch.int64
    assert words[0].tolist() == [1 | -(2**63), 1, 2] and words[1].tolist() == [32, 0, 0]
    short = gsc_ref.pack_rows(mask[:, :31], torch.int32)
    assert short.shape == (2, 1) and short.dtype == torch.int32
    assert short[:, 0].tolist() == [1, 32]
    mask[0, 30] = True
    assert gsc_ref.pack_rows(mask[:, :31], torch.int32)[0, 0] == 1 + 2**30


# -- kernels in the interpreter (tiny odd shapes)


@interpret
@pytest.mark.parametrize(
    "heads,kv_heads,q_len,t_len,dim,dtype",
    [
        (6, 2, 1, 5, 64, torch.float32),  # GQA 3:1, one decode step
        (8, 2, 3, 7, 128, torch.float16),  # GQA 4:1, three queries (causal among them)
        (9, 3, 2, 2, 64, torch.bfloat16),  # GQA 3:1, the queries are all the appended tokens
        (8, 2, 1, 3, 128, torch.bfloat16),
        (8, 2, 17, 20, 64, torch.float32),  # 68 query rows: two row blocks
    ],
)
def test_decode_kernel_matches_torch_twin(heads, kv_heads, q_len, t_len, dim, dtype):
    from semanticache_rag.kernels.proportional_attention_triton import DecodeConfig, proportional_attention

    def kernel(**inputs):  # 16-entry blocks, 32-entry splits: three document splits for 77 entries
        return proportional_attention(**inputs, config=DecodeConfig(block_n=16, split_size=32))

    inputs = decode_inputs(2, heads, kv_heads, q_len, t_len, 77, dim, dtype)
    kernel_error, torch_error = errors_vs_fp64(kernel, inputs)
    assert kernel_error <= 2 * torch_error, (kernel_error, torch_error)


@interpret
def test_decode_kernel_without_document_and_with_uniform_lengths():
    inputs = decode_inputs(1, 8, 2, 3, 6, 0, 64, torch.float32)
    for name in ("doc_keys", "doc_values", "doc_log_sizes"):
        inputs[name] = None
    kernel_error, torch_error = errors_vs_fp64(
        lambda **i: dispatch.proportional_attention(**i, backend="triton"), inputs
    )
    assert kernel_error <= 2 * torch_error + 1e-6, (kernel_error, torch_error)
    inputs = decode_inputs(1, 8, 2, 1, 1, 77, 64, torch.float32)
    inputs["doc_log_sizes"] = None
    kernel_error, torch_error = errors_vs_fp64(
        lambda **i: dispatch.proportional_attention(**i, backend="triton"), inputs
    )
    assert kernel_error <= 2 * torch_error, (kernel_error, torch_error)


@interpret
def test_decode_kernel_duplicates_equal_one_entry_with_log_size():
    inputs = decode_inputs(1, 9, 3, 1, 1, 5, 64, torch.float32, seed=3)
    sizes = torch.tensor([1, 4, 2, 7, 3])
    merged = dict(inputs, doc_log_sizes=sizes.float().log().expand(1, 3, 5))
    expanded = dict(inputs, doc_log_sizes=None)
    expanded["doc_keys"] = inputs["doc_keys"].repeat_interleave(sizes, 2)
    expanded["doc_values"] = inputs["doc_values"].repeat_interleave(sizes, 2)
    run = dispatch.proportional_attention
    torch.testing.assert_close(run(**merged, backend="triton"), run(**expanded, backend="triton"), atol=1e-5, rtol=1e-4)


@interpret
@pytest.mark.parametrize("dim,dtype", [(64, torch.float32), (128, torch.float16), (64, torch.bfloat16)])
def test_clustering_kernel_gives_the_same_assignment(dim, dtype):
    keys, values, chunk_ids, tau, protected = gsc_inputs(2, 2, 77, dim, dtype)
    expected = gsc_ref.semantic_cores(keys, values, chunk_ids, tau, protected)
    got = dispatch.semantic_cores(keys, values, chunk_ids, tau, protected, backend="triton")
    assert torch.equal(got[0], expected[0])
    assert 1 < gsc_ref.count_clusters(got[0][0]).min() < 77  # the shapes merge something
    torch.testing.assert_close(got[1], expected[1])
    torch.testing.assert_close(got[2], expected[2])
    assert torch.equal(got[3], expected[3])


@interpret
def test_compressor_with_triton_backend_equals_torch_backend():
    keys, values, chunk_ids, _, protected = gsc_inputs(1, 2, 77, 16, torch.float32, seed=1)
    layout = gsc_ref.ChunkLayout.from_chunk_ids(chunk_ids[0])
    plan = semanticache._Plan(layout, protected[0], 40, torch.zeros_like(protected[0]))
    layers = [
        SemantiCacheCompressor(search_steps=4, backend=backend).compress(keys, values, None, plan)
        for backend in ("torch", "triton")
    ]
    assert torch.equal(layers[0].sizes, layers[1].sizes)
    torch.testing.assert_close(layers[0].keys, layers[1].keys)


# -- kernels on a GPU (autotuned)


@gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("q_len", [1, 4, 33])
def test_decode_kernel_on_gpu(dtype, q_len):
    inputs = decode_inputs(2, 32, 8, q_len, 40, 3001, 128, dtype, device="cuda")
    forced = dispatch.proportional_attention
    kernel_error, torch_error = errors_vs_fp64(lambda **i: forced(**i, backend="triton"), inputs)
    slack = 1e-6 if dtype == torch.float32 else 0.0  # fp32: both errors are rounding noise
    assert kernel_error <= 2 * torch_error + slack, (kernel_error, torch_error)
    assert dispatch.resolve_backend("auto", inputs["query"]) == "triton"


@gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_clustering_kernel_on_gpu(dtype):
    keys, values, chunk_ids, tau, protected = gsc_inputs(2, 8, 4099, 128, dtype, device="cuda")
    expected = gsc_ref.semantic_cores(keys, values, chunk_ids, tau, protected)
    got = dispatch.semantic_cores(keys, values, chunk_ids, tau, protected, backend="triton")
    mismatches = (got[0] != expected[0]).float().mean().item()
    assert mismatches <= 1e-3, mismatches  # only similarities within one rounding step of tau may differ
    if mismatches == 0:
        torch.testing.assert_close(got[1].float(), expected[1].float(), atol=1e-2, rtol=1e-2)
        assert torch.equal(got[3], expected[3])
