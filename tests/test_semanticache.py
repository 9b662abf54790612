"""SemantiCache and the other compressors: invariants on tiny models and synthetic keys."""

from __future__ import annotations

import pytest
import torch

from semanticache_rag import ConfigError, Engine, NoCompression, SemantiCacheCompressor, StreamingLLMCompressor
from semanticache_rag.chunking import delimiter_mask, name_mask, semantic_chunks, word_ids
from semanticache_rag.compressors import make_compressor
from semanticache_rag.kernels.gsc_ref import ChunkLayout, chunk_similarity, greedy_seed_clustering, merge_clusters


def test_delimiters_found_inside_fused_tokens(tiny_tokenizer):
    ids = torch.tensor(tiny_tokenizer("Copy it, then share.\nDone; ok")["input_ids"])
    texts = [tiny_tokenizer.decode([i]) for i in ids]
    mask = delimiter_mask(ids, tiny_tokenizer)
    assert mask.tolist() == [any(c in ".,;:\n" for c in t) for t in texts] and mask.any()


def test_chunks_close_at_delimiters_and_cap_length():
    delims = torch.tensor([0, 0, 1, 0, 1, 1, 0, 0, 0, 0, 0], dtype=torch.bool)
    assert semantic_chunks(delims, 1, 4).tolist() == [0, 0, 0, 1, 1, 2, 3, 3, 3, 3, 4]
    assert semantic_chunks(delims, 3, 8).tolist() == [0, 0, 0, 1, 1, 1, 2, 2, 2, 2, 2]


