"""SeKV zoom-in: span summary, host-side low-rank span copies, per-question expansion."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from semanticache_rag import ConfigError, Engine, NoCompression, SeKVCompressor
from semanticache_rag.compressors import make_compressor
from semanticache_rag.compressors.span_index import SpanIndex, factor, top_eigenvectors


def _read(engine, text, compressor):
    engine.compressor = compressor
    return engine.read(text, progress=False)


@pytest.fixture()
def engine(tiny_llama, tiny_tokenizer):
    return Engine(tiny_llama, tiny_tokenizer, model_name="tiny", prefill_chunk=128)


def test_reconstruction_error_falls_with_rank_and_is_exact_at_full_rank():
    rows = torch.randn(2, 3, 5, 24, 16)  # (L, H, spans, width, head_dim)
    errors = []
    for rank in (1, 2, 4, 8, 16):
        left, right = factor(rows, rank, torch.float32)
        errors.append(float((left @ right - rows).norm() / rows.norm()))
    assert all(a > b for a, b in zip(errors, errors[1:]))
    assert errors[-1] < 1e-5
    left, right = factor(rows[:, :, :, :4], 8, torch.float32)  # spans of <= rank tokens are kept as they are
    assert left is None and torch.equal(right, rows[:, :, :, :4])


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_top_eigenvectors_shared_out_to_threads_are_torchs_own(threads):
    """The batch solved a share per thread is torch's single call bit for bit; the thread count comes back."""
    x = torch.randn(2, 3, 7, 24, 16, generator=torch.Generator().manual_seed(threads))
    gram = x.transpose(-1, -2) @ x
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        got = top_eigenvectors(gram, 5)
        assert torch.get_num_threads() == threads
    finally:
        torch.set_num_threads(before)
    assert got.shape == (2, 3, 7, 16, 5) and torch.equal(got, torch.linalg.eigh(gram).eigenvectors[..., -5:])


def test_summary_meets_the_device_budget_and_sizes_sum(engine, document_text):
    compressor = SeKVCompressor(0.75, summary="spans")
    cache = _read(engine, document_text, compressor)
    summary, zoom = compressor.budgets(cache.length)
    assert summary + zoom == round(0.25 * cache.length) and zoom == round(0.3 * (summary + zoom))
    for layer in cache.layers:
        assert layer.keys.shape[2] == summary
        assert (layer.sizes.sum(-1) == cache.length).all()
    assert cache.nbytes < 0.25 * cache.full_nbytes
    assert cache.host_nbytes > 0
    answer = engine.ask(cache, "Who may copy it?", max_new_tokens=4)
    assert 0 < answer.tokens_reconstructed <= zoom
    assert answer.cache_bytes <= 0.25 * cache.full_nbytes * 1.05  # summary + expansion + masked sizes copy


@pytest.mark.parametrize("summary", ["spans", "cores"])
def test_every_span_rebuilt_at_full_rank_gives_the_full_cache_answer(engine, document_text, summary):
    question = "Who may copy it?"
    full = engine.ask(_read(engine, document_text, NoCompression()), question, max_new_tokens=12)
    # head_dim is 16: rank 16 is exact; a zoom budget of the whole document expands every span (every chunk
    # with a merged core)
    compressor = SeKVCompressor(0.5, zoom_tokens=10_000, host_copy="rank", rank=16, summary=summary)
    cache = _read(engine, document_text, compressor)
    answer = engine.ask(cache, question, max_new_tokens=12)
    assert answer.completion_ids == full.completion_ids
    rebuilt = cache.zoom.length > 1 if summary == "spans" else cache.zoom.merged
    assert answer.tokens_reconstructed == int(cache.zoom.length[rebuilt].sum())
    assert answer.spans_expanded == int(rebuilt.sum())


def test_zoom_leaves_the_document_cache_unchanged_and_reports_bytes(engine, document_text):
    cache = _read(engine, document_text, SeKVCompressor(0.75, zoom_tokens=128, rank=4))
    sizes = [layer.sizes.clone() for layer in cache.layers]
    conversation = engine.conversation(cache)
    first = conversation.ask("Who may copy it?", max_new_tokens=6)
    second = conversation.ask("And who may change it?", max_new_tokens=6)
    assert all(torch.equal(s, layer.sizes) for s, layer in zip(sizes, cache.layers))
    for answer in (first, second):
        assert 0 < answer.tokens_reconstructed <= 128 and answer.spans_expanded > 0
        assert answer.cache_bytes > cache.nbytes and answer.host_bytes == cache.host_nbytes
    assert second.prompt_tokens > first.prompt_tokens  # the first turn stays in context


def test_no_zoom_budget_answers_from_the_summary_alone(engine, document_text):
    cache = _read(engine, document_text, SeKVCompressor(0.75, zoom_tokens=0))
    answer = engine.ask(cache, "Who may copy it?", max_new_tokens=6)
    assert answer.tokens_reconstructed == 0 and answer.spans_expanded == 0


