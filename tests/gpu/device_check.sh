#!/usr/bin/env bash
# One pass on a lent CUDA machine (the `device` tool): the CUDA tests, then offline and serve
# benchmarks in bfloat16 (and offline float32) against Hugging Face on the same GPU. That
# machine reaches no registry: the command carries the wheels of the packages its image lacks
# (.whl), the generated protobuf code (gen) and the default model's small files (.gpu/model-src,
# from which random_default_model.py builds the model's shape with random weights).
# Logs land in $OUT (or ./gpu-out). Arguments name the steps to run (default: all but profile).
#     bash tests/gpu/device_check.sh [pytest] [offline_bf16] [serve_bf16] [offline_fp32] [profile]
set -u
STEPS=" ${*:-pytest offline_bf16 serve_bf16 offline_fp32} "
OUT=${OUT:-gpu-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 DUOSERVE_CACHE=/tmp/duoserve-cache
step() {  # step NAME SECONDS COMMAND...: bounded, logged, never stops the pass
    local name=$1 limit=$2
    shift 2
    [[ $STEPS == *" $name "* ]] || return 0
    echo "=== $name ($(date +%T), limit ${limit}s)"
    timeout "$limit" "$@" >"$OUT/$name.log" 2>&1
    echo "=== $name rc=$? ($(date +%T))"
    tail -n 25 "$OUT/$name.log"
}
{
    nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl
} >"$OUT/setup.log" 2>&1
export PYTHONPATH=/tmp/site:$PWD
python3 -c "import torch, transformers; print(torch.__version__, torch.cuda.get_device_name(), transformers.__version__)" >>"$OUT/setup.log" 2>&1
MODEL=$(python3 tests/gpu/random_default_model.py .gpu/model-src 2>>"$OUT/setup.log" | tail -n 1)
echo "model: $MODEL" >>"$OUT/setup.log"
cat "$OUT/setup.log"
step pytest 170 python3 -m pytest -q -p no:cacheprovider --timeout 160 \
    tests/engine_svc/test_cuda.py "tests/engine_svc/test_greedy_matches_hf.py::test_tiny_model_greedy_matches_hf" -k cuda
step offline_bf16 150 python3 -m engine_svc.bench offline --model "$MODEL" --dtype bfloat16 \
    --device cuda --skip-structured --rounds 3
step serve_bf16 110 python3 -m engine_svc.bench serve --model "$MODEL" --dtype bfloat16 \
    --num-prompts 64 --max-concurrency 64,64,64 --against-offline --skip-ceilings --no-progress
step offline_fp32 120 python3 -m engine_svc.bench offline --model "$MODEL" --dtype float32 \
    --device cuda --skip-structured --rounds 2
step profile 120 python3 tests/gpu/profile_steps.py "$MODEL"