def _synthetic(num_tokens=77, heads=3, dim=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    keys = torch.randn(heads, num_tokens, dim, generator=g)
    keys[:, 10:20] = keys[:, 10:11] + 0.01 * torch.randn(heads, 10, dim, generator=g)  # near-duplicates
    values = torch.randn(heads, num_tokens, dim, generator=g)
    chunk_ids = torch.arange(num_tokens) // 9
    return keys, values, ChunkLayout.from_chunk_ids(chunk_ids), chunk_ids


def test_gsc_clusters_stay_inside_chunks_and_sizes_sum():
    keys, values, layout, chunk_ids = _synthetic()
    protected = torch.zeros(77, dtype=torch.bool)
    protected[[0, 13, 76]] = True
    seeds = greedy_seed_clustering(chunk_similarity(keys, layout), layout, torch.tensor([0.1, 0.5, 0.9]), protected)
    assert (chunk_ids[seeds] == chunk_ids).all()  # no cluster spans two chunks
    assert (seeds <= torch.arange(77)).all()  # the seed is the first token of its cluster
    assert (seeds[:, protected] == torch.arange(77)[protected]).all()
    assert not (torch.isin(seeds, torch.tensor([0, 13, 76])) & ~protected).any()  # nothing joins a protected token
    core_keys, core_values, sizes = merge_clusters(keys, values, seeds)
    assert (sizes.sum(1) == 77).all()
    first = seeds[0] == 10  # members of head 0's cluster seeded at token 10
    torch.testing.assert_close(core_keys[0, int((seeds[0] == torch.arange(77))[:10].sum())], keys[0, first].mean(0))


def test_threshold_one_keeps_distinct_keys_apart():
    keys, values, layout, _ = _synthetic()
    seeds = greedy_seed_clustering(
        chunk_similarity(keys, layout), layout, torch.full((3,), 1.0 + 1e-6), torch.zeros(77, dtype=torch.bool)
    )
    assert (seeds == torch.arange(77)).all()


@pytest.mark.parametrize("ratio", [0.5, 0.75, 0.9])
def test_budget_met_per_layer_and_bytes_shrink(tiny_model, tiny_tokenizer, ratio, document_text):
    engine = Engine(
        tiny_model, tiny_tokenizer, compressor=SemantiCacheCompressor(ratio, anchor_std=None), prefill_chunk=128
    )
    cache = engine.read(document_text, progress=False)
    assert cache.length > 1000
    for layer in cache.layers:
        kept = layer.num_entries / (layer.keys.shape[1] * cache.length)
        assert abs((1 - kept) - ratio) <= 0.02
        sizes = layer.sizes.float()
        assert torch.allclose(sizes.sum(-1), torch.full_like(sizes.sum(-1), cache.length))  # sizes sum per head
    assert abs(cache.entries_removed - ratio) <= 0.02
    assert cache.nbytes <= (1 - ratio) * cache.full_nbytes * 1.10


def test_protected_tokens_are_kept_verbatim(tiny_llama, tiny_tokenizer, document_text):
    comp = SemantiCacheCompressor(0.75, anchor_std=None, sink_tokens=4, window_tokens=8)
    engine = Engine(tiny_llama, tiny_tokenizer, compressor=NoCompression(), prefill_chunk=128)
    full = engine.read(document_text, progress=False)
    engine.compressor = comp
    small = engine.read(document_text, progress=False)
    head = int((full.token_pages < 0).sum())
    for f, s in zip(full.layers, small.layers):
        kept = f.keys[0, :, : max(head, 4)]
        assert torch.equal(s.keys[0, :, : kept.shape[1]], kept)  # template head and sinks, in order
        sizes = s.sizes[0].float()
        for h in range(f.keys.shape[1]):
            real = sizes[h] > 0
            assert torch.equal(s.keys[0, h, real][-8:], f.keys[0, h, -8:])  # the recent window
            assert torch.equal(sizes[h, real][-8:], torch.ones(8))


def test_ratio_zero_gives_the_uncompressed_answers(tiny_model, tiny_tokenizer, document_text):
    plain = Engine(tiny_model, tiny_tokenizer, prefill_chunk=128)
    zero = Engine(tiny_model, tiny_tokenizer, compressor=SemantiCacheCompressor(0.0), prefill_chunk=128)
    a, b = (e.ask(e.read(document_text, progress=False), "Who may copy it?", max_new_tokens=10) for e in (plain, zero))
    assert a.answer == b.answer


def test_compressed_cache_answers_and_stays_unchanged(tiny_model, tiny_tokenizer, document_text):
    engine = Engine(tiny_model, tiny_tokenizer, compressor=SemantiCacheCompressor(0.5), prefill_chunk=128)
    cache = engine.read(document_text, progress=False)
    snapshot = [layer.keys.clone() for layer in cache.layers]
    first = engine.ask(cache, "Who may copy it?", max_new_tokens=8)
    assert engine.ask(cache, "Who may copy it?", max_new_tokens=8).answer == first.answer
    assert all(torch.equal(s, layer.keys) for s, layer in zip(snapshot, cache.layers))
    assert first.cache_bytes == cache.nbytes < cache.full_nbytes


def test_streaming_llm_keeps_sinks_and_recent(tiny_llama, tiny_tokenizer, document_text):
    engine = Engine(tiny_llama, tiny_tokenizer, prefill_chunk=128)
    full = engine.read(document_text, progress=False)
    engine.compressor = StreamingLLMCompressor(0.5, sink_tokens=4)
    small = engine.read(document_text, progress=False)
    keep = round(0.5 * full.length)
    for f, s in zip(full.layers, small.layers):
        assert s.keys.shape[2] == keep
        assert torch.equal(s.keys[:, :, :4], f.keys[:, :, :4])
        assert torch.equal(s.keys[:, :, 4:], f.keys[:, :, -(keep - 4) :])


@pytest.mark.parametrize(
    "kwargs,message",
    [
        ({"compression_ratio": 1.0}, "compression_ratio"),
        ({"compression_ratio": -0.1}, "compression_ratio"),
        ({"tau": 1.5}, "tau"),
        ({"target_tokens": 0}, "target_tokens"),
        ({"anchor_share": 2}, "anchor_share"),
        ({"anchor_unit": "sentence"}, "anchor_unit must be one of"),
        ({"max_word_tokens": 0}, "max_word_tokens must be >= 1"),
        ({"layer_budget_slope": 1.0}, "layer_budget_slope must be in"),
    ],
)
def test_bad_configs_name_the_value(kwargs, message):
    with pytest.raises(ConfigError, match=message):
        SemantiCacheCompressor(**kwargs)


def test_budget_larger_than_document_is_an_error(tiny_llama, tiny_tokenizer):
    engine = Engine(tiny_llama, tiny_tokenizer, compressor=SemantiCacheCompressor(target_tokens=10_000))
    with pytest.raises(ConfigError, match="exceeds the document"):
        engine.read("A short document. It has two sentences.", progress=False)


def test_registry_builds_by_name():
    assert isinstance(make_compressor("semanticache", 0.75), SemantiCacheCompressor)
    assert make_compressor("streaming_llm", 0.5).compression_ratio == 0.5
    with pytest.raises(ConfigError, match="unknown compression"):
        make_compressor("zip")


def test_a_seed_joins_its_own_cluster_even_below_tau():
    # Rounding can put a key's self-similarity just below tau while a later key's similarity to it
    # is above: the first token must still be its own seed, not absorbed by a later one.
    layout = ChunkLayout.from_chunk_ids(torch.zeros(3, dtype=torch.long))
    similarity = torch.tensor([[0.89, 0.5, 0.5], [0.91, 1.0, 0.5], [0.5, 0.5, 1.0]])[None, None]
    seeds = greedy_seed_clustering(similarity, layout, torch.tensor([0.9]), torch.zeros(3, dtype=torch.bool))
    assert seeds.tolist() == [[0, 1, 2]]


def test_words_are_whitespace_delimited_whatever_the_tokens(tiny_tokenizer):
    text = "The code is Q7-TANGERINE-318.\nNext line, two words."
    ids = torch.tensor(tiny_tokenizer(text, add_special_tokens=False)["input_ids"])
    words = word_ids(ids, tiny_tokenizer)
    pieces = {}
    for token, word in zip(ids.tolist(), words.tolist()):
        pieces[word] = pieces.get(word, "") + tiny_tokenizer.decode([token])
    assert [p.strip() for p in pieces.values() if p.strip()] == text.split()  # white space alone: its own


def test_an_anchor_keeps_its_whole_word_within_the_budget(tiny_llama, tiny_tokenizer, document_text):
    from semanticache_rag.compressors.base import CompressionContext

    text = document_text[:1500] + " The maintenance code is Q7-TANGERINE-318. " + document_text[1500:2500]
    ids = torch.tensor(tiny_tokenizer(text, add_special_tokens=False)["input_ids"])
    words = word_ids(ids, tiny_tokenizer)
    surprisal = torch.zeros(len(ids))
    code = [i for i, w in enumerate(words.tolist()) if w == words[len(tiny_tokenizer(text[:1530])["input_ids"])]]
    surprisal[code[1]] = 50.0  # one surprising token inside the code
    context = CompressionContext(ids, torch.zeros(len(ids), dtype=torch.bool), surprisal, tiny_tokenizer)
    assert len(code) > 8  # the tiny tokenizer splits it into many tokens
    for unit, longest, whole in (("word", 32, True), ("token", 32, False), ("word", 8, False)):
        compressor = SemantiCacheCompressor(0.5, anchor_unit=unit, max_word_tokens=longest, protect_digits=False)
        plan = compressor.prepare(context)
        assert bool(plan.protected[code].all()) == whole and bool(plan.protected[code[1]])
        assert int(plan.protected.sum()) <= compressor.anchor_share * plan.target + 4 + 32  # sinks and window too


def test_names_are_capitalised_words_inside_a_sentence(tiny_tokenizer):
    text = 'The city is Paris. Then Maria went home.\nLondon is far; Ana Lisboa too. "So," I said (Rome).'
    ids = torch.tensor(tiny_tokenizer(text, add_special_tokens=False)["input_ids"])
    mask = name_mask(ids, tiny_tokenizer)
    words, names = word_ids(ids, tiny_tokenizer), {}
    for token, word in zip(ids[mask].tolist(), words[mask].tolist()):
        names[word] = names.get(word, "") + tiny_tokenizer.decode([token])
    # not a sentence's first word (The, Then, London, Ana, So) nor I; an opening bracket does not hide one
    assert [n.strip() for n in names.values()] == ["Paris.", "Maria", "Lisboa", "(Rome)."]
    assert name_mask(ids[:0], tiny_tokenizer).numel() == 0


def test_name_anchors_keep_a_name_within_the_budget(tiny_tokenizer, document_text):
    from semanticache_rag.compressors.base import CompressionContext

    text = document_text[:1500] + " The keeper of the north hall is Bartholomew Quennell. " + document_text[1500:2500]
    ids = torch.tensor(tiny_tokenizer(text, add_special_tokens=False)["input_ids"])
    start = len(tiny_tokenizer(text[: text.index(" Bartholomew")], add_special_tokens=False)["input_ids"])
    end = len(tiny_tokenizer(text[: text.index(" Quennell") + 9], add_special_tokens=False)["input_ids"])
    name = [i for i in range(start, end) if tiny_tokenizer.decode([int(ids[i])]).strip()]  # not lone spaces
    context = CompressionContext(ids, torch.zeros(len(ids), dtype=torch.bool), torch.zeros(len(ids)), tiny_tokenizer)
    for names in (True, False):
        compressor = SemantiCacheCompressor(0.5, anchor_unit="word", protect_names=names, anchor_std=None)
        plan = compressor.prepare(context)
        assert len(name) > 6 and bool(plan.protected[name].all()) == names
        assert int(plan.protected.sum()) <= compressor.anchor_share * plan.target + 4 + 32


def test_layer_targets_slope_floor_and_total():
    from semanticache_rag.compressors.semanticache import layer_targets

    assert layer_targets(100, 5, 0.0, 10, 400) == [100] * 5
    assert layer_targets(100, 5, 0.5, 10, 400) == [150, 125, 100, 75, 50]
    assert layer_targets(100, 5, -0.5, 10, 400) == [50, 75, 100, 125, 150]
    floored = layer_targets(100, 5, 0.5, 80, 400)  # the last layers rise to the floor, the first give it back
    assert min(floored) >= 80 and sum(floored) <= 500 and floored[0] > floored[-1]
    capped = layer_targets(100, 3, 0.9, 10, 120)
    assert max(capped) <= 120 and sum(capped) <= 300


def test_layer_budgets_follow_the_slope_and_keep_the_total(tiny_llama, tiny_tokenizer, document_text):
    engine = Engine(tiny_llama, tiny_tokenizer, prefill_chunk=128)
    prefill = engine.prefill(document_text, progress=False, surprisal=True)
    uniform = engine.compress(prefill, SemantiCacheCompressor(0.75))
    sloped = engine.compress(prefill, SemantiCacheCompressor(0.75, layer_budget_slope=0.3))
    kept = [layer.num_entries / layer.keys.shape[1] for layer in sloped.layers]
    assert kept[0] > 1.15 * kept[-1] and kept == sorted(kept, reverse=True)
    assert sloped.num_entries <= uniform.num_entries * 1.02  # the same budget, spent otherwise
    assert abs(sloped.entries_removed - 0.75) <= 0.02
    for layer in sloped.layers:
        assert bool((layer.sizes[0].sum(-1) == sloped.length).all())  # every token accounted for


def test_tau_search_returns_the_clustering_of_the_tau_it_found():
    """The search keeps the seeds of the round that tried the chosen tau (no clustering after it): they are
    the clustering at that tau, within the budget and at most one entry short of it; a head that no tau
    fits gets the clustering at tau = -1."""
    from types import SimpleNamespace

    tokens, calls = 40, []

    def seeds_at(tau):  # (K, H) -> (K, H, N): head 0 keeps more clusters as tau grows, head 1 always keeps all
        own = torch.arange(tokens)
        kept = torch.stack(
            [((tau[:, 0] + 1) / 2 * tokens).floor().clamp(1, tokens), torch.full_like(tau[:, 1], tokens)], 1
        )
        return torch.where(own < kept[..., None], own, torch.zeros_like(own))

    def cluster(tau):  # the compressor's contract: counts (K, H), and the seeds of one candidate per head
        calls.append(tau.clone())
        seeds = seeds_at(tau)
        return (seeds == torch.arange(tokens)).sum(-1), lambda index: seeds[index, torch.arange(tau.shape[1])]

    chunks = ChunkLayout.from_chunk_ids(torch.arange(tokens) // 8)
    plan = SimpleNamespace(target=17, layout=chunks, protected=torch.zeros(tokens, dtype=torch.bool))
    seeds = SemantiCacheCompressor(0.5)._search_tau(cluster, 2, plan)
    assert seeds.shape == (2, tokens)
    counts = (seeds == torch.arange(tokens)).sum(1)
    assert 16 <= counts[0] <= 17 and counts[1] == tokens  # head 1 fits no tau: its clustering at tau = -1
    tried = [tau[k, 0] for tau in calls[:-1] for k in range(len(tau))]
    assert any(torch.equal(seeds_at(torch.stack([t, t])[None])[0, 0], seeds[0]) for t in tried)
    assert all(len(tau) == 4 for tau in calls[:-1]) and calls[-1].tolist()[0][1] == -1.0
    assert len(calls) <= 2 * 9 + 1  # never more rounds than twice those of an even search
    calls.clear()

    def one_head(tau):
        counts, pick = cluster(tau.repeat(1, 2))
        return counts[:, :1], lambda index: pick(index.repeat(2))[:1]

    seeds = SemantiCacheCompressor(0.5)._search_tau(one_head, 1, plan)
    assert 16 <= (seeds[0] == torch.arange(tokens)).sum() <= 17
    assert all(len(tau) == 4 for tau in calls)  # every head fitted: no clustering after the search


def test_layers_clustered_together_equal_layers_clustered_alone(tiny_model, tiny_tokenizer, document_text, monkeypatch):
    """At a fixed tau the clustering does not depend on which layers share the greedy loop."""
    from semanticache_rag.compressors import semanticache

    engine = Engine(tiny_model, tiny_tokenizer, compressor=SemantiCacheCompressor(tau=0.2), prefill_chunk=128)
    together = engine.read(document_text, progress=False)
    assert len(together.layers) > 1 and together.entries_removed > 0.1
    heads = together.layers[0].keys.shape[1]
    assert heads >= 2
    cost = 1_000_000
    monkeypatch.setattr(semanticache, "_grid_bytes", lambda keys, layout, masks=True: (cost, 0))
    calls = []
    original = semanticache.SemantiCacheCompressor._compress_layers

    def counted(self, keys_values, plan):
        calls.append((len(keys_values), keys_values[0][0].shape[1]))
        return original(self, keys_values, plan)

    monkeypatch.setattr(semanticache.SemantiCacheCompressor, "_compress_layers", counted)
    for floor, shape in ((cost, (1, heads)), (cost * (heads - 1) // heads, (1, heads - 1)), (0, (1, 1))):
        monkeypatch.setattr(semanticache, "_GROUP_BYTES", cost)  # one layer at most
        monkeypatch.setattr(semanticache, "_FLOOR_BYTES", floor)  # one layer, fewer heads, one head at once
        calls.clear()
        alone = engine.read(document_text, progress=False)
        assert calls[0] == shape, calls
        for grouped, single in zip(together.layers, alone.layers, strict=True):
            assert torch.equal(grouped.sizes, single.sizes) and torch.equal(grouped.keys, single.keys)


@pytest.mark.parametrize("ratio", [0.5, 0.9])
def test_the_cpu_clustering_kernel_finds_the_torch_loops_clusters(
    tiny_model, tiny_tokenizer, document_text, ratio, monkeypatch
):
    """The C++ clustering (kernels/gsc_cpu.cpp) and the bit-packed torch loop give the same cores, through
    the whole tau search (at 0.9 the chunks are coarsened past 31 tokens: int64 words in the loop). The
    same layers are grouped for both (the search's rounds depend on the heads searched together)."""
    from semanticache_rag.compressors import semanticache
    from semanticache_rag.kernels import cpu_ops

    if not cpu_ops.available():
        pytest.skip("the CPU kernels could not be built here")
    monkeypatch.setattr(semanticache, "_grid_bytes", lambda keys, layout, masks=True: (1, 0))
    engine = Engine(tiny_model, tiny_tokenizer, compressor=SemantiCacheCompressor(ratio), prefill_chunk=128)
    prefill = engine.prefill(document_text, progress=False, surprisal=True)
    compressor = SemantiCacheCompressor(ratio)
    assert compressor._on_cpu_kernel(prefill.keys_values[0][0])
    kernel = engine.compress(prefill, compressor)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(semanticache.SemantiCacheCompressor, "_on_cpu_kernel", lambda self, keys: False)
        loop = engine.compress(prefill, compressor)
    assert kernel.entries_removed > 0.3
    for a, b in zip(kernel.layers, loop.layers, strict=True):
        assert torch.equal(a.sizes, b.sizes) and torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)


def test_grids_side_by_side_must_cover_the_heads_they_are_for():
    """Fewer (or more) heads of grids than the table is for is an error that says how many came."""
    from semanticache_rag.kernels.gsc_ref import side_by_side

    layout = ChunkLayout.from_chunk_ids(torch.tensor([0, 0, 1, 1, 1]))
    grid = chunk_similarity(torch.randn(2, 5, 8), layout)
    assert torch.equal(side_by_side([grid[:1], grid[1:]], 2, layout), grid)
    for grids, heads in (([grid], 3), ([], 2), ([grid, grid], 2)):
        with pytest.raises(ValueError, match="grids for .* heads expected"):
            side_by_side(grids, heads, layout)
