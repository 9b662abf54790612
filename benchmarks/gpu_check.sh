#!/usr/bin/env bash
# GPU check of the Triton kernels in one go (a few minutes on one GPU), run from the repository root:
#
#   bash benchmarks/gpu_check.sh [OUT_DIR]        # OUT_DIR: $1, else $OUT, else benchmarks/results/gpu
#
# 1. a Python that imports the package, triton and pytest: $PYTHON (default python3) as it is, else a
#    venv (--system-site-packages, so a preinstalled CUDA torch/triton is reused) with
#    pip install -e ".[triton,dev]", else (offline) the source tree on PYTHONPATH;
# 2. the `gpu` kernel tests;
# 3. python -m semanticache_rag.kernels.bench (extra flags in $BENCH_ARGS, e.g. "--tokens 32768 --batch 8");
# 4. the `interpret` tests under TRITON_INTERPRET=1 (a separate process: the mode is fixed at import).
# Everything goes to OUT_DIR: env.txt, nvidia-smi.txt, pytest-*.txt/.xml, bench.txt/.json, summary.txt.
# Exit status 0 only when every step passed.
set -uo pipefail

cd "$(dirname "$0")/.."
out="${1:-${OUT:-benchmarks/results/gpu}}"
mkdir -p "$out"
python="${PYTHON:-python3}"
venv="${VENV:-${TMPDIR:-/tmp}/semanticache-gpu-venv}"
status=0
: >"$out/summary.txt"

note() { echo "$*" | tee -a "$out/summary.txt"; }

can_import() { "$1" -c "import semanticache_rag.kernels.dispatch, triton, pytest" 2>/dev/null; }

source_tree_on_path() {
    # semanticache_rag.kernels and .integrations live in top-level folders (setuptools package-dir):
    # mirror the installed layout with symlinks in a temporary folder.
    local tree
    tree="$(mktemp -d)/src"
    mkdir -p "$tree/semanticache_rag"
    ln -s "$PWD"/semanticache_rag/* "$tree/semanticache_rag/"
    ln -s "$PWD/kernels" "$tree/semanticache_rag/kernels"
    ln -s "$PWD/integrations" "$tree/semanticache_rag/integrations"
    export PYTHONPATH="$tree:$PWD${PYTHONPATH:+:$PYTHONPATH}"
}

prepare_python() {  # sets $python to an interpreter that imports the package, triton and pytest
    if can_import "$python"; then
        note "environment: $python as it is"
        return
    fi
    if [ -x "$venv/bin/python" ] || "$python" -m venv --system-site-packages "$venv" >"$out/venv.txt" 2>&1; then
        python="$venv/bin/python"
        if can_import "$python"; then
            note "environment: existing venv $venv"
            return
        fi
    fi
    if "$python" -m pip install -q -e ".[triton,dev]" >"$out/pip.txt" 2>&1 && can_import "$python"; then
        note "environment: $python with pip install -e .[triton,dev]"
    else
        source_tree_on_path
        note "environment: $python, pip install failed or was not enough (pip.txt); source tree on PYTHONPATH"
    fi
}

prepare_python
if ! can_import "$python"; then
    "$python" -c "import semanticache_rag.kernels.dispatch, triton, pytest" >>"$out/summary.txt" 2>&1
    note "FAILED: cannot import the package, triton and pytest with $python"
    exit 1
fi

nvidia-smi >"$out/nvidia-smi.txt" 2>&1 || note "nvidia-smi: not available"
"$python" - >"$out/env.txt" 2>&1 <<'EOF'
import platform, sys, numpy, torch, triton
print("python", sys.version.split()[0], platform.platform())
print("torch", torch.__version__, "cuda", torch.version.cuda, "triton", triton.__version__, "numpy", numpy.__version__)
for i in range(torch.cuda.device_count()):
    p = torch.cuda.get_device_properties(i)
    print(f"device {i}: {p.name}, {p.total_memory / 2**30:.0f} GiB, {p.multi_processor_count} SMs, sm_{p.major}{p.minor}")
EOF
cat "$out/env.txt"

run_step() {  # name, timeout in seconds, command...
    local name="$1" limit="$2"
    shift 2
    local start=$SECONDS
    timeout "$limit" "$@" 2>&1 | tee "$out/$name.txt"
    local rc=${PIPESTATUS[0]}
    note "$name: exit $rc in $((SECONDS - start)) s"
    [ "$rc" -eq 0 ] || status=1
}

# Limits keep the whole check under ten minutes; the interpreter tests go last (the CPU already runs them).
pytest_args=(-q -rs -p no:cacheprovider tests/test_kernels.py)
run_step pytest-gpu 240 env -u TRITON_INTERPRET "$python" -m pytest "${pytest_args[@]}" -m gpu \
    --junitxml="$out/pytest-gpu.xml"
# shellcheck disable=SC2086  # BENCH_ARGS is a list of flags
run_step bench 240 env -u TRITON_INTERPRET TRITON_PRINT_AUTOTUNING=1 "$python" -m semanticache_rag.kernels.bench \
    --json "$out/bench.json" ${BENCH_ARGS:-}
run_step pytest-interpret 90 env TRITON_INTERPRET=1 "$python" -m pytest "${pytest_args[@]}" -m interpret \
    --junitxml="$out/pytest-interpret.xml"

note "results in $out"
exit "$status"
