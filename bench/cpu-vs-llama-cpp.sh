#!/usr/bin/env bash
# CPU throughput of ingot next to llama.cpp's llama-bench, same GGUF, same threads, one run.
#   bench/cpu-vs-llama-cpp.sh [THREADS] [REPS]
# Prefill: a 200-token prompt; decode: 128 tokens (EOS ignored), as llama-bench -p 200 -n 128.
# llama.cpp is built once from the llama-cpp-python sdist (PyPI) into ~/.cache/ingot/llamacpp.
set -euo pipefail
cd "$(dirname "$0")/.."
threads="${1:-2}"
reps="${2:-5}"
model="$(scripts/fetch-test-model)"
cache="${INGOT_CACHE:-$HOME/.cache/ingot}/llamacpp"
bench_bin="$cache/build/bin/llama-bench"

if [ ! -x "$bench_bin" ]; then
  echo "building llama-bench (once, ~6 minutes)..." >&2
  mkdir -p "$cache"
  python3 -m pip install --quiet --disable-pip-version-check cmake ninja >&2
  ls "$cache"/llama_cpp_python-*.tar.gz >/dev/null 2>&1 ||
    python3 -m pip download --quiet --no-deps --no-binary llama-cpp-python llama-cpp-python -d "$cache" >&2
  sdist="$(ls "$cache"/llama_cpp_python-*.tar.gz | tail -n 1)"
  rm -rf "$cache/src" && mkdir -p "$cache/src"
  tar -xzf "$sdist" -C "$cache/src" --strip-components=1
  cmake -S "$cache/src/vendor/llama.cpp" -B "$cache/build" -G Ninja -DCMAKE_BUILD_TYPE=Release \
    -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF >&2
  cmake --build "$cache/build" --target llama-bench -j "$(nproc)" >&2
fi
[ -x target/release/ingot ] || cargo build --release -p ingot >&2

# A prompt of exactly 200 tokens for ingot (llama-bench uses random tokens of that count).
prompt_file="$(mktemp)"
trap 'rm -f "$prompt_file"' EXIT
python3 - "$prompt_file" <<'PY'
import sys
words = ("the harbour town grew quickly as fishing fleets merchants and travellers arrived "
         "from every direction while the old lighthouse keeper wrote in his journal ").split()
open(sys.argv[1], "w").write(" ".join(words[i % len(words)] for i in range(200)))
PY

echo "== llama.cpp llama-bench -t $threads -p 200 -n 128 -r $reps"
"$bench_bin" -m "$model" -t "$threads" -p 200 -n 128 -r "$reps" -o md

echo "== ingot generate --threads $threads (median of $reps runs)"
for _ in $(seq "$reps"); do
  ./target/release/ingot generate --model "$model" --prompt-file "$prompt_file" --max-tokens 128 \
    --ignore-eos --threads "$threads" --format json 2>/dev/null
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
