"""The command line, driven in-process on the tiny model directory."""

from __future__ import annotations

import json

import pytest

from semanticache_rag.cli import main

JSON_KEYS = {
    "question",
    "answer",
    "prompt_tokens",
    "cached_tokens",
    "prefill_s",
    "decode_s",
    "tokens_per_s",
    "document_tokens",
    "cache_bytes",
}


@pytest.fixture()
def text_file(tmp_path, document_text):
    path = tmp_path / "doc.txt"
    path.write_text(document_text)
    return path


def test_ask_json_lines(tiny_model_dir, text_file, capsys):
    code = main(
        [
            "ask",
            str(text_file),
            "-q",
            "Who may copy it?",
            "-q",
            "Why?",
            "--model",
            str(tiny_model_dir),
            "--json",
            "--max-new-tokens",
            "5",
        ]
    )
    assert code == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [line["question"] for line in lines] == ["Who may copy it?", "Why?"]
    for line in lines:
        assert JSON_KEYS <= line.keys()
        assert line["cached_tokens"] == line["document_tokens"] > 0
        assert line["cache_bytes"] > 0


def test_ask_human_output(tiny_model_dir, text_file, capsys):
    assert main(["ask", str(text_file), "-q", "Who?", "--model", str(tiny_model_dir), "--max-new-tokens", "3"]) == 0
    out = capsys.readouterr().out
    assert "Q: Who?" in out and "reused from the document cache" in out


@pytest.mark.parametrize(
    "argv,message",
    [
        (["ask", "missing.pdf", "-q", "?"], "no such file"),
        (["ask", "{doc}", "-q", "?", "--model", "/nonexistent/model"], "Cannot load model"),
        (["ask", "{doc}", "-q", "?", "--compression", "zip"], "unknown compression"),
    ],
)
def test_errors_are_one_line_without_traceback(argv, message, text_file, tiny_model_dir, capsys):
    argv = [a.replace("{doc}", str(text_file)) for a in argv]
    if "--model" not in argv:
        argv += ["--model", str(tiny_model_dir)]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_chat_reads_until_end_of_input(tiny_model_dir, text_file, capsys, monkeypatch):
    lines = iter(["What is it?", "", "And then?"])

    def fake_input(prompt=""):
        try:
            return next(lines)
        except StopIteration:
            raise EOFError from None

    monkeypatch.setattr("builtins.input", fake_input)
    assert main(["chat", str(text_file), "--model", str(tiny_model_dir), "--max-new-tokens", "3"]) == 0
    err = capsys.readouterr().err
    assert err.count("tokens reused") == 2


def test_the_demo_reads_compressed_by_default_and_other_commands_do_not(monkeypatch):
    from semanticache_rag import cli

    chosen = []
    monkeypatch.setattr(cli, "_engine", lambda args: chosen.append((args.compression, args.ratio)) or 1 / 0)
    for argv in (["demo"], ["demo", "--compression", "none"], ["demo", "--ratio", "0.5"]):
        args = cli.build_parser().parse_args(argv)
        with pytest.raises(ZeroDivisionError):  # stopped where the engine would load
            args.func(args)
    assert chosen == [cli.DEMO_COMPRESSION, ("none", None), ("kaizen", 0.5)] and cli.DEMO_COMPRESSION == (
        "kaizen",
        0.75,
    )


def test_a_ratio_alone_picks_the_best_measured_compressor(monkeypatch):
    from semanticache_rag import KaizenCompressor, NoCompression, SemantiCacheCompressor, cli
    from semanticache_rag.engine import Engine

    built = []
    monkeypatch.setattr(
        Engine, "from_pretrained", classmethod(lambda cls, *a, compressor, **k: built.append(compressor))
    )
    for argv in (["--ratio", "0.9"], [], ["--compression", "semanticache", "--ratio", "0.9"]):
        cli._engine(cli.build_parser().parse_args(["ask", "doc.pdf", "-q", "Why?", "--no-store", "--json", *argv]))
    auto, plain, named = built
    assert isinstance(auto, KaizenCompressor) and isinstance(auto.inner, SemantiCacheCompressor)
    assert auto.compression_ratio == 0.9 and isinstance(plain, NoCompression)
    assert isinstance(named, SemantiCacheCompressor)