@pytest.mark.parametrize("host_copy", ["int8", "int4", "rank"])
def test_span_index_state_dict_round_trip(engine, document_text, host_copy):
    compressor = SeKVCompressor(0.75, zoom_tokens=64, host_copy=host_copy, rank=4, summary="spans")
    cache = _read(engine, document_text, compressor)
    state = cache.zoom.state_dict()
    assert all(isinstance(t, torch.Tensor) for t in state.values())
    again = SpanIndex.from_state_dict(state)
    selected = (cache.zoom.length > 1).nonzero()[:5, 0]
    for a, b in zip(
        cache.zoom.reconstruct(selected, "cpu", torch.float32), again.reconstruct(selected, "cpu", torch.float32)
    ):
        assert torch.equal(a, b)
    assert again.nbytes == cache.zoom.nbytes
    with pytest.raises(ValueError, match="lacks 'start'"):
        SpanIndex.from_state_dict({name: tensor for name, tensor in state.items() if name != "start"})
    del state["0.values." + ("right" if host_copy == "rank" else "codes")]
    with pytest.raises(ValueError, match="lacks '0.values"):
        SpanIndex.from_state_dict(state)


@pytest.mark.parametrize("summary", ["spans", "cores"])
def test_coded_host_copy_rebuilds_every_token_within_its_codes_bound(engine, document_text, summary):
    """int8/int4 copies give back each span token within half a code step of it, in fewer bytes than the
    tokens (and the int4 copy in fewer than the int8 one); the rank copy of the same spans is further off."""
    prefill = engine.prefill(document_text, progress=False, surprisal=True)
    full = engine.compress(prefill, NoCompression())
    stacked = [torch.stack([getattr(layer, name)[0] for layer in full.layers]) for name in ("keys", "values")]
    errors, host = {}, {}
    for host_copy in ("int8", "int4", "rank"):
        compressor = SeKVCompressor(0.75, host_copy=host_copy, rank=4, summary=summary)
        index = engine.compress(prefill, compressor).zoom
        spans = index if summary == "spans" else index.chunks
        selected = (spans.length > 1).nonzero()[:, 0]
        rebuilt = spans.reconstruct(selected, "cpu", torch.float32)
        spans_of = [(s, n) for s, n in zip(spans.start[selected].tolist(), spans.length[selected].tolist())]
        # reconstruct gives the tokens bucket by bucket (spans of width 2, 4, 8, ... tokens), spans in order
        order = torch.cat([torch.arange(s, s + n) for w in spans.widths for s, n in spans_of if _width(n) == w])
        assert order.numel() == rebuilt[0].shape[2] == sum(n for _, n in spans_of)
        errors[host_copy] = max(
            float((r - x[:, :, order]).abs().max() / x.abs().max()) for r, x in zip(rebuilt, stacked)
        )
        host[host_copy] = spans.nbytes
    assert errors["int8"] <= 1 / 255 and errors["int4"] <= 1 / 15  # half a code step of the group's range
    assert errors["int8"] < errors["int4"] < errors["rank"]
    assert host["int4"] < host["int8"] < host["rank"]


def _width(length: int) -> int:
    return 2 ** math.ceil(math.log2(length))


def test_ratio_zero_keeps_every_token(engine, document_text):
    cache = _read(engine, document_text, SeKVCompressor(0.0, zoom_tokens=0))
    assert cache.zoom is None and cache.entries_removed == 0


@pytest.mark.parametrize(
    "kwargs,message",
    [
        ({"compression_ratio": 1.0}, "compression_ratio"),
        ({"zoom_tokens": -1}, "zoom_tokens"),
        ({"zoom_share": 1.0}, "zoom_share"),
        ({"rank": 0}, "rank"),
        ({"host_copy": "int2"}, "host_copy must be one of"),
        ({"anchor_unit": "span"}, "anchor_unit must be one of"),
        ({"max_word_tokens": 0}, "max_word_tokens"),
    ],
)
def test_bad_configs_name_the_value(kwargs, message):
    with pytest.raises(ConfigError, match=message):
        SeKVCompressor(**kwargs)


