#!/usr/bin/env bash
# CPU throughput of ingot next to llama.cpp's llama-bench, same GGUF, same threads, one run.
#   bench/cpu-vs-llama-cpp.sh [THREADS] [REPS]
# Prefill: a 200-token prompt; decode: 128 tokens (EOS ignored), as llama-bench -p 200 -n 128.
# llama.cpp is built once by bench/llama-cpp-build (llama-cpp-python sdist, explicit ISA flags).
# Peak RSS is each program's maximum resident set (getrusage of the finished child).
set -euo pipefail
cd "$(dirname "$0")/.."
threads="${1:-2}"
reps="${2:-5}"
model="$(scripts/fetch-test-model)"
bin="$(bench/llama-cpp-build)"
cargo build --release -p ingot >&2

# A prompt of exactly 200 tokens for ingot (llama-bench uses random tokens of that count).
prompt_file="$(mktemp)"
trap 'rm -f "$prompt_file" "$prompt_file.err"' EXIT
python3 - "$prompt_file" <<'PY'
import sys
words = ("the harbour town grew quickly as fishing fleets merchants and travellers arrived "
         "from every direction while the old lighthouse keeper wrote in his journal ").split()
open(sys.argv[1], "w").write(" ".join(words[i % len(words)] for i in range(200)))
PY

# Runs a command and prints its peak resident memory to stderr.
peak_rss() {
  python3 -c 'import resource, subprocess, sys
code = subprocess.run(sys.argv[1:]).returncode
print(f"peak RSS {resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024:.1f} MiB", file=sys.stderr)
sys.exit(code)' "$@"
}

echo "CPU: $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs), $threads threads"
echo "llama.cpp built with: $(bench/llama-cpp-build --isa)"
echo "== llama.cpp llama-bench -t $threads -p 200 -n 128 -r $reps"
peak_rss "$bin/llama-bench" -m "$model" -t "$threads" -p 200 -n 128 -r "$reps" -o md

echo "== ingot generate --threads $threads (median of $reps runs)"
for _ in $(seq "$reps"); do
  peak_rss ./target/release/ingot generate --model "$model" --prompt-file "$prompt_file" --max-tokens 128 \
    --ignore-eos --threads "$threads" --format json 2>"$prompt_file.err"
  grep 'peak RSS' "$prompt_file.err" >&2
done > "$prompt_file.runs"
python3 - "$prompt_file.runs" <<'PY'
import json, statistics, sys
runs = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
prompt = sorted({len(r["prompt_token_ids"]) for r in runs})
gen = sorted({len(r["token_ids"]) for r in runs})
print(f"prompt tokens {prompt}, generated tokens {gen}")
for key in ("prefill_tok_s", "decode_tok_s"):
    vals = [r[key] for r in runs]
    print(f"{key}: median {statistics.median(vals):.1f}  runs {[round(v, 1) for v in vals]}")
PY
rm -f "$prompt_file.runs"
