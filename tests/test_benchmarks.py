"""Benchmark harness: scoring, task building and a --quick smoke run on the tiny model."""

from __future__ import annotations

import copy
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from tests_support import needs_cpu_kernels

from benchmarks.ruler_tasks import build, score
from semanticache_rag import Engine
from semanticache_rag.models import home_dir
from semanticache_rag.weights import convert_weights


def test_ruler_string_match():
    assert score("The numbers are 123 and 456.", ["123", "456"], "all") == 1.0
    assert score("Only 123.", ["123", "456"], "all") == 0.5
    assert score("It was the european court of justice", ["The European Court of Justice", "ECJ"], "part") == 1.0
    assert score("No idea", ["ECJ"], "part") == 0.0


@pytest.fixture(scope="module")
def count_words():
    return lambda text: len(text.split())


def test_tasks_are_reproducible_and_hold_their_needles(count_words):
    tasks = ["niah_single_2", "niah_single_3", "niah_facts", "niah_multikey_1", "qa_1"]
    first = build(tasks, [600], 1, count_words, seed=3)
    again = build(tasks, [600], 1, count_words, seed=3)
    assert [c.document for c in first] == [c.document for c in again]
    for context in first:
        assert context.questions
        assert count_words(context.document) <= 700
        for q in context.questions:
            if q.metric == "all":
                assert all(ref in context.document for ref in q.refs)
            else:
                assert any(ref in context.document for ref in q.refs)
    kinds = [[q.kind for q in c.questions] for c in first]
    # a short QA context holds one pair
    assert kinds == [["number"], ["uuid"], ["name", "city", "code"], ["number", "number"], ["answer"]]
    code = first[2].questions[2].refs[0]
    assert re.fullmatch(r"[A-Z]\d-[A-Z]+-\d{3}", code), code  # letters and digits, hyphenated


def test_bootstrap_interval_holds_the_mean_and_narrows_with_more_questions():
    from benchmarks.report import bootstrap_interval

    few, many = [1.0, 0.0] * 4, [1.0, 0.0] * 200
    (low, high), (low_many, high_many) = bootstrap_interval(few), bootstrap_interval(many)
    assert low < 0.5 < high and low < low_many < 0.5 < high_many < high
    assert bootstrap_interval([1.0] * 5) == (1.0, 1.0)
    with pytest.raises(ValueError, match="no scores"):
        bootstrap_interval([])


def test_reusing_rows_needs_a_run_to_add_to(tiny_model_dir, tmp_path, monkeypatch, capsys):
    from benchmarks import ruler

    argv = ["ruler", "--quick", "--model", str(tiny_model_dir), "--out", str(tmp_path), "--reuse-rows", "x.jsonl"]
    monkeypatch.setattr(sys, "argv", argv)
    with pytest.raises(SystemExit):
        ruler.main()
    assert "does not exist: run the benchmark first" in capsys.readouterr().err


def test_quick_run_writes_results(tiny_model_dir, tmp_path, monkeypatch):
    from benchmarks import ruler

    argv = [
        "ruler",
        "--quick",
        "--model",
        str(tiny_model_dir),
        "--tasks",
        "niah_single_1",
        "qa_1",
        "--out",
        str(tmp_path),
    ]
    monkeypatch.setattr(sys, "argv", argv)
    ruler.main()
    rows = [json.loads(line) for line in (tmp_path / "ruler.jsonl").read_text().splitlines()]
    assert {r["method"] for r in rows} == set(ruler.ALL_METHODS)  # every method ran
    assert all(0 <= r["score"] <= 1 and r["kl"] >= -1e-6 for r in rows)
    assert all(r["kl"] == 0 for r in rows if r["method"] == "full")
    assert all(r["kv_bytes"] < r["full_kv_bytes"] for r in rows if r["method"] != "full")
    report = (tmp_path / "ruler.md").read_text()
    assert "| semanticache | 0.50 |" in report and "95% CI" in report
    assert "By what the question asks for" in report and "| semanticache-no-anchors | 0.50 |" in report
    assert (tmp_path / "ruler.png").stat().st_size > 1000


