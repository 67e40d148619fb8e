#!/bin/bash
# One call on a lent GPU machine (no package index there): install the project's wheels, then the most needed
# measurements first, each under its own time limit, every result under $OUT. Made for the session's device tool:
#
#   here, once:  echo /.whl/ >> .git/info/exclude; mkdir -p .whl; python3 -m pip download --no-deps \
#                --only-binary=:all: --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64 \
#                --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl -r <the list in
#                ../shared/gpu-probe/wheels.txt>   (prefetch_generator, python-baseconv, varint: `pip wheel` here)
#   there:       bash bench/gpu_call.sh        (carry .whl; about 9 minutes of a 10-minute call)
#
# Order: the bf16/fp32 profile of one 16-episode step (the open question of BENCHMARKS.md 9b), the engines side by
# side, then bench/gpu.py's rows until the time runs out.
cd "$(dirname "$0")/.."
T0=$SECONDS
OUT=${OUT:-/tmp/gpu-out}; mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade .whl/*.whl 2>&1 | grep -v -i warning | tail -3
export PYTHONPATH=$PWD HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
G=/tmp/g
python3 bench/gpu.py --out $G --budget-s 0 >/dev/null 2>&1  # writes every run's config, runs none
python3 bench/real_arch.py build --arch 0.6b --out $G/models/0.6b | grep wrote
echo "== setup $((SECONDS-T0)) s"
timeout 200 python3 bench/profile_step.py --model $G/models/0.6b --config $G/configs/0.6b-16ep-batched.toml \
    --device cuda --dtype bf16 fp32 --steps 3 --top 12 --json "$OUT/profile.json" 2>&1 | grep -v -i "warn\|USDT\|Loading"
echo "== profile $((SECONDS-T0)) s"
timeout 90 python3 bench/rollout_speed.py --model $G/models/0.6b --device cuda --lora 16 --engines batched continuous \
    --repeats 2 --json "$OUT/speed.json" 2>&1 | grep -E '^\{' | tail -6
echo "== engines $((SECONDS-T0)) s"
LEFT=$((560 - (SECONDS-T0)))
timeout $((LEFT > 30 ? LEFT : 30)) python3 bench/gpu.py --out $G --only 0.6b-lora-2nodes 0.6b-16ep-continuous \
    1.7b-16ep 0.6b-full-2nodes --budget-s $((LEFT > 120 ? LEFT - 120 : 0)) --run-timeout-s 240 2>&1 | grep -v "━"
pkill -9 -f "coordinator|nodes\.|bench/gpu.py"
cp $G/gpu.json $G/gpu.md "$OUT/" 2>/dev/null
echo "== done $((SECONDS-T0)) s"
