"""NVIDIA kvpress baselines, run in kvpress's own virtual environment.

kvpress 0.5.5 pins ``transformers<5.3`` while this package needs 5.x >= 5.3, so the presses
cannot share our venv. :func:`ensure_kvpress_env` builds a separate venv once (CPU torch first,
so pip does not pull a multi-GB CUDA build), and :func:`run_kvpress` runs
``benchmarks/kvpress_runner.py`` there as a subprocess, on token ids that we prepared, so every
method sees byte-identical prompts. This module never imports kvpress.

    from benchmarks.kvpress_env import run_kvpress
    rows = run_kvpress("tasks.jsonl", model_dir, ["snapkv", "knorm"], [0.5], "kvpress.jsonl")
"""

from __future__ import annotations

import json
import logging
import subprocess
import sys
from pathlib import Path

from benchmarks.venvs import ensure_venv

logger = logging.getLogger(__name__)

RUNNER = Path(__file__).with_name("kvpress_runner.py")
# Installed in this order: torch alone first (a local CPU build satisfies it), then kvpress with
# the newest transformers it allows; pip then keeps the torch that is already there.
TORCH_REQUIREMENT = "torch==2.13.0"
KVPRESS_REQUIREMENTS = ("kvpress==0.5.5", "transformers==5.2.0", "tqdm")
TAIL_LINES = 40


def ensure_kvpress_env(home: Path | None = None) -> Path:
    """Build (once) the kvpress venv (``home_dir() / "kvpress-venv"`` unless ``home``) and return its python.

    Raises
    ------
    RuntimeError
        When an install step fails; the message holds the tail of pip's output.
    """
    steps = [[TORCH_REQUIREMENT], [*KVPRESS_REQUIREMENTS, TORCH_REQUIREMENT]]
    return ensure_venv("kvpress-venv", steps, home=home)


def _runner_command(python, tasks_path, model_dir, presses, ratios, out_path, max_new_tokens, prefill) -> list[str]:
    """Command line for ``kvpress_runner.py``."""
    return [
        str(python),
        str(RUNNER),
        "--tasks", str(tasks_path),
        "--model", str(model_dir),
        "--presses", *presses,
        "--ratios", *(str(float(r)) for r in ratios),
        "--max-new-tokens", str(int(max_new_tokens)),
        "--prefill", prefill,
        "--out", str(out_path),
    ]  # fmt: skip


def _relay(stream, keep: int = 16_384) -> bytes:
    """Copy ``stream`` to our stderr chunk by chunk; return its last ``keep`` bytes."""
    sink = getattr(sys.stderr, "buffer", None)
    tail = b""
    for chunk in iter(lambda: stream.read1(4096), b""):
        if sink is not None:
            sink.write(chunk)
            sink.flush()
        tail = (tail + chunk)[-keep:]
    return tail


def _read_rows(path: Path) -> list[dict]:
    """Rows of a JSONL file."""
    with path.open() as handle:
        return [json.loads(line) for line in handle if line.strip()]


def run_kvpress(
    tasks_path: str | Path,
    model_dir: str | Path,
    presses: list[str],
    ratios: list[float],
    out_path: str | Path,
    max_new_tokens: int = 32,
    python: str | Path | None = None,
    prefill: str = "shared",
) -> list[dict]:
    """Run kvpress presses on prepared tasks in the kvpress venv.

    Parameters
    ----------
    tasks_path : str or Path
        JSONL tasks, one context per line (format in ``kvpress_runner.py``).
    model_dir : str or Path
        A transformers (safetensors) model directory.
    presses : list of str
        Press names: ``none``, ``snapkv``, ``streaming_llm``, ``knorm``,
        ``expected_attention``, ``chunkkv``.
    ratios : list of float
        Compression ratios in [0, 1) (fraction of the context cache removed).
    out_path : str or Path
        Where the runner writes its JSONL rows (overwritten).
    max_new_tokens : int
        Greedy answer length cap.
    python : str or Path, optional
        Interpreter to use; defaults to :func:`ensure_kvpress_env`'s.
    prefill : str
        ``"shared"``: one prefill per context serves every press and ratio (the same answers, far
        faster); ``"each"``: one prefill per press and ratio, as kvpress's pipeline runs.

    Returns
    -------
    list of dict
        One row per (press, ratio, question), as written to ``out_path``.

    Raises
    ------
    RuntimeError
        When the runner exits with an error; the message holds the tail of its stderr.
    """
    python = Path(python) if python is not None else ensure_kvpress_env()
    out_path = Path(out_path)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    command = _runner_command(python, tasks_path, model_dir, presses, ratios, out_path, max_new_tokens, prefill)
    logger.info("running %s", " ".join(command))
    # stdout is unused by the runner; stderr carries progress (tqdm redraws with "\r"), so it is
    # passed through as raw bytes as it arrives, keeping only a tail for the error message.
    with subprocess.Popen(command, stderr=subprocess.PIPE) as proc:
        assert proc.stderr is not None
        tail = _relay(proc.stderr)
    if proc.returncode != 0:
        lines = tail.decode(errors="replace").replace("\r", "\n").splitlines()
        raise RuntimeError(f"kvpress runner failed (exit {proc.returncode}):\n" + "\n".join(lines[-TAIL_LINES:]))
    return _read_rows(out_path)