def test_long_chat_runs_every_method_and_bounds_the_appended_cache(tiny_model_dir, tmp_path):
    from benchmarks import long_chat

    long_chat.main(
        ["--model", str(tiny_model_dir), "--turns", "8", "--chats", "1", "--budget", "24", "--window", "16"]
        + ["--document-tokens", "60", "--max-new-tokens", "6", "--probe-turns", "3", "8", "--out", str(tmp_path)]
    )
    rows = {r["method"]: r for r in map(json.loads, (tmp_path / "long_chat.jsonl").read_text().splitlines())}
    assert set(rows) == {"none", "kara", "window"}
    assert all(len(r["seconds"]) == 8 and set(r["recalled"]) == {"3", "8"} for r in rows.values())
    grown = rows["none"]["conversation_bytes"]
    assert grown == sorted(grown) and grown[-1] > 2 * grown[2]  # with no compression the chat only grows...
    for method in ("kara", "window"):  # ...and with a budget it stays under what 'none' ends with
        assert max(rows[method]["conversation_bytes"]) < grown[-1]
    assert "| kara |" in (tmp_path / "long_chat.md").read_text() and (tmp_path / "long_chat.png").stat().st_size


def test_kvpress_resume_reuses_only_finished_contexts(count_words, tmp_path):
    from benchmarks import ruler

    contexts = build(["niah_single_1", "niah_multikey_1"], [300], 1, count_words, seed=0)
    jobs = [("kvpress:none", 0.0)] + [(f"kvpress:{p}", 0.5) for p in ruler.KVPRESS_PRESSES]
    rows = [
        {"method": m, "ratio": r, "qid": q.qid, "context_id": c.context_id}
        for c in contexts
        for m, r in jobs
        for q in c.questions
    ]
    finished, cut = contexts[0], len(jobs) * len(contexts[0].questions)
    with open(tmp_path / "ruler_kvpress_raw.1.tmp", "w") as out:  # interrupted in the second context
        out.writelines(json.dumps(row) + "\n" for row in rows[: cut + 3])
    earlier = ruler._earlier_kvpress_rows(tmp_path, contexts, [0.5])
    assert {r["context_id"] for r in earlier} == {finished.context_id} and len(earlier) == cut
    assert ruler._earlier_kvpress_rows(tmp_path, contexts, [0.5, 0.75]) == []  # a ratio never run


def test_reused_rows_keep_only_this_runs_questions_and_the_shared_table_their_contexts(count_words, tmp_path):
    from benchmarks import ruler

    contexts = build(["niah_single_1", "qa_1"], [300], 2, count_words, seed=0)
    questions = [(c, q) for c in contexts for q in c.questions]
    ours = [{"method": "full", "ratio": 0.0, "context_id": c.context_id, "qid": q.qid} for c, q in questions]

    def kvpress(c, q, refs, ratio=0.5):
        return {"method": "kvpress:snapkv", "ratio": ratio, "context_id": c.context_id, "qid": q.qid, "refs": refs}

    ours_kvpress = kvpress(*questions[0], questions[0][1].refs, ratio=0.75)  # this run has snapkv at 0.75 only
    earlier = [kvpress(*questions[0], questions[0][1].refs), kvpress(*questions[1], ["another question"])]
    earlier += [{**ours[0], "refs": questions[0][1].refs}, ours_kvpress]  # cells this run has: not again
    earlier += [kvpress(contexts[0], questions[0][1], [])]
    earlier[-1]["qid"] = "unknown-q0"
    ours = ours + [ours_kvpress]
    (tmp_path / "earlier.jsonl").write_text("".join(json.dumps({**r, "answer": "1234567"}) + "\n" for r in earlier))
    reused = ruler.reused_rows(tmp_path / "earlier.jsonl", ours, contexts)
    assert [(r["method"], r["ratio"], r["qid"]) for r in reused] == [("kvpress:snapkv", 0.5, questions[0][1].qid)]
    assert reused[0]["kind"] == "number" and reused[0]["score"] in (0.0, 1.0)
    common = ruler._common_contexts(ours + reused)
    assert {r["context_id"] for r in common} == {questions[0][0].context_id}


