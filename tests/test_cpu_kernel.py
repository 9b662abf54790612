"""The CPU kernels (kernels/*_cpu.cpp: attention, int4 weights, clustering) against their torch twins.

The kernel is built on first use (``torch.utils.cpp_extension``, ~15-25 s once per machine). Where it
cannot be built the tests skip, except under ``SEMANTICACHE_REQUIRE_CPU_KERNEL=1`` (CI has a compiler:
there a failed build fails). Attention may be at most 2x as far from an fp64 reference as the torch
twin is, on the same stored inputs (house rule for kernels).
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from semanticache_rag.kernels import bench_cpu, cpu_ops, decode_attention_ref, gsc_ref, int4_weights_ref

REQUIRED = os.environ.get("SEMANTICACHE_REQUIRE_CPU_KERNEL") == "1"


@pytest.fixture(scope="module")
def kernel():
    if not cpu_ops.available():
        if REQUIRED:
            pytest.fail("the CPU attention kernel did not build (see the warning above)")
        pytest.skip("the CPU attention kernel could not be built here (no C++ compiler?)")
    return cpu_ops.decode_attention


def inputs(heads, group, dim, length, appended, key_storage, value_storage, group_size=32, seed=0):
    """Arguments of the operator: random queries, a stored document with ragged heads (-inf padding at
    their ends and zero-size entries inside), appended tokens as a strided view of a larger buffer."""
    g = torch.Generator().manual_seed(seed)
    query = torch.randn(heads, group, dim, generator=g) * dim**-0.5
    keys = torch.randn(heads, length, dim, generator=g)
    values = torch.randn(heads, length, dim, generator=g)
    sizes = torch.randint(0, 5, (heads, length), generator=g).float()
    ends = torch.randint(length // 2, length + 1, (heads,), generator=g)
    sizes[torch.arange(length) >= ends[:, None]] = 0
    buffer = torch.randn(2, heads, appended + 7, dim, generator=g)
    new_keys, new_values = buffer[0, :, :appended], buffer[1, :, :appended]  # (H, T, D), rows strided
    return (
        query,
        *bench_cpu.stored(keys, key_storage, min(group_size, dim)),
        *bench_cpu.stored(values, value_storage, min(group_size, dim)),
        sizes.log(),
        new_keys,
        new_values,
    )


def fp64_reference(args, doc_query: torch.Tensor | None = None) -> torch.Tensor:
    """The twin's arithmetic in fp64, on the decoded stored inputs (``doc_query``: the query the document's
    keys meet, if not the query itself)."""
    query, key, key_scales, key_minimums, key_bits = args[:5]
    value, value_scales, value_minimums, value_bits, bias, new_keys, new_values = args[5:12]
    dim = query.shape[-1]
    doc_query = query if doc_query is None else doc_query
    doc_keys = decode_attention_ref.decoded(key, key_scales, key_minimums, key_bits, dim).double()
    doc_values = decode_attention_ref.decoded(value, value_scales, value_minimums, value_bits, dim).double()
    scores = torch.cat([doc_query.double() @ doc_keys.transpose(1, 2) + bias.double()[:, None],
                        query.double() @ new_keys.double().transpose(1, 2)], dim=-1)  # fmt: skip
    probs = scores.softmax(-1)
    return probs @ torch.cat([doc_values, new_values.double()], dim=1)


def assert_as_close_as_the_twin(args, kernel):
    want = fp64_reference(args)
    twin = decode_attention_ref.decode_attention(*args)
    got = kernel(*args)
    assert got.shape == twin.shape and got.dtype == torch.float32
    twin_error = float((twin.double() - want).abs().max())
    error = float((got.double() - want).abs().max())
    assert error <= 2 * twin_error + 1e-7, (error, twin_error)


@pytest.mark.parametrize("storage", ["fp32", "fp16", "bf16", "int8", "int4", "int3"])
@pytest.mark.parametrize("dim,group,length", [(64, 3, 4500), (16, 1, 77), (128, 4, 513)])
def test_kernel_matches_the_torch_twin_for_every_storage(kernel, storage, dim, group, length):
    """Every stored kind, head dims 16/64/128, 1/3/4 query heads per kv head, lengths across the
    kernel's blocks (at most 2,048 entries per task, 64 per pass) and ragged -inf padding."""
    args = inputs(3, group, dim, length, appended=9, key_storage=storage, value_storage=storage)
    assert_as_close_as_the_twin(args, kernel)


def test_kernel_takes_mixed_sides_groups_of_16_and_a_single_appended_token(kernel):
    """Keys and values stored differently (Kaizen may), groups of 16 and of 8 channels, and the
    first decoding step after a document (one appended token). 4-bit sides decode in paired order where
    a group spans whole blocks of 2 x the vector width (groups of 32, the default above, with AVX2 or
    AVX-512), and as they are elsewhere (groups of 8; of 16 with AVX-512): both, on either side."""
    cases = [("int4", "int8", 16), ("fp16", "int3", 8), ("int8", "fp32", 64), ("int4", "int4", 8), ("fp16", "int4", 16)]
    for key_storage, value_storage, group_size in cases:
        args = inputs(2, 3, 64, 300, 1, key_storage, value_storage, group_size=group_size, seed=1)
        assert_as_close_as_the_twin(args, kernel)


