"""llama.cpp's own ``llama-bench``, built once from the source that ``llama-cpp-python``'s sdist vendors.

llama.cpp is what people run a model on a CPU with (directly, or under Ollama / LM Studio);
``llama-bench`` is its benchmark of prompt processing and token generation. It is built in a
directory of its own under :func:`~semanticache_rag.models.home_dir` (``llama-bench/``): the sdist
is fetched with ``pip download`` (PyPI is reachable where model hubs are not), unpacked, and
``cmake`` builds the one target; a marker records the version and how long the build took, so a
half-finished build is redone.

    python -m benchmarks.llama_bench           # build (minutes, once) and print the binary's path
"""

from __future__ import annotations

import json
import logging
import shutil
import subprocess
import sys
import tarfile
import time
from pathlib import Path

from semanticache_rag.models import home_dir

logger = logging.getLogger(__name__)

VERSION = "0.3.36"  # the llama-cpp-python release benchmarks/serve.py runs too
MARKER = "build.json"


def _run(command: list[str], cwd: Path) -> None:
    proc = subprocess.run(command, cwd=cwd, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        tail = "\n".join((proc.stdout + proc.stderr).splitlines()[-40:])
        raise RuntimeError(f"{' '.join(command)} failed (exit {proc.returncode}):\n{tail}")


def build_record(root: Path | None = None) -> dict | None:
    """The finished build's record (``binary``, ``version``, ``build_s``), or ``None``."""
    root = root or home_dir() / "llama-bench"
    try:
        record = json.loads((root / MARKER).read_text())
    except (OSError, ValueError):
        return None
    if record.get("version") != VERSION or not Path(record.get("binary", "")).is_file():
        return None
    return record


def ensure_llama_bench(root: Path | None = None) -> dict:
    """Build ``llama-bench`` once (CPU, native instructions); return its build record.

    Raises
    ------
    RuntimeError
        When the download or the build fails (the message holds the tail of the output), or when
        ``cmake`` is missing (``apt-get install cmake``).
    """
    root = root or home_dir() / "llama-bench"
    record = build_record(root)
    if record is not None:
        return record
    if shutil.which("cmake") is None:
        raise RuntimeError("building llama-bench needs cmake: apt-get install cmake (or pip install cmake)")
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    started = time.perf_counter()
    logger.info("downloading llama-cpp-python %s's source", VERSION)
    _run(
        [
            sys.executable,
            "-m",
            "pip",
            "download",
            "--no-deps",
            "--no-binary",  # this package's source; its build tools come as wheels (":all:" builds them
            "llama-cpp-python",  # from source too, a chain of builds that takes longer than llama.cpp's own)
            "--disable-pip-version-check",
            f"llama-cpp-python=={VERSION}",
            "-d",
            str(root),
        ],
        root,
    )
    sdist = next(root.glob("llama_cpp_python-*.tar.gz"))
    with tarfile.open(sdist) as archive:
        archive.extractall(root, filter="data")
    source = next(root.glob("llama_cpp_python-*/vendor/llama.cpp"))
    build = root / "build"
    logger.info("building llama-bench from %s (about 10 minutes on 2 cores)", source)
    _run(
        [
            "cmake",
            "-S",
            str(source),
            "-B",
            str(build),
            "-DCMAKE_BUILD_TYPE=Release",
            "-DGGML_NATIVE=ON",
            "-DLLAMA_CURL=OFF",
            "-DLLAMA_BUILD_TESTS=OFF",
            "-DLLAMA_BUILD_SERVER=OFF",
        ],
        root,
    )
    _run(["cmake", "--build", str(build), "--target", "llama-bench", "-j", "2"], root)
    binary = build / "bin" / "llama-bench"
    if not binary.is_file():
        raise RuntimeError(f"the build finished without {binary}")
    record = {"version": VERSION, "binary": str(binary), "build_s": round(time.perf_counter() - started, 1)}
    (root / MARKER).write_text(json.dumps(record))
    return record


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    print(json.dumps(ensure_llama_bench()))
