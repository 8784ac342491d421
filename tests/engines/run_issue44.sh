#!/bin/bash
# Issue 44's engine check: fixtures converted by this checkout's transformd, then vLLM's and SGLang's own code on
# them (venvs as in README.md). Logs go to $OUT (default /work/engines/ec). Minutes per run on a CPU machine.
set -u
cd "$(dirname "$0")/../.."
OUT=${OUT:-/work/engines/ec}
TD="env PYTHONPATH=$PWD ${PYTHON:-python3} -m transformd"
mkdir -p "$OUT"
rm -rf "$OUT"/fused-* "$OUT"/kv64*
$TD sample "$OUT/fused-src" --layers 2 --experts 4 --fused-experts            # HF-v5 stacks, I = 128
$TD convert "$OUT/fused-src" --out "$OUT/fused-vllm" --engine vllm --device cpu          # as they are
$TD convert "$OUT/fused-src" --out "$OUT/fused-sglang" --engine sglang --device cpu      # per expert
# 128-row k/v as 2 heads of 64: 64 rows per rank inside the merged qkv at TP 2 (MoE 128 -> 64 per rank too)
env PYTHONPATH=$PWD ${PYTHON:-python3} -c "from transformd.sample import write_sample_checkpoint as w; \
w('$OUT/kv64-src', layers=2, experts=4, hidden=256, head_dim=64, kv_heads=2)"
$TD convert "$OUT/kv64-src" --out "$OUT/kv64" --engine raw --target ocp --device cpu
for engine in vllm sglang; do
  for d in fused-vllm fused-sglang kv64; do
    /work/engines/$engine-venv/bin/python tests/engines/engine_check.py --engine $engine "$OUT/$d" --tp 1 2 \
      > "$OUT/$engine-$d.log" 2>&1
    echo "$engine on $d: exit $? ($(tail -1 "$OUT/$engine-$d.log"))"
  done
done