def test_speed_tables_put_every_row_in_its_length_column():
    from benchmarks.speed import memory_table, table

    rows = [
        {"system": "llama.cpp", "cache": "flash attention off", "tokens": 2000, "decode_ms": 15.0},
        {"system": "llama.cpp", "cache": "flash attention on", "tokens": 2000, "decode_ms": 16.0},
        {"system": "llama.cpp", "cache": "flash attention off", "tokens": 2000, "read_tok_s": 240.0},
        {"system": "llama.cpp", "cache": "flash attention on", "tokens": 2000, "read_tok_s": 250.0},
        {"system": "llama.cpp", "tokens": 4000, "decode_ms": 20.0},  # a run before the setting was recorded
        {
            "system": "ours",
            "weights": "int4",
            "cache": "full",
            "tokens": 2000,
            "decode_ms": 22.0,
            "floor_ms": 6.0,
            "kl_to_fp32_full": 0.0001,
            "compress_share": 0.0,
            "read_tok_s": 380.0,
        },
        {
            "system": "ours",
            "weights": "int4",
            "cache": "SemantiCache 0.75",
            "tokens": 4000,
            "decode_ms": 19.0,
            "floor_ms": 4.6,
            "kl_to_fp32_full": 0.035,
            "compress_share": 0.12,
            "read_tok_s": 310.0,
        },
    ]
    text = table(rows, [2000, 4000])
    assert "| llama.cpp, Q4_1 GGUF, flash attention off | 15.0 |  |" in text
    assert "| llama.cpp, Q4_1 GGUF, flash attention on | 16.0 |  |" in text
    assert "| llama.cpp, Q4_1 GGUF |  | 20.0 |" in text
    assert "| read tok/s: llama.cpp, flash attention on | 250.0 |  | | |" in text
    assert "| ours, int4 weights, SemantiCache 0.75 |  | 19.0 (4.6) | 0.0350 | 12% |" in text
    assert "| read tok/s: ours, int4 weights | 380.0 |  | | |" in text
    memory = memory_table(
        [{"weights": "int4", "compression": "none", "ratio": None, "read_adds_mib": 330, "cache_mib": 311}]
    )
    assert "| int4 | none | 330 | 311 |" in memory


def test_speed_parts_table_and_plot_show_where_each_timed_cell_goes(tmp_path):
    """Cells whose steps ran in one C++ call carry their parts (ms): one table line each, with the floor and the
    weights' own floor; cells without parts are left out, and with none there is no table or plot."""
    from benchmarks.speed import parts_table, plot_parts

    parts = {"step": 7.0, "attention": 4.0, "products": 2.0, "head": 0.9, "other": 0.1, "python": 0.3}
    timed = {"system": "ours", "weights": "int4", "cache": "Kaizen 0.75", "tokens": 7000, "floor_ms": 3.8}
    rows = [
        {**timed, "parts_ms": parts, "weights_floor_ms": 2.1, "forward_ms": 7.9},
        {"system": "ours", "weights": "model", "cache": "full", "tokens": 7000, "floor_ms": 12.0},
        {"system": "llama.cpp", "tokens": 7000, "decode_ms": 28.0},
    ]
    text = parts_table(rows)
    assert text.splitlines()[2] == "| int4 | Kaizen 0.75 | 7000 | 7.3 | 4.0 | 2.0 | 0.9 | 0.1 | 0.3 | 3.8 | 2.1 | 7.9 |"
    assert len(text.splitlines()) == 3
    plot_parts(rows, tmp_path / "parts.png")
    assert (tmp_path / "parts.png").stat().st_size > 1000
    assert parts_table(rows[1:]) == ""
    plot_parts(rows[1:], tmp_path / "none.png")
    assert not (tmp_path / "none.png").exists()


def test_compression_share_table_has_every_compressor_ratio_and_length():
    from benchmarks.compression_share import COMPRESSORS, RATIOS, table

    rows = [
        {"compressor": c, "ratio": r, "tokens": n, "read_s": n / 300, "compress_s": r * n / 1000, "share": r / 10}
        for c in COMPRESSORS
        for r in RATIOS
        for n in (2000, 7000)
    ]
    text = table(rows, [2000, 7000])
    assert "| sekv | 0.9 | 1.80 s (9.0%) | 6.30 s (9.0%) |" in text
    assert text.count("\n") == 2 + len(COMPRESSORS) * len(RATIOS) and text.endswith("| read | | 6.7 s | 23.3 s |")