def test_kernel_on_an_empty_document_is_attention_over_the_appended_tokens(kernel):
    args = list(inputs(2, 3, 64, 0, 5, "fp32", "fp32"))
    probs = (args[0] @ args[10].transpose(1, 2)).softmax(-1)
    torch.testing.assert_close(kernel(*args), probs @ args[11], rtol=1e-5, atol=1e-6)


def _keys_scored_in_integers(storage: str, dim: int) -> bool:
    """Whether the library scores ``storage`` keys of ``dim`` channels (groups of 32) in integers, the query split
    into pieces (q8_query off) or rounded (on): 8-bit or paired 4-bit codes, D a multiple of 64, with VNNI."""
    return storage in ("int8", "int4") and dim % 64 == 0 and "avx512_vnni" in cpu_ops._cpu_identity().split()


@pytest.mark.parametrize("storage", ["fp16", "bf16", "int8", "int3"])
@pytest.mark.parametrize("dim,group", [(64, 3), (128, 4), (16, 1), (64, 8)])
def test_coded_rows_attend_bit_for_bit_as_the_same_rows_in_fp32(kernel, storage, dim, group):
    """Rows are decoded with the twin's roundings (codes x scale + minimum, 16-bit floats widened), where
    they are used (AVX-512: a vector at a time, for up to 3 query heads) or into a tile first, and then
    attended with the fp32 rows' arithmetic: the same result, bit for bit, as the decoded rows given as fp32.
    (4-bit rows in paired channel order sum their channels in another order: within rounding, tested above.
    Keys scored in integers are too, tested below: there the values alone are compared.)"""
    args = list(inputs(3, group, dim, 1030, 9, storage, storage))
    keys = decode_attention_ref.decoded(*args[1:5], dim)
    values = decode_attention_ref.decoded(*args[5:9], dim)
    plain_keys = args[1:5] if _keys_scored_in_integers(storage, dim) else [keys, None, None, 32]
    plain = [args[0], *plain_keys, values, None, None, 32, *args[9:]]
    assert torch.equal(kernel(*args), kernel(*plain))


@pytest.mark.parametrize(
    "key_storage,dim,group,group_size,seed",
    [  # seeds on which the float path over the decoded keys meets the house rule too (it did not on every one)
     ("int8", 64, 3, 32, 0), ("int4", 64, 3, 32, 1), ("int8", 128, 4, 64, 2), ("int4", 256, 2, 32, 4),
     ("int8", 64, 8, 32, 4), ("int4", 64, 5, 64, 5)],
)  # fmt: skip
def test_coded_keys_in_integers_keep_the_query_as_it_is(kernel, key_storage, dim, group, group_size, seed):
    """With q8_query off (fp32 or int4-exact weights), coded keys are still scored in integers where the CPU has
    VNNI: the query split into 3 pieces of 8-bit codes (each what the ones before left, rounded to Q8_0: within
    2^-24 of its block's largest magnitude), codes centred. As close to the fp64 attention as the twin is, on
    queries whose channels span four orders of magnitude too; and not the result of the rounded query."""
    args = list(inputs(3, group, dim, 700, 5, key_storage, "fp32", group_size=group_size, seed=seed))
    assert_as_close_as_the_twin(args, kernel)
    g = torch.Generator().manual_seed(seed)
    args[0] = args[0] * torch.pow(10.0, torch.empty(args[0].shape).uniform_(-3, 1, generator=g))
    assert_as_close_as_the_twin(args, kernel)
    keys = decode_attention_ref.decoded(*args[1:5], dim)
    float_path = kernel(args[0], keys, None, None, 32, *args[5:])
    got = kernel(*args)
    assert float((got - float_path).abs().max()) <= 1e-5 * float(float_path.abs().max())
    assert float((got - kernel(*args, True)).abs().max()) > 1e-4  # the rounded query's result is another
    if _keys_scored_in_integers(key_storage, dim):
        assert not torch.equal(got, float_path)  # the integer path, not the float one


def test_duplicated_entries_attend_as_one_entry_with_log_size(kernel):
    """s identical rows equal one row with bias log s (proportional attention), through the kernel."""
    query, key, _, _, _, value, _, _, _, _, new_keys, new_values = inputs(2, 3, 64, 40, 4, "fp32", "fp32")
    sizes = torch.randint(1, 6, (40,))
    repeated = [t.repeat_interleave(sizes, dim=1) for t in (key, value)]
    expanded = kernel(query, repeated[0], None, None, 32, repeated[1], None, None, 32, None, new_keys, new_values)
    bias = sizes.float().log().expand(2, 40).contiguous()
    merged = kernel(query, key, None, None, 32, value, None, None, 32, bias, new_keys, new_values)
    torch.testing.assert_close(merged, expanded, rtol=1e-5, atol=1e-6)


