#!/bin/bash
# GPU lease: the measurement set behind docs/BENCHMARKS.md's sections beside llama.cpp, run in the
# background on the device machine so that a lease's few calls only start it and poll it.
#
#   call 1 (carry .whl and .peer):  python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl
#                                   setsid nohup bash tools/lease_queue.sh > /tmp/queue.log 2>&1 < /dev/null &
#   later calls:                    cat /tmp/res/progress.txt            (one line per finished step)
#   last call:                      tar czf $OUT/res.tgz -C /tmp/res .   ($OUT returns at most 8 files)
#
# STEPS (default all, in this order): tests sweep ggufs ours llama. `ours` and `llama` run after
# llama.cpp's build (.peer/build.sh, started here when .peer exists), on an otherwise idle GPU.
# SYNTHETIC (default "7b 05b"): which synthetic GGUFs the `ggufs` step writes (/tmp/q7.gguf,
# /tmp/q05.gguf) and times. MODELS: GGUFs to time after them (e.g. the real 0.5B carried in
# pieces; a file still missing when its turn comes is skipped). TESTS: the `tests` step's pytest
# arguments. Every command also lands in /tmp/res/commands.txt.
set -u
R=/tmp/res; mkdir -p "$R"; P=$R/progress.txt
STEPS=${STEPS:-"tests sweep ggufs ours llama"}
SYNTHETIC=${SYNTHETIC:-"7b 05b"}
TESTS=${TESTS:-"tests/test_attention.py tests/test_kernels.py tests/test_model_kernels.py tests/test_device.py tests/test_batch_invariance.py"}
MODELS="$(for s in $SYNTHETIC; do printf '/tmp/q%s.gguf ' "${s%b}"; done)${MODELS:-}"
BIN=/tmp/peer/lcpp/build/bin
export PYTHONUNBUFFERED=1 PYTHONPATH="/tmp/site:$PWD"
log() { echo "$(date +%T) $*" >> "$P"; }
run() {  # run NAME TIMEOUT CMD...: output to $R/NAME, one progress line
  local name=$1 limit=$2; shift 2
  echo "$name: $*" >> "$R/commands.txt"
  timeout "$limit" "$@" > "$R/$name" 2>&1
  log "$name rc=$? $(tail -1 "$R/$name" | cut -c1-120)"
}
has() { [[ " $STEPS " == *" $1 "* ]]; }
log "start on $(nvidia-smi --query-gpu=name --format=csv,noheader): $STEPS"
[ -d .peer ] && { has ours || has llama; } && bash .peer/build.sh >> "$R/llama_build.txt" 2>&1
if has tests; then
  export MINFER_TEST_KERNELS=compiled
  eval "test_args=($TESTS)"  # shell words: TESTS may quote a -k expression
  run tests_compiled.txt 900 python -m pytest -q -p no:cacheprovider "${test_args[@]}"
  unset MINFER_TEST_KERNELS
fi
if has sweep; then
  run gemm_sweep_7b.txt 600 python tools/gemm_variants.py --nt 16,32 --reps 10 \
    --variants "route;gemm:bk=256;gemm:bk=512;gemm:num_warps=2;gemm:num_stages=3" \
    --shapes q4_k:37888x3584,q4_k:3584x18944,q6_k:3584x18944,q4_k:3584x3584,q6_k:152064x3584
  run gemv_sweep_7b.txt 600 python tools/gemv_variants.py --nt 1,2 --reps 20 \
    --variants "x_first=1;prequant=1;bn=16;bn=64;num_warps=8;as_nt=1" --shapes q4_k:37888x3584,q4_k:3584x18944,q6_k:3584x18944,q4_k:3584x3584
fi
if has ggufs; then
  for s in $SYNTHETIC; do
    run "write_q${s%b}.txt" 600 python scripts/bench.py --synthetic "qwen2.5-$(sed 's/05b/0.5b/' <<< "$s"):q4_k_m" \
      --write-gguf "/tmp/q${s%b}.gguf"
  done
fi
if has ours || has llama; then
  until grep -q "Built target llama-server" /tmp/peer/build.log 2>/dev/null; do
    grep -q "Error" /tmp/peer/build.log 2>/dev/null && { log "llama.cpp build failed"; break; }
    sleep 10
  done
  log "llama.cpp built"
fi
for m in $MODELS; do
  [ -f "$m" ] || continue
  tag=$(basename "$m" .gguf)
  if has ours; then
    run "tg_ours_$tag.md" 600 python scripts/bench.py -m "$m" -p 512 -n 128 -d 0,4096,16384 -r 2 -o md
    run "batched_ours_$tag.md" 600 python scripts/bench.py -m "$m" --batched -npp 512 -ntg 128 \
      -npl 1,2,4,8,16,32 -o md
  fi
  if has llama && [ -x "$BIN/llama-bench" ]; then
    run "tg_llama_$tag.md" 600 "$BIN/llama-bench" -m "$m" -p 512 -n 128 -d 0,4096,16384 -fa 1 -r 2 -o md
    run "batched_llama_$tag.txt" 600 "$BIN/llama-batched-bench" -m "$m" -c 24576 -b 2048 -ub 512 \
      -npp 512 -ntg 128 -npl 1,2,4,8,16,32 -ngl 99 -fa on
  fi
done
log "ALL DONE"
