#!/bin/bash
# GPU lease for the code of 2026-12-07 that no GPU has timed yet (MoE, hybrid, gemma4, the codebook
# formats, the 8-bit KV cache, speculative decoding), most important first, in the background:
#
#   call 1 (carry .whl and .peer):  setsid nohup bash tools/lease_queue_2026.sh > /tmp/queue.log 2>&1 < /dev/null &
#   later calls:                    cat /tmp/res/progress.txt; tar czf $OUT/res.tgz -C /tmp/res .
#   (one tarball: at most 8 files come back from $OUT)
#
# llama.cpp builds meanwhile (.peer/build.sh, ~9 min); its rows wait for the build. Synthetic GGUFs
# are written by the CPU while the GPU runs the compiled tests (on an H100 2026-12-07: q30 and goss
# written in 18 s, the compiled tests 170 s). Every command lands in
# /tmp/res/commands.txt, its output in /tmp/res/<name>.
set -u
rm -rf /tmp/tree; cp -r "$PWD" /tmp/tree; cd /tmp/tree  # later device calls may replace the tree
R=/tmp/res; mkdir -p $R; P=$R/progress.txt; BIN=/tmp/peer/lcpp/build/bin
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl > $R/pip.txt 2>&1
export PYTHONUNBUFFERED=1 PYTHONPATH="/tmp/site:$PWD"
log() { echo "$(date +%T) $*" >> $P; }
run() { local name=$1 limit=$2; shift 2; echo "$name: $*" >> $R/commands.txt; timeout $limit "$@" > $R/$name 2>&1; log "$name rc=$? $(tail -1 $R/$name | cut -c1-150)"; }
built() { until grep -q "Built target llama-server" /tmp/peer/build.log 2>/dev/null; do grep -q "Error\|error:" /tmp/peer/build.log 2>/dev/null && { log "llama.cpp build failed"; return 1; }; sleep 10; done; }
write() { python3 scripts/bench.py --synthetic "$1" --write-gguf "$2" > $R/write_$(basename $2).txt 2>&1; log "$2 written rc=$?"; }
written() { until grep -q "$1 written" $P; do sleep 3; done; }
log "start on $(nvidia-smi --query-gpu=name --format=csv,noheader)"
# first, on a quiet CPU (before the llama.cpp build and the GGUF writers): every expert path of a
# Qwen3-30B-A3B MoE layer at 1..4096 tokens, and the EXPERT_PATHS table the fastest give
# (pallas/expert_tuning.py); no case started after 70 s (~90 s in all)
run expert_suite_q30.txt 130 python3 tools/expert_bench.py --suite --budget-s 70 --out $R/expert_suite_q30.md --jsonl $R/expert_suite_q30.jsonl
[ -d .peer ] && bash .peer/build.sh >> $R/llama_build.txt 2>&1
# the disk holds 64 GiB: q30 + goss + q36 + q7 (~53 GiB) first, g26 and q27 once q30 and goss are gone
(write qwen3-30b-a3b:q4_k_m /tmp/q30.gguf; write gpt-oss-20b:mxfp4_moe /tmp/goss.gguf
 write qwen3.6-35b-a3b:q4_k_m /tmp/q36.gguf; write qwen2.5-7b:q4_k_m /tmp/q7.gguf
 until grep -q "q30 goss removed" $P; do sleep 5; done; write gemma-4-26b-a4b:q4_k_m /tmp/g26.gguf; write qwen3.6-27b:q4_k_m /tmp/q27.gguf) &
