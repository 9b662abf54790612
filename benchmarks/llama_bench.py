"""llama.cpp's own ``llama-bench``, built once from the source that ``llama-cpp-python``'s sdist vendors.

llama.cpp is what people run a model on a CPU with (directly, or under Ollama / LM Studio);
``llama-bench`` is its benchmark of prompt processing and token generation. It is built in a
directory of its own under :func:`~semanticache_rag.models.home_dir` (``llama-bench/``): the sdist
is fetched with ``pip download`` (PyPI is reachable where model hubs are not), unpacked, and
``cmake`` builds the one target; a marker records the version and how long the build took, so a
half-finished build is redone. Given the model, the build is tried on it first: where ggml's AMX kernels
stop with an illegal instruction (seen on an Intel Xeon with AMX in a virtual machine: SIGILL at
``tileloadd`` in a worker thread, though a plain AMX program ran there), it is built again without AMX
(``-mno-amx-*``), and the record says so. :func:`ensure_llama_cpp_python` does the same for the
``llama-cpp-python`` server that ``benchmarks/serve.py`` runs (a venv of its own; without AMX in another).

    python -m benchmarks.llama_bench           # build (minutes, once), try it on the default model, print its record
"""

from __future__ import annotations

import json
import logging
import shutil
import signal
import subprocess
import sys
import tarfile
import time
from pathlib import Path

from benchmarks.venvs import ensure_venv, venv_built
from semanticache_rag.models import home_dir

logger = logging.getLogger(__name__)

VERSION = "0.3.36"  # the llama-cpp-python release benchmarks/serve.py runs too
MARKER = "build.json"
SERVER = [f"llama-cpp-python[server]=={VERSION}"]
# how ggml's AMX kernels stop a process where they cannot run (an Intel Xeon with AMX in a virtual machine):
# SIGILL at tileloadd in a worker thread (llama-bench), SIGSEGV at ldtilecfg in the calling one (llama-cpp-python)
AMX_STOPS = (signal.SIGILL, signal.SIGSEGV)


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


NO_AMX = "-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"  # explicit, so -march=native does not turn them back on
NO_AMX_VENV = "llama-cpp-venv-no-amx"
NO_AMX_STEPS = [["--no-cache-dir", *SERVER]]  # --no-cache-dir: pip's cache would give back the wheel built with AMX
NO_AMX_ENV = {"CMAKE_ARGS": f"-DCMAKE_C_FLAGS='{NO_AMX}' -DCMAKE_CXX_FLAGS='{NO_AMX}'"}


def ensure_llama_bench(root: Path | None = None, model: Path | None = None) -> dict:
    """Build ``llama-bench`` once (CPU, native instructions); return its build record.

    ``model``: a GGUF to try the binary on (a 32-token prompt); where it stops as ggml's AMX kernels stop a
    process (:data:`AMX_STOPS`, on a CPU with AMX), it is built again without AMX (``"amx": "off"`` in the
    record, ``amx_s`` the second build's seconds).

    Raises
    ------
    RuntimeError
        When the download or the build fails (the message holds the tail of the output), when
        ``cmake`` is missing (``apt-get install cmake``), or when the binary fails on ``model``.
    """
    root = root or home_dir() / "llama-bench"
    record = build_record(root)
    if record is None:
        record = _download_and_build(root)
    if model is None or _runs(record["binary"], model):
        return record
    if record.get("amx") != "off":
        logger.info("llama-bench stopped in ggml's AMX kernels; building it without AMX")
        started = time.perf_counter()
        source = record.get("source") or next(root.glob("llama_cpp_python-*/vendor/llama.cpp"))
        _build(Path(source), root / "build", NO_AMX)
        record = {**record, "amx": "off", "amx_s": round(time.perf_counter() - started, 1)}
        (root / MARKER).write_text(json.dumps(record))
        if _runs(record["binary"], model):
            return record
    raise RuntimeError(f"{record['binary']} stops (SIGILL or SIGSEGV) on {model}, even built without AMX")