def test_llama_bench_without_cmake_says_how_to_get_it_and_keeps_a_finished_build(tmp_path, monkeypatch):
    from benchmarks import llama_bench

    monkeypatch.setattr(llama_bench.shutil, "which", lambda name: None)
    with pytest.raises(RuntimeError, match="needs cmake"):
        llama_bench.ensure_llama_bench(tmp_path / "none-yet")
    binary = tmp_path / "done" / "bin" / "llama-bench"
    binary.parent.mkdir(parents=True)
    binary.write_text("")
    record = {"version": llama_bench.VERSION, "binary": str(binary), "build_s": 1.0}
    (tmp_path / "done" / llama_bench.MARKER).write_text(json.dumps(record))
    assert llama_bench.ensure_llama_bench(tmp_path / "done") == record  # found, nothing rebuilt or removed
    assert binary.is_file()


def test_llama_bench_built_again_without_amx_where_its_amx_kernels_stop(tmp_path, monkeypatch):
    import signal

    from benchmarks import llama_bench

    binary = tmp_path / "build" / "bin" / "llama-bench"
    binary.parent.mkdir(parents=True)
    binary.write_text("")
    record = {"version": llama_bench.VERSION, "binary": str(binary), "source": "src", "build_s": 1.0}
    (tmp_path / llama_bench.MARKER).write_text(json.dumps(record))
    builds, runs = [], []

    def run(command, **kwargs):  # the binary stops with SIGILL until built with NO_AMX
        runs.append(command)
        return subprocess.CompletedProcess(command, 0 if builds else -signal.SIGILL, "[]", "")

    monkeypatch.setattr(llama_bench.subprocess, "run", run)
    monkeypatch.setattr(llama_bench, "_cpu_has_amx", lambda: True)
    monkeypatch.setattr(llama_bench, "_build", lambda source, build, flags="": builds.append((source, flags)))
    done = llama_bench.ensure_llama_bench(tmp_path, model=tmp_path / "model.gguf")
    assert builds == [(Path("src"), llama_bench.NO_AMX)] and done["amx"] == "off" and len(runs) == 2
    assert json.loads((tmp_path / llama_bench.MARKER).read_text()) == done  # kept: not tried again
    assert llama_bench.ensure_llama_bench(tmp_path, model=tmp_path / "model.gguf") == done and len(builds) == 1
    # a binary that still stops: said, not hidden
    monkeypatch.setattr(
        llama_bench.subprocess, "run", lambda command, **kw: subprocess.CompletedProcess(command, 132, "", "")
    )
    with pytest.raises(RuntimeError, match="stops .SIGILL or SIGSEGV. on .* even built without AMX"):
        llama_bench.ensure_llama_bench(tmp_path, model=tmp_path / "model.gguf")
    # other failures are reported with their output
    monkeypatch.setattr(
        llama_bench.subprocess, "run", lambda command, **kw: subprocess.CompletedProcess(command, 1, "", "bad model")
    )
    with pytest.raises(RuntimeError, match="bad model"):
        llama_bench.ensure_llama_bench(tmp_path, model=tmp_path / "model.gguf")


def test_a_venv_counts_as_built_only_for_the_same_steps_and_environment(tmp_path):
    from benchmarks import venvs

    home = tmp_path / "tool-venv"
    venvs.venv_python(home).parent.mkdir(parents=True)
    venvs.venv_python(home).write_text("")
    steps, env = [["tool==1.0"]], {"CMAKE_ARGS": "-DX=1"}
    assert not venvs.venv_built("tool-venv", steps, home=home, env=env)  # no marker: half built
    (home / venvs.MARKER).write_text(json.dumps({"steps": steps, "env": env}))
    assert venvs.venv_built("tool-venv", steps, home=home, env=env)
    assert not venvs.venv_built("tool-venv", steps, home=home)  # built with another environment
    assert not venvs.venv_built("tool-venv", [["tool==2.0"]], home=home, env=env)


