#!/bin/bash
# The GPU checks in one prepared command, for a session lent a GPU for a few minutes. Each part
# is sized from H100 runs (start-up is 20-140 s per gpu_bench contender: graphs compile first;
# the third run: 17 of 18 tests in 280 s, 8B 208 s, 1B without steps 180 s; the fourth: 8B 168-187 s,
# 1B graphs and steps alone 107 s; the fifth, an H200: 28 tests in 222 s with 14 workers, where 8
# workers had not finished in 235 s, since the graphs compile on the CPU; 8B 166 s, 1B 42-69 s; the
# sixth, an H200: 31 tests in 318 s with 14 workers; 1B start-up graphs 30 s, eagle3 55 s, the tree
# 69 s, "auto" 108 s):
#   tests   the CUDA tests (test_cuda_graphs.py, test_triton_decode.py), 14 workers ~5.5 min
#   1B      gpu_bench, Llama-3.2-1B shape: graphs, eagle3 chain/tree/auto sizes    ~5 min
#   8B      gpu_bench, Llama-3-8B shape: graphs against 4 decode steps per step   ~3.5 min
#   demo    gpu_bench, the built-in pair: graphs, eagle3 chain/tree/auto sizes     ~3 min
#   split   gpu_bench, 1B shape: graphs and 4 steps with and without the split argmax  ~4 min
#   pack    here, before a device call that runs demo: the built-in target, EAGLE-3 head and training
#           record in .gpu-assets/assets.tar.xz (44 MiB; name it in the call's carry), and the assets
#           folder moved into .gpu-assets (ignored: with it the tree is 73 MiB, over the device tool's 64)
#   unpack  on the device, first: the packed assets back in place
#   restore here, after the call: the assets folder back
# Usage: bash benchmarks/gpu_check.sh tests 1B ...   (logs and JSON in $OUT, else ./gpu-check; each part's
# time box in seconds: BENCH_BOX, 330 by default, and TESTS_BOX, 400; WARMUP_TOKENS: each bench contender's
# warm-up request, gpu_bench's 8 by default; the demo part needs the built-in assets, which take the
# working tree past the device tool's 64 MiB)
set -u
cd "$(dirname "$0")/.."
out=${OUT:-gpu-check}
mkdir -p "$out"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
py=${PYTHON:-python3}
bench() {   # name, then gpu_bench arguments
    local name=$1; shift
    timeout "${BENCH_BOX:-330}" "$py" benchmarks/gpu_bench.py "$@" ${WARMUP_TOKENS:+--warmup-tokens "$WARMUP_TOKENS"} --out "$out/$name.json" > "$out/$name.log" 2>&1
    echo "== $name: exit $?"
    grep -v -i -E "warn|compiling|softmax|split the reduction|important use case|^$" "$out/$name.log" | tail -40
}
for part in "$@"; do
    t0=$(date +%s)
    case $part in
        tests)
            timeout "${TESTS_BOX:-400}" "$py" -m pytest tests/model/test_cuda_graphs.py tests/attention/test_triton_decode.py -k "not interpreter" -v -n 14 --dist load -p no:cacheprovider \
                --tb=short > "$out/tests.log" 2>&1
            echo "== tests: exit $?"
            grep -E "PASSED|FAILED|ERROR|passed|failed|^E " "$out/tests.log" | tail -40 ;;
        1B) bench 1B --shape 1B --contenders graphs,eagle3,eagle3-tree,eagle3-auto --num-prompts 2 \
                --max-tokens 128 --rounds 3 ;;
        8B) bench 8B --shape 8B --contenders graphs,steps --steps 4 --num-prompts 2 --max-tokens 96 --rounds 2 ;;
        split) bench split --shape 1B --contenders graphs,graphs-1max,steps,steps-1max --steps 4 --num-prompts 2 \
                --max-tokens 96 --rounds 3 ;;
        demo) bench demo --shape demo --contenders graphs,eagle3,eagle3-tree,eagle3-auto --num-prompts 4 \
                --max-tokens 128 --rounds 3 ;;
        pack)
            demo=leapfrog/assets/stdlib-demo
            mkdir -p .gpu-assets
            tar cf - $demo/target $demo/eagle3 $demo/training_record.json | xz -6 -T0 > .gpu-assets/assets.tar.xz \
                && mv $demo .gpu-assets/stdlib-demo && ls -l .gpu-assets/assets.tar.xz ;;
        unpack) "$py" -c "import tarfile; tarfile.open('.gpu-assets/assets.tar.xz').extractall(filter='data')" ;;
        restore)
            if [ -d leapfrog/assets/stdlib-demo ]; then echo "leapfrog/assets/stdlib-demo is in place"
            else mv .gpu-assets/stdlib-demo leapfrog/assets/stdlib-demo; fi ;;
        *) echo "unknown part $part (tests, 1B, 8B, demo, split, pack, unpack, restore)"; exit 2 ;;
    esac
    echo "   ($part took $(( $(date +%s) - t0 )) s)"
done