def _runs(binary: str, model: Path) -> bool:
    """Whether ``binary`` processes a 32-token prompt of ``model`` (``False``: stopped as by ggml's AMX kernels)."""
    command = [binary, "-m", str(model), "-t", "1", "-r", "1", "-p", "32", "-n", "0", "-o", "json"]
    return _completes(command)


def _completes(command: list[str]) -> bool:
    """Whether ``command`` finishes: ``False`` where a signal of :data:`AMX_STOPS` stops it on a CPU with AMX (where
    a build without AMX may run); other failures raise with the output's tail."""
    proc = subprocess.run(command, capture_output=True, text=True, check=False)
    if proc.returncode == 0:
        return True
    tail = "\n".join(((proc.stdout or "") + (proc.stderr or "")).splitlines()[-20:])
    if proc.returncode in [-s for s in AMX_STOPS] + [128 + s for s in AMX_STOPS] and _cpu_has_amx():
        logger.info("%s stopped (exit %s):\n%s", command[0], proc.returncode, tail)
        return False
    raise RuntimeError(f"{' '.join(command)} failed (exit {proc.returncode}):\n{tail}")


def _cpu_has_amx() -> bool:
    try:
        return " amx_tile" in Path("/proc/cpuinfo").read_text()
    except OSError:
        return False


def ensure_llama_cpp_python(model: Path) -> Path:
    """The interpreter of a venv with llama-cpp-python's server (compiled there once), tried on ``model`` (a
    100-token prompt); where ggml's AMX kernels stop it, the same compiled without AMX in a venv of its own
    (used directly from then on).

    Raises
    ------
    RuntimeError
        When an install fails, or the build without AMX stops too.
    """
    if venv_built(NO_AMX_VENV, NO_AMX_STEPS, env=NO_AMX_ENV):  # built because the other stopped: not tried again
        return ensure_venv(NO_AMX_VENV, NO_AMX_STEPS, env=NO_AMX_ENV)
    python = ensure_venv("llama-cpp-venv", [SERVER])
    if _answers(python, model):
        return python
    logger.info("llama-cpp-python stopped in ggml's AMX kernels; compiling it without AMX (minutes, once)")
    python = ensure_venv(NO_AMX_VENV, NO_AMX_STEPS, env=NO_AMX_ENV)
    if not _answers(python, model):
        raise RuntimeError(f"llama-cpp-python stops on {model}, even compiled without AMX")
    return python


def _answers(python: Path, model: Path) -> bool:
    # a prompt of ~100 tokens: ggml takes its AMX product for batches of rows, not for one token
    code = "import sys, llama_cpp; llama_cpp.Llama(sys.argv[1], n_ctx=256, verbose=False)('Hi ' * 100, max_tokens=2)"
    return _completes([str(python), "-c", code, str(model)])


def _download_and_build(root: Path) -> dict:
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
    logger.info("building llama-bench from %s (about 3-10 minutes on 2 cores)", source)
    binary = _build(source, root / "build")
    record = {
        "version": VERSION,
        "binary": str(binary),
        "source": str(source),
        "build_s": round(time.perf_counter() - started, 1),
    }
    (root / MARKER).write_text(json.dumps(record))
    return record


def _build(source: Path, build: Path, flags: str = "") -> Path:
    """Configure (C and C++ ``flags`` added) and build the ``llama-bench`` target; its path."""
    configure = [
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
        f"-DCMAKE_C_FLAGS={flags}",
        f"-DCMAKE_CXX_FLAGS={flags}",
    ]
    _run(configure, build.parent)
    _run(["cmake", "--build", str(build), "--target", "llama-bench", "-j", "2"], build.parent)
    binary = build / "bin" / "llama-bench"
    if not binary.is_file():
        raise RuntimeError(f"the build finished without {binary}")
    return binary


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    from semanticache_rag.models import default_gguf

    print(json.dumps(ensure_llama_bench(model=default_gguf())))