def test_the_demo_decodes_with_int4_weights_and_other_commands_with_auto_weights(monkeypatch, capsys):
    from semanticache_rag import cli
    from semanticache_rag.engine import Engine

    loaded = []
    monkeypatch.setattr(
        Engine, "from_pretrained", classmethod(lambda cls, *a, weights, **k: loaded.append(weights) or 1 / 0)
    )
    for argv in (
        ["demo"],
        ["demo", "--weights", "model"],
        ["ask", "x.pdf", "-q", "?"],
        ["ask", "x.pdf", "-q", "?", "--weights", "bf16"],
    ):
        args = cli.build_parser().parse_args(argv)
        with pytest.raises(ZeroDivisionError):  # stopped where the engine would load
            cli._engine(args)
    assert loaded == ["int4", "model", "auto", "bf16"]
    monkeypatch.undo()  # an unknown format is refused before any model loads
    assert cli.main(["ask", "x.pdf", "-q", "?", "--weights", "int3", "--no-store"]) != 0
    assert "weights must be one of" in capsys.readouterr().err


def test_vllm_serve_writes_vllms_command_with_the_connector(tmp_path, capsys):
    import shlex

    python = tmp_path / "venv" / "bin" / "python"
    python.parent.mkdir(parents=True)
    python.write_text("#!/bin/sh\n")
    python.chmod(0o755)
    argv = ["vllm-serve", "org/model", "--store", str(tmp_path / "caches"), "--vllm-python", str(python), "--dry-run"]
    assert main([*argv, "--", "--port", "8001", "--store", "x"]) == 0  # after "--": vLLM's, even our option names
    command = shlex.split(capsys.readouterr().out)
    assert command[:5] == [str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", "org/model"]
    config = json.loads(command[command.index("--kv-transfer-config") + 1])
    assert config["kv_connector_module_path"] == "semanticache_rag.integrations.vllm_connector"
    assert config["kv_connector_extra_config"] == {"store": str((tmp_path / "caches").resolve())}
    assert command[-4:] == ["--port", "8001", "--store", "x"]
    assert main(["vllm-serve", "org/model", "--vllm-python", str(tmp_path / "nothing"), "--dry-run"]) == 2
    assert "no Python interpreter" in capsys.readouterr().err


def test_package_and_help_import_no_model_stack_and_every_public_name_resolves():
    """``import semanticache_rag`` and ``--help`` stay fast: torch and transformers load on first use."""
    import subprocess
    import sys

    code = (
        "import sys, semanticache_rag\n"
        "from semanticache_rag.cli import main\n"
        "try:\n    main(['--help'])\nexcept SystemExit:\n    pass\n"
        "print(sorted(m for m in ('torch', 'transformers', 'pypdf') if m in sys.modules))\n"
        "names = [getattr(semanticache_rag, name) for name in semanticache_rag.__all__]\n"
        "print('torch' in sys.modules, semanticache_rag.Engine.__module__)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.splitlines()
    assert out[-2:] == ["[]", "True semanticache_rag.engine"], out
    import semanticache_rag

    with pytest.raises(AttributeError, match="no attribute 'Engin'"):
        semanticache_rag.Engin  # noqa: B018


def test_a_file_without_a_document_suffix_is_read_from_disk(tiny_model_dir, document_text, tmp_path, capsys):
    """``ask notes`` reads the file ``notes``; it is never taken as the five-character document text "notes"."""
    path = tmp_path / "notes"
    path.write_text(document_text)
    args = ["ask", str(path), "-q", "Who?", "--model", str(tiny_model_dir), "--json", "--max-new-tokens", "2"]
    assert main(args) == 0
    line = json.loads(capsys.readouterr().out)
    assert line["document_tokens"] > 20


@pytest.mark.parametrize("command", ["ask", "chat"])
@pytest.mark.parametrize("bad", ["missing.pdf", "{dir}", "{empty}"])
def test_a_bad_file_is_reported_before_the_model_loads(command, bad, tmp_path, monkeypatch, capsys):
    from semanticache_rag.engine import Engine

    def no_model(*args, **kwargs):
        raise AssertionError("the model was loaded before the file was checked")

    monkeypatch.setattr(Engine, "from_pretrained", no_model)
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    path = bad.format(dir=tmp_path, empty=empty)
    argv = [command, path] + (["-q", "?"] if command == "ask" else [])
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and ("no such file" in err or "directory" in err or "is empty" in err), err