def test_kernel_rejects_inputs_it_cannot_read(kernel):
    args = list(inputs(2, 3, 64, 50, 3, "int8", "int8"))
    bad = [
        (4, 5, "bits must be"),  # key_bits
        (1, args[1][..., :10], "do not hold"),  # codes too short for 64 channels
        (2, None, "scales and minimums"),
        (0, args[0].double(), "query must be"),
        (9, torch.zeros(2, 49), "bias must be"),
    ]
    for index, value, message in bad:
        changed = list(args)
        changed[index] = value
        with pytest.raises(RuntimeError, match=message):
            kernel(*changed)
    odd = list(inputs(2, 3, 48, 20, 3, "fp32", "fp32"))
    with pytest.raises(RuntimeError, match="head dim must be"):
        kernel(*odd)


def test_without_the_kernel_the_operator_is_the_torch_twin():
    """SEMANTICACHE_CPU_KERNEL=0: nothing is built, and the operator still answers (the twin)."""
    code = (
        "import torch\n"
        "from semanticache_rag.kernels import cpu_ops as k\n"
        "assert not k.available()\n"
        "q, kv = torch.randn(2, 3, 16), torch.randn(2, 5, 16)\n"
        "out = k.decode_attention(q, kv, None, None, 32, kv, None, None, 32, None, kv, kv)\n"
        "probs = (q @ torch.cat([kv, kv], 1).transpose(1, 2)).softmax(-1)\n"
        "torch.testing.assert_close(out, probs @ torch.cat([kv, kv], 1))\n"
        "import sys; assert not any('semanticache_cpu_ops_' in m for m in sys.modules)\n"
    )
    env = {**os.environ, "SEMANTICACHE_CPU_KERNEL": "0"}
    subprocess.run([sys.executable, "-c", code], check=True, env=env)


def test_a_failed_build_warns_once_and_keeps_the_torch_ops(monkeypatch, caplog):
    def no_compiler():
        raise RuntimeError("Error building extension: c++: command not found")

    monkeypatch.setattr(cpu_ops, "_build", no_compiler)
    monkeypatch.delenv("SEMANTICACHE_CPU_KERNEL", raising=False)
    with caplog.at_level("WARNING"):
        assert cpu_ops.available.__wrapped__() is False
    assert "c++: command not found" in caplog.text and "pip install ninja" in caplog.text


def test_the_operators_build_the_kernels_at_their_first_call(monkeypatch):
    """cpu_ops.op (and decode_attention) ask for the library themselves: a script that calls one without
    calling available() first gets the C++ kernel, not the torch twin without a word."""
    calls = []
    monkeypatch.setattr(cpu_ops, "available", lambda: calls.append("available") or False)
    q, kv = torch.randn(2, 3, 16), torch.randn(2, 5, 16)
    cpu_ops.decode_attention(q, kv, None, None, 32, kv, None, None, 32, None, kv, kv)
    cpu_ops.op("rms_norm")
    assert calls == ["available", "available"]


def test_old_kernel_builds_are_removed_and_recent_ones_kept(tmp_path, monkeypatch):
    """Each source, torch or Python version builds its own library (~5 MiB): builds beyond the most recently
    used KEEP_BUILDS that have not been used in KEEP_DAYS days go; the one just loaded, recent ones and
    folders not named as builds stay."""
    now = time.time()
    day = 86400

    def build(name: str, age_days: float, stamped: bool = True) -> Path:
        folder = tmp_path / f"semanticache_cpu_ops_{name:0>16}"
        folder.mkdir()
        (folder / "library.so").write_bytes(b"so")
        when = now - age_days * day
        os.utime(folder / "library.so", (when, when))
        if stamped:
            (folder / "last-used").touch()
            os.utime(folder / "last-used", (when, when))
        return folder

    monkeypatch.setattr(cpu_ops, "KEEP_BUILDS", 3)
    monkeypatch.setattr(cpu_ops, "KEEP_DAYS", 7)
    current = build("c0", 400)  # just loaded: kept whatever its stamp says
    recent = [build(f"a{i}", i) for i in range(1, 4)]  # within 7 days: kept though beyond KEEP_BUILDS
    newest_old = build("b1", 30)  # fourth most recently used of the others: beyond KEEP_BUILDS with current
    old = [build("b2", 60), build("b3", 90, stamped=False)]  # no stamp: its newest file's time
    other = tmp_path / "ab"
    other.mkdir()
    odd = tmp_path / "semanticache_cpu_ops_not-a-hash"
    odd.mkdir()
    removed = cpu_ops._prune_builds(tmp_path, keep=current.name)
    assert sorted(removed) == sorted([newest_old, *old])
    assert all(p.exists() for p in (current, *recent, other, odd))
    # with KEEP_BUILDS of 6, the three old ones are among the most recently used and stay
    build("b4", 50)
    monkeypatch.setattr(cpu_ops, "KEEP_BUILDS", 6)
    assert cpu_ops._prune_builds(tmp_path, keep=current.name) == []