def test_llama_cpp_python_compiled_again_without_amx_where_its_amx_kernels_stop(tmp_path, monkeypatch):
    """benchmarks/serve.py's llama.cpp: tried on the model; where ggml's AMX product stops it (SIGSEGV at
    ldtilecfg in the calling thread), a venv of its own compiled without AMX, pip's cache bypassed."""
    import signal

    from benchmarks import llama_bench

    built = []

    def ensure_venv(name, steps, env=None):
        built.append((name, steps, env))
        return tmp_path / name / "bin" / "python"

    def run(command, **kwargs):  # the venv compiled with AMX stops; the other answers
        return subprocess.CompletedProcess(command, -signal.SIGSEGV if "no-amx" not in command[0] else 0, "", "")

    monkeypatch.setattr(llama_bench, "ensure_venv", ensure_venv)
    monkeypatch.setattr(llama_bench.subprocess, "run", run)
    monkeypatch.setattr(llama_bench, "_cpu_has_amx", lambda: True)
    monkeypatch.setattr(llama_bench, "venv_built", lambda name, steps, env=None: False)  # none built yet
    python = llama_bench.ensure_llama_cpp_python(tmp_path / "model.gguf")
    assert python == tmp_path / "llama-cpp-venv-no-amx" / "bin" / "python"
    (name, steps, env), (again, again_steps, flags) = built
    assert (name, steps, env) == ("llama-cpp-venv", [llama_bench.SERVER], None)
    assert again == "llama-cpp-venv-no-amx" and again_steps == [["--no-cache-dir", *llama_bench.SERVER]]
    assert flags["CMAKE_ARGS"].count(llama_bench.NO_AMX) == 2  # C and C++
    built.clear()  # a venv that answers is used as it is
    monkeypatch.setattr(llama_bench.subprocess, "run", lambda command, **kw: subprocess.CompletedProcess(command, 0))
    python = llama_bench.ensure_llama_cpp_python(tmp_path / "model.gguf")
    assert python == tmp_path / "llama-cpp-venv" / "bin" / "python"
    assert [name for name, _, _ in built] == ["llama-cpp-venv"]
    monkeypatch.setattr(  # still stopping without AMX: said, not hidden
        llama_bench.subprocess, "run", lambda command, **kw: subprocess.CompletedProcess(command, -signal.SIGSEGV)
    )
    with pytest.raises(RuntimeError, match="even compiled without AMX"):
        llama_bench.ensure_llama_cpp_python(tmp_path / "model.gguf")
    monkeypatch.setattr(llama_bench, "_cpu_has_amx", lambda: False)  # no AMX: a crash is a crash, with its output
    monkeypatch.setattr(
        llama_bench.subprocess, "run", lambda c, **kw: subprocess.CompletedProcess(c, -signal.SIGSEGV, "", "core")
    )
    with pytest.raises(RuntimeError, match=r"exit -11\):\ncore"):
        llama_bench.ensure_llama_cpp_python(tmp_path / "model.gguf")
    built.clear()  # once built without AMX, that venv is used without trying the other
    monkeypatch.setattr(llama_bench, "venv_built", lambda name, steps, env=None: name == llama_bench.NO_AMX_VENV)
    assert (
        llama_bench.ensure_llama_cpp_python(tmp_path / "model.gguf")
        == tmp_path / "llama-cpp-venv-no-amx" / "bin" / "python"
    )
    assert [name for name, _, _ in built] == ["llama-cpp-venv-no-amx"]


def test_ruler_keeps_each_finished_context_and_resumes_from_it(tiny_model_dir, tmp_path):
    from benchmarks import ruler
    from semanticache_rag import Engine

    engine = Engine.from_pretrained(str(tiny_model_dir))
    count = lambda text: len(engine.tokenizer(text, add_special_tokens=False)["input_ids"])  # noqa: E731
    contexts = ruler.build(["niah_single_1"], [300], 1, count, 0)
    partial = tmp_path / "partial.tmp"
    rows = ruler.run_ours(engine, contexts, [0.5], ["full", "semanticache"], partial=partial)
    assert len(partial.read_text().splitlines()) == len(rows) > 0

    def fail(*args, **kwargs):
        raise AssertionError("a finished context was read again")

    engine.prefill = fail
    assert ruler.run_ours(engine, contexts, [0.5], ["full", "semanticache"], partial=partial) == rows
    with pytest.raises(AssertionError, match="read again"):  # other methods: that context is not finished
        ruler.run_ours(engine, contexts, [0.5], ["full", "sekv"], partial=partial)