MINFER_TEST_KERNELS=compiled run tests_new.txt 240 python3 -m pytest -v -p no:cacheprovider tests/test_codebooks.py tests/test_expert_kernels.py tests/test_kv8.py tests/test_attention_sinks.py tests/test_deltanet.py tests/test_gemma4.py tests/test_kernels.py -k 'not slow'
written /tmp/q30.gguf; run tg_ours_q30.md 400 python3 scripts/bench.py -m /tmp/q30.gguf -p 512,4096 -n 128 -r 2 -o md
written /tmp/goss.gguf; run tg_ours_goss.md 400 python3 scripts/bench.py -m /tmp/goss.gguf -p 512,4096 -n 128 -r 2 -o md
run profile_q30.txt 200 python3 tools/step_profile.py -m /tmp/q30.gguf
run profile_goss.txt 200 python3 tools/step_profile.py -m /tmp/goss.gguf
built && run tg_llama_q30.md 240 $BIN/llama-bench -m /tmp/q30.gguf -p 512,4096 -n 128 -fa 1 -r 2 -o md
built && run tg_llama_goss.md 240 $BIN/llama-bench -m /tmp/goss.gguf -p 512,4096 -n 128 -fa 1 -r 2 -o md
# "ragged" through cuDNN's grouped GEMM instead of XLA's dense expansion (fails at once where this
# XLA does not know the flag)
XLA_FLAGS=--xla_gpu_experimental_use_ragged_dot_fusion=true run expert_ragged_cudnn_q30.txt 120 python3 tools/expert_bench.py --nt 64,512 --paths ragged,pallas --reps 4
run batched_ours_q30.md 360 python3 scripts/bench.py -m /tmp/q30.gguf --batched -npp 512 -ntg 128 -npl 1,8,32 -o md
built && run batched_llama_q30.txt 240 $BIN/llama-batched-bench -m /tmp/q30.gguf -c 24576 -b 2048 -ub 512 -npp 512 -ntg 128 -npl 1,8,32 -ngl 99 -fa on
rm -f /tmp/q30.gguf /tmp/goss.gguf; log "q30 goss removed"
written /tmp/q36.gguf; run tg_ours_q36.md 420 python3 scripts/bench.py -m /tmp/q36.gguf -p 512,4096 -n 128 -r 2 -o md
built && run tg_llama_q36.md 240 $BIN/llama-bench -m /tmp/q36.gguf -p 512,4096 -n 128 -fa 1 -r 2 -o md
run expert_bench_goss.txt 150 python3 tools/expert_bench.py --model gpt-oss-20b --nt 1,8,512 --paths gemv,gemv-pairs,pallas,dequant --out $R/expert_bench_goss.md
run bench_formats.txt 200 python3 scripts/bench.py --matmuls --shapes q4_0:4096x14336,iq4_nl:4096x14336,mxfp4:4096x14336,q4_k:4096x14336,iq4_xs:4096x14336 --nt 1,2,8,16,512
written /tmp/q7.gguf
run kv_f16_q7.md 300 python3 scripts/bench.py -m /tmp/q7.gguf -p 512 -n 128 -d 16384 -r 2 -o md
run kv_q8_q7.md 300 python3 scripts/bench.py -m /tmp/q7.gguf -p 512 -n 128 -d 16384 -ctk q8_0 -ctv q8_0 -r 2 -o md
built && run kv_q8_llama_q7.md 200 $BIN/llama-bench -m /tmp/q7.gguf -p 512 -n 128 -d 16384 -ctk q8_0 -ctv q8_0 -fa 1 -r 2 -o md
run spec_q7.txt 300 python3 scripts/bench.py -m /tmp/q7.gguf --spec ngram-simple -n 256 -r 2 -d 1024
run spec_check_draft.txt 300 python3 tools/spec_check.py --synthetic qwen2.5-7b:q4_k_m -md synthetic:qwen2.5-0.5b:q8_0 -n 64 --prompts 4 --modes default,deterministic
run spec_draft_q7.txt 300 python3 scripts/bench.py -m /tmp/q7.gguf --spec draft -md synthetic:qwen2.5-0.5b:q8_0 -n 128 -r 2 -d 1024
run spec_check_hybrid.txt 300 python3 tools/spec_check.py --synthetic qwen3.6-35b-a3b:q4_k_m --layers 8 --modes default,deterministic -n 64 --prompts 4
run spec_check_mtp.txt 200 python3 tools/spec_check.py --qwen35 qwen35-tiny-v3-mtp --qwen35 qwen35moe-tiny --mtp -n 32 --prompts 4 --draft-max 3
written /tmp/g26.gguf; run tg_ours_g26.md 400 python3 scripts/bench.py -m /tmp/g26.gguf -p 512 -n 128 -r 2 -o md
built && run tg_llama_g26.md 240 $BIN/llama-bench -m /tmp/g26.gguf -p 512 -n 128 -fa 1 -r 2 -o md
written /tmp/q27.gguf; run tg_ours_q27.md 400 python3 scripts/bench.py -m /tmp/q27.gguf -p 512 -n 128 -r 2 -o md
built && run tg_llama_q27.md 240 $BIN/llama-bench -m /tmp/q27.gguf -p 512 -n 128 -fa 1 -r 2 -o md
run delta_bench.txt 120 python3 tools/delta_rule_bench.py --ts 512,4096 --reps 5
log "ALL DONE"