def test_anchors_keep_whole_words_and_digits_as_semanticache_does(tiny_tokenizer, document_text):
    """The summary keeps each token of an anchor's word as an entry of its own (no span merges them)."""
    from semanticache_rag.chunking import word_ids
    from semanticache_rag.compressors.base import CompressionContext

    text = document_text[:1500] + " The maintenance code is Q7-TANGERINE-318. " + document_text[1500:2500]
    encoded = tiny_tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    ids = torch.tensor(encoded["input_ids"])
    words = word_ids(ids, tiny_tokenizer)
    inside = text.index("Q7-") + 1
    first = next(i for i, (a, b) in enumerate(encoded["offset_mapping"]) if a <= inside < b)
    code = (words == words[first]).nonzero()[:, 0].tolist()
    digits = [i for i in code if any(ch.isdigit() for ch in tiny_tokenizer.decode([int(ids[i])]))]
    assert len(code) > 8 and 0 < len(digits) < len(code)
    surprisal = torch.rand(len(ids), generator=torch.Generator().manual_seed(0)) + 1
    surprisal[code] = 0.0  # the code's tokens start no span of their own accord ...
    surprisal[code[1]] = 50.0  # ... but one of them is the most surprising token
    context = CompressionContext(ids, torch.zeros(len(ids), dtype=torch.bool), surprisal, tiny_tokenizer)

    def alone(options):  # code tokens that are an entry of their own
        plan = SeKVCompressor(0.5, max_word_tokens=32, **options).prepare(context)  # the tiny tokenizer splits finely
        entry = plan.entry_of_token
        return {i for i in code if int(plan.length[entry[i]]) == 1 and int(plan.start[entry[i]]) == i}

    assert alone({"protect_digits": False}) == set(code)
    token_only = alone({"anchor_unit": "token", "protect_digits": False})
    assert code[1] in token_only and token_only != set(code)
    assert set(digits) <= alone({"anchor_unit": "token", "anchor_std": 100.0})  # digits come first
    assert not set(digits) <= alone({"anchor_unit": "token", "protect_digits": False, "anchor_std": 100.0})


def test_registry_builds_sekv():
    assert isinstance(make_compressor("sekv", 0.5), SeKVCompressor)


def test_cores_summary_is_semanticache_at_the_summary_budget(engine, document_text):
    compressor = SeKVCompressor(0.75, summary="cores")
    cache = _read(engine, document_text, compressor)
    summary, zoom = compressor.budgets(cache.length)
    for layer in cache.layers:
        assert (layer.sizes > 0).sum(-1).max() <= summary
        assert (layer.sizes.sum(-1) == cache.length).all()
    zoom_state = cache.zoom
    assert zoom_state.zoom_tokens == zoom
    for layer, entries in zip(cache.layers, zoom_state.entry_chunk):
        # each core lies inside its chunk: the chunk's tokens add up to the sizes of its cores
        sizes = layer.sizes[0].long()
        for head in range(sizes.shape[0]):
            real = entries[head] >= 0
            per_chunk = torch.zeros(zoom_state.merged.numel(), dtype=torch.long)
            per_chunk.scatter_add_(0, entries[head][real].long(), sizes[head][real])
            chunk_length = torch.bincount(
                torch.repeat_interleave(torch.arange(zoom_state.chunks.length.numel()), zoom_state.chunks.length),
                minlength=per_chunk.numel(),
            )
            assert torch.equal(per_chunk, chunk_length)
    answer = engine.ask(cache, "Who may copy it?", max_new_tokens=4)
    assert 0 < answer.tokens_reconstructed <= zoom and answer.spans_expanded > 0


def test_cores_state_dict_round_trip_and_damage_is_refused(engine, document_text):
    from semanticache_rag.compressors.core_index import CoreIndex
    from semanticache_rag.compressors.sekv import zoom_from_state_dict

    cache = _read(engine, document_text, SeKVCompressor(0.75, summary="cores", rank=4))
    state = cache.zoom.state_dict()
    again = zoom_from_state_dict(state)
    assert isinstance(again, CoreIndex) and again.nbytes == cache.zoom.nbytes
    assert all(torch.equal(a, b) for a, b in zip(again.entry_chunk, cache.zoom.entry_chunk))
    question = engine.ask(cache, "Who may copy it?", max_new_tokens=6)
    reloaded = engine.ask(dataclasses.replace(cache, zoom=again), "Who may copy it?", max_new_tokens=6)
    assert reloaded.completion_ids == question.completion_ids
    again.check(cache.layers)
    with pytest.raises(ValueError, match="do not match"):
        again.check(cache.layers[1:])
    state["entry_chunk.0"] = state["entry_chunk.0"] + cache.zoom.merged.numel()  # chunks that do not exist
    with pytest.raises(ValueError, match="do not match"):
        zoom_from_state_dict(state)
    with pytest.raises(ConfigError, match="summary must be one of"):
        SeKVCompressor(summary="chunks")


def test_cores_summary_of_a_short_text_takes_the_whole_budget(engine):
    """When the template and sink tokens alone fill the summary's share, the zoom's share goes to the summary."""
    text = "Short text about who may copy it. " * 20
    compressor = SeKVCompressor(0.7, summary="cores")
    cache = _read(engine, text, compressor)
    summary, zoom = compressor.budgets(cache.length)
    template = int(engine.prefill(text, progress=False).pages.lt(0).sum()) + compressor.sink_tokens
    assert summary <= template < summary + zoom  # the case this test is about
    assert summary < int(cache.layers[0].sizes.gt(0).sum(-1).max()) <= summary + zoom
    assert cache.zoom is None or cache.zoom.zoom_tokens == 0