@pytest.mark.skipif(
    not (home_dir() / "kvpress-venv" / "semanticache-venv.json").is_file(),
    reason="kvpress's venv is not built: python -c 'from benchmarks.kvpress_env import ensure_kvpress_env as e; e()'",
)
def test_kvpress_one_shared_prefill_answers_as_a_prefill_per_press(tiny_model_dir, tmp_path):
    from benchmarks.kvpress_env import run_kvpress
    from benchmarks.ruler import KVPRESS_PRESSES

    presses = ("none", *KVPRESS_PRESSES)
    generator = torch.Generator().manual_seed(0)
    tasks = tmp_path / "tasks.jsonl"
    with tasks.open("w") as handle:
        for index in range(2):
            prefix = torch.randint(10, 200, (160 + 40 * index,), generator=generator).tolist()
            questions = [
                {"qid": f"c{index}-q{q}", "tail_ids": torch.randint(10, 200, (6,), generator=generator).tolist()}
                for q in range(2)
            ]
            task = {"context_id": f"c{index}", "task": "t", "length": len(prefix), "prefix_ids": prefix}
            handle.write(json.dumps({**task, "questions": questions}) + "\n")
    runs = {
        prefill: run_kvpress(
            tasks, tiny_model_dir, presses, [0.5, 0.8], tmp_path / f"{prefill}.jsonl", 8, prefill=prefill
        )
        for prefill in ("shared", "each")
    }
    timing = ("prefill_compress_s", "decode_ms_per_token", "kl")
    shared, each = ([{k: v for k, v in r.items() if k not in timing} for r in rows] for rows in runs.values())
    assert len(shared) == 2 * 2 * (1 + 2 * len(KVPRESS_PRESSES))
    assert shared == each  # answers and cache sizes
    assert all(r["kv_bytes"] < r["full_kv_bytes"] for r in shared if r["method"] != "kvpress:none")
    assert [r["kl"] for r in runs["shared"]] == pytest.approx([r["kl"] for r in runs["each"]], abs=1e-5)
    assert any(r["kl"] > 1e-3 for r in runs["shared"])  # the presses changed the answers' distributions


def test_speed_decode_samples_the_bandwidth_between_steps_untimed(tiny_llama_engine, document_text):
    """The speed table's floors use the bandwidth measured among a cell's own steps: ``between`` runs after every
    BANDWIDTH_EVERY-th step, outside the step times, and leaves the decoded tokens as they are."""
    from benchmarks.speed import BANDWIDTH_EVERY, decode

    cache = tiny_llama_engine.read(document_text[:800], progress=False)
    steps = 2 * BANDWIDTH_EVERY + 3
    calls: list[int] = []
    ids, logprobs, times, parts = decode(
        tiny_llama_engine, cache, steps, None, between=lambda: calls.append(len(calls))
    )
    plain_ids, _, _, _ = decode(tiny_llama_engine, cache, steps, None)
    assert calls == [0, 1] and len(times) == steps == len(ids) == logprobs.shape[0]
    assert parts == {}  # weights as loaded: the steps do not run in one C++ call, nothing to split
    assert ids == plain_ids


@pytest.mark.parametrize("converted", [False, True])  # steps in Python, in one C++ call
def test_speed_greedy_runs_choose_the_tokens_of_the_logits_and_time_each_call(
    tiny_llama, tiny_tokenizer, document_text, converted
):
    """The decode column times greedy runs as answers run them (GREEDY_RUN steps a call, ``between`` before
    each, untimed): the tokens those of the step-by-step decode, its parts where the steps ran in C++."""
    from benchmarks.speed import decode, greedy_decode
    from semanticache_rag.conversation import GREEDY_RUN

    if converted:
        needs_cpu_kernels()
    model = convert_weights(copy.deepcopy(tiny_llama), "fp32") if converted else tiny_llama
    engine = Engine(model, tiny_tokenizer, model_name="tiny", prefill_chunk=64)
    cache = engine.read(document_text[:800], progress=False)
    steps, calls = 2 * GREEDY_RUN + 3, []
    ids, times, parts = greedy_decode(engine, cache, steps, between=lambda: calls.append(len(calls)))
    assert ids == decode(engine, cache, steps, None)[0] and calls == [0, 1, 2] and len(times) == steps
    assert len(set(times)) == 3  # a call's mean for each of its steps
    assert (parts["steps"] == steps) if converted else parts == {}
