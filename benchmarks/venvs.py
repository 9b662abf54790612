"""Virtual environments of their own for the tools we compare against (kvpress, llama.cpp).

Those tools pin versions this package cannot share (kvpress wants an older transformers), or
compile native code we do not want in the package's environment (llama-cpp-python). Each gets a
venv under :func:`~semanticache_rag.models.home_dir`, built once by a list of ``pip install``
steps; a marker written after the last step records them, so a half-built venv (interrupted, or
built for other steps) is wiped and built again.

    python = ensure_venv("kvpress-venv", [["torch==2.13.0"], ["kvpress==0.5.5", "torch==2.13.0"]])
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import venv
from pathlib import Path

from semanticache_rag.models import home_dir

logger = logging.getLogger(__name__)

MARKER = "semanticache-venv.json"
TAIL_LINES = 40


def venv_python(home: Path) -> Path:
    """Path of the interpreter inside venv ``home``."""
    return home / ("Scripts/python.exe" if os.name == "nt" else "bin/python")


def _pip_install(python: Path, requirements: list[str], env: dict[str, str] | None = None) -> None:
    """``pip install`` into the venv of ``python`` (``env`` added to the environment, e.g. ``CMAKE_ARGS`` for a
    package built from source); raise RuntimeError with the output tail."""
    command = [str(python), "-m", "pip", "install", "--disable-pip-version-check", *requirements]
    logger.info("%s: pip install %s", python.parent.parent.name, " ".join(requirements))
    proc = subprocess.run(command, capture_output=True, text=True, check=False, env=os.environ | (env or {}))
    if proc.returncode != 0:
        tail = "\n".join((proc.stdout + proc.stderr).splitlines()[-TAIL_LINES:])
        raise RuntimeError(f"pip install {' '.join(requirements)} failed (exit {proc.returncode}):\n{tail}")


def _record(steps: list[list[str]], env: dict[str, str] | None) -> dict:
    """What the marker of a finished build records."""
    return {"steps": steps, **({"env": env} if env else {})}


def _built(home: Path, record: dict) -> bool:
    """True when a previous build of ``home`` finished the same steps."""
    marker = home / MARKER
    if not marker.is_file() or not venv_python(home).is_file():
        return False
    try:
        return json.loads(marker.read_text()) == record
    except (OSError, ValueError):
        return False


def venv_built(name: str, steps: list[list[str]], home: Path | None = None, env: dict[str, str] | None = None) -> bool:
    """Whether :func:`ensure_venv` with these arguments would find the venv built (and build nothing)."""
    return _built(Path(home) if home is not None else home_dir() / name, _record(steps, env))


def ensure_venv(name: str, steps: list[list[str]], home: Path | None = None, env: dict[str, str] | None = None) -> Path:
    """Build (once) the venv ``name`` by ``steps`` of ``pip install`` arguments; return its python.

    Parameters
    ----------
    name : str
        Folder under ``home_dir()`` (or ``home`` itself when given).
    steps : list of list of str
        Requirements installed one step after another (e.g. CPU torch first, so a later step
        does not pull a CUDA build).
    env : dict or None
        Variables added to the environment of every step (recorded with the steps: other values build again).

    Raises
    ------
    RuntimeError
        When an install step fails; the message holds the tail of pip's output.
    """
    home = Path(home) if home is not None else home_dir() / name
    python = venv_python(home)
    record = _record(steps, env)
    if _built(home, record):
        return python
    logger.info("building the %s venv at %s (minutes, once)", name, home)
    venv.EnvBuilder(with_pip=True, clear=True).create(home)
    for requirements in steps:
        _pip_install(python, requirements, env)
    (home / MARKER).write_text(json.dumps(record))
    return python
