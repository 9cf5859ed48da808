#!/usr/bin/env bash
# What a session runs on a lent GPU machine (the device tool), in one go (about 12 minutes): the CUDA paths (NVML,
# torch's CUDA build, executors sandboxed on the GPU, sessions with their KV caches there) and issue 15's figures on a
# machine with cores to spare. That machine has the CUDA build of torch but not hivemind or gpunet's other needs, and
# no registry: `bash scripts/gpu_wheels.sh` here first, then carry .whl. Each step has its own time limit and the
# steps go on after a failure; everything lands in $OUT (or ./gpu-check).
#   bash scripts/gpu_check.sh                 # on the GPU machine, from the repository root
#   bash scripts/gpu_check.sh versions jobs_gpu_sweep    # only the steps named (one device call runs 10 minutes)
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-gpu-check}; mkdir -p "$out"
export PYTHONUNBUFFERED=1
if ls .whl/*.whl >/dev/null 2>&1; then  # a folder named site-packages: executors' sandbox lets them read it
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site-packages .whl/*.whl || exit 1
    export PYTHONPATH=$PWD:/tmp/site-packages
fi
only=" $* "
step() {  # step NAME SECONDS COMMAND...: its output to the terminal and to $out/NAME.txt
    local name=$1 limit=$2; shift 2
    if [[ "$only" != "  " && "$only" != *" $name "* ]]; then return; fi
    echo "=== $name ($(date +%T), limit ${limit}s): $*"
    timeout -k 10 "$limit" "$@" > "$out/$name.txt" 2>&1; local rc=$?
    tail -n 25 "$out/$name.txt"; echo "=== $name: rc $rc"
}
step versions 60 bash -c 'nproc; nvidia-smi -L; python3 -c "import sys, torch, hivemind, gpunet
print(sys.version.split()[0], torch.__version__, torch.cuda.is_available(), hivemind.__version__, gpunet.__version__)"'
step doctor 45 python3 -m gpunet doctor --device cuda:0 --network gpu-check --data-dir /tmp/doctor
step bench_gpu 150 python3 scripts/bench_pipeline.py --d-model 1024 --device cuda:0 --json
step bench_cpu 180 python3 scripts/bench_pipeline.py --d-model 1024 --json
# Issue 39: a HF causal LM over GPU workers (client.causal_lm, the gateway) beside HF's generate on the same GPU.
step llm_gpu 180 python3 scripts/bench_llm.py --device cuda:0 --hidden 1024 --layers 8 --json
# Issue 42: N concurrent generations with the workers batching sessions' steps, and not, beside HF on the GPU.
step batching_gpu 240 python3 scripts/bench_batching.py --device cuda:0 --d-model 1024 --layers 8 --sessions 1,4,16 --tokens 24 --rounds 1 --json
# Issue 41: the interpreter (compiled plan) against eager, and its CUDA-graph replays against eager captured by hand,
# at decode (1 and 8 rows) and prefill shapes, float32 and bfloat16, d=4096, in one JSON (jobs_cpu_decode, last: 16 cores).
step jobs_gpu_sweep 240 python3 scripts/bench_jobs_local.py --device cuda:0 --sweep --layers 4 --dim 4096 --repeat 50 --json
# The zoo's decoder families as causal_lm makes their spans, one decode step, the plan against eager (no graphs).
step decoders_gpu 180 python3 scripts/bench_decoders.py --device cuda:0 --families llama,mistral,qwen2,gpt2,gemma2,mixtral --width 32 --repeat 100 --json
# Issue 41, CUDA graphs: a 3-span bf16 d=4096 session beside local eager (target >= 90% of its tokens/s; the same with
# --worker-arg=--no-cuda-graphs shows what the graphs give); replays equal plain runs bit for bit (fp32, bf16, sessions
# interleaved, a host sync refused).
step bench_gpu_bf16 200 python3 scripts/bench_pipeline.py --d-model 4096 --layers 8 --dtype bfloat16 --rounds 2 --device cuda:0 --json
step graphs_test 150 python3 -m pytest -q -p no:cacheprovider tests/test_graphs.py -k on_a_gpu
step jobs_cpu_decode 150 python3 scripts/bench_jobs_local.py --batch 1 --seq 2 --layers 8 --dim 1024 --repeat 100 --codec-mib 16 --json