def test_the_benchmark_times_every_storage_it_is_given(kernel, tmp_path):
    """``python -m semanticache_rag.kernels.bench_cpu`` at a tiny size: one row per storage and length,
    with the bytes each storage occupies (codes are smaller than fp32) and positive times."""
    import json

    from semanticache_rag.kernels import bench_cpu

    out, table = tmp_path / "rows.json", tmp_path / "kernel.md"
    argv = ["--tokens", "64", "--layers", "2", "--repeats", "1", "--storage", "fp32", "int4", "--json", str(out)]
    assert bench_cpu.main([*argv, "--markdown", str(table)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [(r["storage"], r["tokens"]) for r in rows] == [("fp32", 64), ("int4", 64)]
    assert rows[1]["mbytes"] < rows[0]["mbytes"] / 4
    assert all(r["kernel_ms"] > 0 and r["twin_ms"] > 0 and r["arithmetic_ms"] >= 0 for r in rows)
    text = table.read_text()
    assert text.count("\n| int4 | 64 |") == 1 and "| floor + arithmetic ms | overlap |" in text


@pytest.mark.parametrize(
    "key_storage,dim,group,group_size",
    [  # integers where the CPU has VNNI: 8-bit or paired 4-bit keys, D a multiple of 64, groups of whole blocks
        ("int8", 64, 3, 32), ("int4", 64, 3, 32), ("int8", 128, 4, 64), ("int4", 128, 1, 32), ("int8", 64, 5, 32),
        # the rounded query in floats
        ("int3", 64, 3, 32), ("int8", 32, 3, 32), ("int8", 64, 3, 16), ("int4", 16, 2, 16),
    ],
)  # fmt: skip
def test_coded_keys_meet_the_query_rounded_to_q8_0(kernel, key_storage, dim, group, group_size):
    """``q8_query`` (weights="int4", llama.cpp's arithmetic): coded document keys are scored against the
    query rounded to Q8_0 (each channel within half its block's step of the query), in integers where the
    CPU has VNNI and in floats otherwise, as close to fp64 arithmetic on the rounded query as the twin is; the
    appended tokens meet the query as it is, and the result is not the exact one. (Values in 16 bits: coded ones
    are weighted in integers under q8_query, tested below.)"""
    args = inputs(3, group, dim, 300, 5, key_storage, "fp16", group_size=group_size)
    query = args[0]
    rounded = decode_attention_ref.rounded_query(query)
    blocks, rounded_blocks = query.unflatten(-1, (-1, min(dim, 32))), rounded.unflatten(-1, (-1, min(dim, 32)))
    step = blocks.abs().amax(-1, keepdim=True) / 127
    assert bool(((rounded_blocks - blocks).abs() <= step / 2 * (1 + 1e-5)).all()) and not torch.equal(rounded, query)
    want = fp64_reference(args, doc_query=rounded)
    twin = decode_attention_ref.decode_attention(*args, q8_query=True)
    got = kernel(*args, True)
    twin_error = float((twin.double() - want).abs().max())
    error = float((got.double() - want).abs().max())
    assert error <= 2 * twin_error + 1e-7, (error, twin_error)
    assert float((got - kernel(*args)).abs().max()) > 1e-4  # the rounding shows


@pytest.mark.parametrize(
    "value_storage,dim,group,group_size,length",
    [  # 8-bit or paired 4-bit codes, D a multiple of 64; groups of 1, 2 or 4 vectors; odd passes; 1-5 query heads
        ("int8", 64, 3, 32, 301), ("int4", 64, 3, 32, 301), ("int8", 64, 5, 16, 300), ("int8", 128, 4, 64, 513),
        ("int4", 128, 1, 128, 77), ("int4", 64, 2, 64, 4500),
    ],
)  # fmt: skip
def test_q8_weighs_coded_values_in_integers(kernel, value_storage, dim, group, group_size, length):
    """Under ``q8_query`` coded values are weighted in integers where the CPU has AVX-512 VNNI and VBMI
    (``kernels/attention_values_int.h``): per pass, query head and group, weight * scale rounded to 15 bits against
    the pass's largest. Each pass's error is at most its 64 rows * half a step (2^-16 of its largest weight * scale)
    * the largest code, and the passes' largest weights sum to at most the total weight, so the result is within
    2^-10 of the largest group's range (scale * largest code) of the fp64 attention, beyond the twin's rounding."""
    args = inputs(3, group, dim, length, 5, "fp16", value_storage, group_size=group_size)
    want = fp64_reference(args)
    twin_error = float((decode_attention_ref.decode_attention(*args).double() - want).abs().max())
    got = kernel(*args, True)
    bits = int(value_storage[3:])
    value_range = float(args[6].float().max()) * (2**bits - 1)
    error = float((got.double() - want).abs().max())
    assert error <= 2**-10 * value_range + 2 * twin_error + 1e-7, (error, value_range, twin_error)
    # The roundings of independent weights mostly cancel: 2^-16 to 2^-19 of the range on these inputs (the bound
    # above is the worst case).
    assert error <= 2**-14 * value_range, (error, value_range)
    if {"avx512_vnni", "avx512vbmi"} <= set(cpu_ops._cpu_identity().split()):  # the flags the library is built for
        assert not torch.equal(got, kernel(*args))  # the integer path, not the float one (16-bit keys: no rounding)
    else:
        assert torch.equal(got, kernel(*args))


def test_q8_query_leaves_16_bit_and_fp32_keys_alone(kernel):
    """Only coded keys meet the rounded query: 16-bit and fp32 document keys give the exact result bit for bit
    (16-bit values: coded ones are weighted in integers, above)."""
    for storage in ("fp16", "fp32"):
        args = inputs(3, 3, 64, 200, 5, storage, "fp16")
        assert torch.equal(kernel(*args, True), kernel(*args)), storage


def test_the_librarys_key_holds_every_header_the_sources_include():
    """The compiled library is found again by a hash of its sources and headers: a header left out of
    the key would let an edit to it load the stale library. The includes are followed as the A/B tool
    follows them (ab_cpu.with_headers)."""
    from semanticache_rag.kernels import ab_cpu

    folder = Path(cpu_ops.__file__).parent
    included: set[str] = set()
    for source in cpu_ops.SOURCES:
        included |= ab_cpu.with_headers(source.read_text(), lambda name: (folder / name).read_text()).keys()
    included.discard("kernel.cpp")
    assert "attention_q8.h" in included
    assert included <= {header.name for header in cpu_ops.HEADERS}


def test_the_ab_tool_builds_a_kernel_under_its_own_namespace(kernel):
    """``python -m semanticache_rag.kernels.ab_cpu``'s builds: the kernel's source under another operator
    namespace computes what the library's kernel computes, to rounding, with the headers it includes (and
    they include) beside it; the base source comes from git."""
    from semanticache_rag.kernels import ab_cpu

    files = ab_cpu.work_files()
    assert {"kernel.cpp", "cpu_ops.h", "cpu_vectors.h", "attention_rows.h", "attention_sums.h"} <= files.keys()
    # Unoptimised (a fifth of -O3's compile time): the test is of the build, not of the compiler's work.
    # Without -O2 the compiler fuses no multiply-add of its own, so the outputs agree to rounding, not bits.
    quick = tuple("-O0" if flag == "-O3" else flag for flag in cpu_ops.FLAGS)
    library, op = ab_cpu.build("ab_test", files, flags=quick)
    for storages in (("int8", "int4"), ("fp16", "int8"), ("int4", "fp32")):
        args = inputs(3, 3, 64, 200, 5, *storages)
        torch.testing.assert_close(op(*args), kernel(*args), rtol=1e-5, atol=1e-6, msg=str(storages))
    assert library.ns == "ab_test"
    if (ab_cpu.SOURCE.parent.parent / ".git").exists():
        assert "TORCH_LIBRARY_IMPL(semanticache, CPU" in ab_cpu.base_files("HEAD")["kernel.cpp"]
        assert ab_cpu.base_schema("HEAD").startswith("decode_attention(Tensor query, ")
    assert ab_cpu.schema_of((ab_cpu.SOURCE.parent / "cpu_ops.py").read_text()) == cpu_ops.SCHEMAS["decode_attention"][0]
    with pytest.raises(SystemExit, match="no decode_attention schema"):
        ab_cpu.schema_of("SCHEMAS = {}")
    with pytest.raises(SystemExit, match="no-such-revision"):
        ab_cpu.base_files("no-such-revision")


def test_the_benchmarks_overlap_places_the_kernel_between_max_and_sum():
    """``overlap``: 1 where the kernel takes max(floor, arithmetic), 0 where it takes their sum, below 0 beyond."""
    from semanticache_rag.kernels.bench_cpu import Row

    def row(kernel_ms: float, arithmetic_ms: float = 4.0) -> Row:
        return Row("fp32", 64, 1.0, kernel_ms, 2 * kernel_ms, 1.0, 6.0, arithmetic_ms)

    assert [row(ms).overlap for ms in (6.0, 8.0, 10.0, 12.0)] == [1.0, 0.5, 0.0, -0.5]
    assert math.isnan(row(6.0, arithmetic_ms=0.0).overlap)  # no arithmetic measured: nothing to place


@pytest.mark.parametrize("compression", [("none", None), ("semanticache", 0.75), ("kaizen", 0.75)])
def test_the_model_weights_step_attends_through_the_kernel(
    kernel, tiny_llama, tiny_tokenizer, monkeypatch, compression
):
    """With the weights as loaded (transformers' forward), a one-token step attends each document layer
    through the kernel, stored as it is (Kaizen's codes too), and its logits are the torch ops' to fp32
    rounding; prompts of several tokens keep the torch ops."""
    from semanticache_rag import Engine, make_compressor, scripted_step
    from semanticache_rag.kv import ConversationKV

    engine = Engine(tiny_llama, tiny_tokenizer, model_name="tiny", prefill_chunk=64)
    prefill = engine.prefill("Alpha beta gamma delta. The code is 4417. " * 20, progress=False, surprisal=True)
    cache = engine.compress(prefill, make_compressor(*compression))
    calls = []
    real = scripted_step.kernel_attention
    monkeypatch.setattr(scripted_step, "kernel_attention", lambda *a: calls.append(a[2]) or real(*a))

    def steps(use_kernel: bool) -> list[torch.Tensor]:
        monkeypatch.setattr(cpu_ops, "available", lambda: use_kernel)
        kv = ConversationKV(cache.layers)
        ids = tiny_tokenizer("Which code?")["input_ids"]
        logits = [engine.forward(kv, ids, cache.positions)[-1]]
        for offset, token in enumerate([5, 17, 5]):
            logits.append(engine.forward(kv, [token], cache.positions + len(ids) + offset)[-1])
        return logits

    with_kernel = steps(True)
    inputs = scripted_step.step_inputs(ConversationKV(cache.layers))
    attended = sum("low_rank" not in kinds for kinds in zip(inputs[1], inputs[3]))  # low-rank sides: torch
    assert attended > 0 and len(calls) == 3 * attended  # the three one-token steps, not the prompt
    calls.clear()
    without = steps(False)
    assert not calls
    for a, b in zip(with_kernel, without):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-4)
        assert int(a.argmax()) == int(b.argmax())


def test_the_benchmark_refuses_what_the_kernel_cannot_time(monkeypatch, capsys):
    """A head dim the kernel is not built for is a usage error; a kernel that did not build times nothing."""
    from semanticache_rag.kernels import bench_cpu

    with pytest.raises(SystemExit) as refused:
        bench_cpu.main(["--dim", "48", "--tokens", "16", "--layers", "1"])
    assert refused.value.code == 2 and "head dims" in capsys.readouterr().err
    monkeypatch.setattr(cpu_ops, "available", lambda: False)
    assert bench_cpu.main(["--tokens", "16", "--layers", "1"]) == 1
    assert "did not build" in capsys.readouterr().out


def _q4_1(out_features: int, in_features: int, seed: int):
    """Random Q4_1 codes in their layout (both ends of the range), fp16 scales and minimums."""
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 16, (out_features, in_features), generator=g)
    codes[0, :2] = torch.tensor([0, 15])
    scales = (torch.rand(out_features // 16, in_features // 32, 16, generator=g) / 10).half()
    minimums = (torch.randn(out_features // 16, in_features // 32, 16, generator=g) / 10).half()
    return codes, int4_weights_ref.q4_1_layout(codes), scales, minimums


@pytest.mark.parametrize("out_features, in_features", [(64, 96), (16, 32), (48, 1536)])
def test_q4_1_weights_decode_as_the_twin_bit_for_bit(kernel, out_features, in_features):
    """code * scale + minimum, one rounding; the layout gives the codes back."""
    codes, layout, scales, minimums = _q4_1(out_features, in_features, seed=in_features)
    assert torch.equal(int4_weights_ref.q4_1_codes(layout), codes.to(torch.uint8))
    got = cpu_ops.op("unpack_q4_1")(layout, scales, minimums)
    want = int4_weights_ref.unpack_q4_1(layout, scales, minimums)
    assert got.shape == (in_features, out_features) and torch.equal(got, want)
    weight = codes.float() * scales.float().transpose(1, 2).reshape(out_features, -1).repeat_interleave(32, 1)
    weight += minimums.float().transpose(1, 2).reshape(out_features, -1).repeat_interleave(32, 1)
    assert torch.equal(got.t(), weight)


@pytest.mark.parametrize("rows, out_features, in_features", [(1, 64, 96), (3, 16, 64), (5, 256, 1152)])
def test_q4_1_product_is_its_twins_integer_sums(kernel, rows, out_features, in_features):
    """Rows quantised to Q8_0 (a zero group, ties), integer sums scaled: the twin to fp32 rounding, and
    within what quantising the rows costs of the decoded weights' product."""
    _, layout, scales, minimums = _q4_1(out_features, in_features, seed=rows)
    g = torch.Generator().manual_seed(in_features)
    x = torch.randn(rows, in_features, generator=g)
    x[0, :32] = 0
    x[-1, 32:64] = torch.arange(32) / 2 - 8
    got = cpu_ops.op("q4_1_product")(x, layout, scales, minimums)
    want = int4_weights_ref.q4_1_product(x, layout, scales, minimums)
    assert got.shape == (rows, out_features) and got.dtype == torch.float32
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6 * float(want.abs().max()))
    exact = x @ int4_weights_ref.unpack_q4_1(layout, scales, minimums)
    assert (got - exact).abs().max() <= 0.02 * exact.abs().max()
    torch.testing.assert_close(got[-1:], cpu_ops.op("q4_1_product")(x[-1:], layout, scales, minimums), rtol=0, atol=0)


@pytest.mark.parametrize("rows, out_features, in_features", [(1, 64, 96), (3, 16, 64), (7, 256, 1152)])
def test_q4_1_product_fp32_is_the_decoded_weights_product(kernel, rows, out_features, in_features):
    """fp32 rows times the Q4_1 codes, in fp32 (int4-exact): its twin's and the decoded weights'
    product to fp32 rounding (only the order of the sums differs), each row as it would be alone."""
    _, layout, scales, minimums = _q4_1(out_features, in_features, seed=rows + 7)
    x = torch.randn(rows, in_features, generator=torch.Generator().manual_seed(in_features + 1))
    got = cpu_ops.op("q4_1_product_fp32")(x, layout, scales, minimums)
    assert got.shape == (rows, out_features) and got.dtype == torch.float32
    exact = (x.double() @ int4_weights_ref.unpack_q4_1(layout, scales, minimums).double()).float()
    tolerance = 1e-5 * float(exact.abs().max())
    torch.testing.assert_close(got, exact, rtol=0, atol=tolerance)
    torch.testing.assert_close(
        int4_weights_ref.q4_1_product_fp32(x, layout, scales, minimums), exact, rtol=0, atol=tolerance
    )
    alone = cpu_ops.op("q4_1_product_fp32")(x[-1:], layout, scales, minimums)
    torch.testing.assert_close(got[-1:], alone, rtol=0, atol=0)


@pytest.mark.parametrize("out_features, in_features", [(64, 96), (17, 33), (48, 1536)])
def test_int8_row_product_is_the_codes_product(kernel, out_features, in_features):
    """One fp32 row times int8 codes and their row scales (ragged lengths: the vector loop's tails)."""
    g = torch.Generator().manual_seed(in_features)
    codes = torch.randint(-127, 128, (out_features, in_features), generator=g, dtype=torch.int8)
    scales = torch.rand(out_features, generator=g).bfloat16()
    x = torch.randn(in_features, generator=g)
    got = cpu_ops.op("int8_row_product")(x, codes, scales)
    want = (codes.double() @ x.double()) * scales.double()
    assert got.shape == (out_features,) and got.dtype == torch.float32
    torch.testing.assert_close(got.double(), want, rtol=0, atol=1e-5 * float(want.abs().max()))
    for args, message in [((x, codes.int(), scales), "int8"), ((x, codes, scales[:-1]), "scales must be")]:
        with pytest.raises(RuntimeError, match=message):
            cpu_ops.op("int8_row_product")(*args)


def _q8_0(out_features: int, in_features: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Random Q8_0 codes (both ends of the range) and their layout: code + 128, (out / 16, in / 4, 16, 4)."""
    codes = torch.randint(-127, 128, (out_features, in_features), generator=g, dtype=torch.int32)
    codes[0, :2] = torch.tensor([-127, 127])
    return codes, (codes + 128).to(torch.uint8).view(-1, 16, in_features // 4, 4).transpose(1, 2).contiguous()


@pytest.mark.parametrize("rows, out_features, in_features", [(1, 64, 96), (3, 16, 64), (2, 256, 1152)])
def test_q8_0_product_is_its_twins_integer_sums(kernel, rows, out_features, in_features):
    """Any codes (both ends of the range), bf16 scales, inputs with a zero group and ties: the twin's
    integer sums, scaled, to fp32 rounding; and within what quantising the inputs costs of the exact product."""
    g = torch.Generator().manual_seed(in_features)
    codes, layout = _q8_0(out_features, in_features, g)
    scales = (torch.rand(out_features // 16, in_features // 32, 16, generator=g) / 100).bfloat16()
    x = torch.randn(rows, in_features, generator=g)
    x[0, :32] = 0  # a zero group: scale 0, codes 0
    x[-1, 32:64] = torch.arange(32) / 2 - 8  # halves: ties to even
    got = cpu_ops.op("q8_0_product")(x, layout, scales)
    want = int4_weights_ref.q8_0_product(x, layout, scales)
    assert got.shape == (rows, out_features) and got.dtype == torch.float32
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6 * float(want.abs().max()))
    weight = codes.float() * scales.float().transpose(1, 2).reshape(out_features, -1).repeat_interleave(32, 1)
    exact = x @ weight.T
    assert (got - exact).abs().max() <= 0.02 * exact.abs().max()


@pytest.mark.parametrize("rows, out_features, in_features", [(1, 64, 96), (3, 16, 64), (2, 256, 1152)])
def test_q8_0_product_fp32_is_the_decoded_weights_product(kernel, rows, out_features, in_features):
    """fp32 rows times Q8_0 codes with fp32 scales, in fp32 (int4-exact's head): its twin's and the decoded
    weights' product to fp32 rounding (only the order of the sums differs), each row as it would be alone."""
    g = torch.Generator().manual_seed(in_features + 2)
    codes, layout = _q8_0(out_features, in_features, g)
    scales = torch.rand(out_features // 16, in_features // 32, 16, generator=g) / 100
    x = torch.randn(rows, in_features, generator=g)
    got = cpu_ops.op("q8_0_product_fp32")(x, layout, scales)
    assert got.shape == (rows, out_features) and got.dtype == torch.float32
    weight = codes.double() * scales.double().transpose(1, 2).reshape(out_features, -1).repeat_interleave(32, 1)
    exact = (x.double() @ weight.T).float()
    tolerance = 1e-5 * float(exact.abs().max())
    torch.testing.assert_close(got, exact, rtol=0, atol=tolerance)
    torch.testing.assert_close(int4_weights_ref.q8_0_product_fp32(x, layout, scales), exact, rtol=0, atol=tolerance)
    torch.testing.assert_close(got[-1:], cpu_ops.op("q8_0_product_fp32")(x[-1:], layout, scales), rtol=0, atol=0)
    with pytest.raises(RuntimeError, match="scales must be contiguous float32"):  # bf16 scales are q8_0_product's
        cpu_ops.op("q8_0_product_fp32")(x, layout, scales.bfloat16())
    with pytest.raises(RuntimeError, match="codes must be contiguous uint8"):
        cpu_ops.op("q8_0_product_fp32")(x, torch.tensor(0, dtype=torch.uint8), scales)


def test_q8_0_product_refuses_bad_inputs(kernel):
    codes, scales, x = (
        torch.zeros(4, 24, 16, 4, dtype=torch.uint8),
        torch.zeros(4, 3, 16).bfloat16(),
        torch.zeros(1, 96),
    )
    for args, message in [
        ((x, codes.int(), scales), "uint8"),
        ((x, torch.tensor(0, dtype=torch.uint8), scales), "codes must be contiguous uint8"),  # no sizes at all
        ((x, torch.zeros(4, 23, 16, 4, dtype=torch.uint8), scales), "multiple of 32"),
        ((x[:, :64], codes, scales), "rows of 96"),
        ((x.double(), codes, scales), "float32"),
        ((x, codes, scales.float()), "bf16"),
        ((x, codes, scales[:, :2]), "in / 32"),
    ]:
        with pytest.raises(RuntimeError, match=message):
            cpu_ops.op("q8_0_product")(*args)


@pytest.mark.parametrize("shape", [(1, 576), (3, 2, 96), (130, 64)])
def test_rms_norm_is_torchs_to_fp32_rounding(kernel, shape):
    """One row (decoding) or many (split across threads), any scale; bf16 rows go to torch's own."""
    g = torch.Generator().manual_seed(shape[-1])
    x = torch.randn(*shape, generator=g) * 5
    weight = torch.randn(shape[-1], generator=g)
    got = cpu_ops.op("rms_norm")(x, weight, 1e-6)
    want = torch.nn.functional.rms_norm(x, shape[-1:], weight, 1e-6)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    half = x.bfloat16()
    assert torch.equal(
        cpu_ops.op("rms_norm")(half, weight.bfloat16(), 1e-6),
        torch.nn.functional.rms_norm(half, shape[-1:], weight.bfloat16(), 1e-6),
    )
    with pytest.raises(RuntimeError, match="one value per feature"):
        cpu_ops.op("rms_norm")(x, weight[:-1], 1e-6)


def test_q4_1_kernels_refuse_bad_inputs(kernel):
    layout, halves, x = torch.zeros(4, 12, 16, 4, dtype=torch.uint8), torch.zeros(4, 3, 16).half(), torch.zeros(2, 96)
    for args, message in [
        ((x, layout.int(), halves, halves), "uint8"),
        ((x, torch.zeros(4, 11, 16, 4, dtype=torch.uint8), halves, halves), "multiple of 32"),
        ((x, layout, halves.float(), halves), "fp16"),
        ((x, layout, halves, halves[:, :2]), "in / 32"),
        ((x[:, :64], layout, halves, halves), "rows of 96"),
        ((x.double(), layout, halves, halves), "float32"),
    ]:
        with pytest.raises(RuntimeError, match=message):
            cpu_ops.op("q4_1_product")(*args)
    with pytest.raises(RuntimeError, match="fp16"):
        cpu_ops.op("unpack_q4_1")(layout, halves.bfloat16(), halves)


def clustering_inputs(heads, chunks, width, thresholds, seed):
    """A chunked similarity grid of random keys (ragged chunks, one of full width), ~10% protected tokens."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, width + 1, (chunks,), generator=g)
    lengths[0] = width
    layout = gsc_ref.ChunkLayout.from_chunk_ids(torch.repeat_interleave(torch.arange(chunks), lengths))
    similarity = gsc_ref.chunk_similarity(torch.randn(heads, int(lengths.sum()), 8, generator=g), layout)
    free = (torch.rand(chunks, width, generator=g) > 0.1) & (torch.arange(width)[None] < lengths[:, None])
    return similarity, lengths, free, torch.rand(thresholds, heads, generator=g) * 1.2 - 0.4


@pytest.mark.parametrize(
    "heads, chunks, width, thresholds", [(3, 20, 7, 1), (4, 30, 31, 4), (2, 9, 51, 3), (1, 3, 90, 2)]
)
def test_clustering_finds_the_twins_clusters(kernel, heads, chunks, width, thresholds):
    """Seed slots and cluster counts equal the torch loop's, for one-word (<= 31), two-word and unmasked
    (> 64 tokens) chunks, at thresholds from -0.4 (most merge) to 0.8."""
    args = clustering_inputs(heads, chunks, width, thresholds, seed=width)
    slots, counts = cpu_ops.op("greedy_seeds")(*args)
    want_slots, want_counts = gsc_ref.greedy_seeds(*args)
    assert slots.dtype == torch.int16 and slots.shape == (thresholds, heads, chunks, width)
    assert torch.equal(slots, want_slots) and torch.equal(counts, want_counts)
    assert int(counts.min()) < int(args[2].sum())  # something merged


def test_clustering_refuses_bad_inputs(kernel):
    similarity, lengths, free, tau = clustering_inputs(2, 5, 8, 2, seed=1)
    for args, message in [
        ((similarity.double(), lengths, free, tau), "float32"),
        ((similarity, lengths.int(), free, tau), "chunk_lengths"),
        ((similarity, lengths, free[:, :4], tau), "free must be"),
        ((similarity, lengths, free, tau[:, :1]), "tau must be"),
        ((similarity, lengths + 8, free, tau), "has length"),
    ]:
        with pytest.raises(RuntimeError, match=message):
            cpu_ops.op("greedy_seeds")(*args)
