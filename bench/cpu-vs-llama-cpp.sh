#!/usr/bin/env bash
# CPU throughput of ingot next to llama.cpp's llama-bench, same GGUF, same threads, one run.
#   bench/cpu-vs-llama-cpp.sh [THREADS] [REPS]
# Rows, each at equal context on both sides:
#   prefill of a 200-token prompt                     (llama-bench pp200)
#   decode of 128 tokens from an (almost) empty context (tg128; ingot's prompt is 1 token)
#   decode of 128 tokens after the 200-token prompt     (tg128 @ d200)
# EOS is ignored; figures are medians of REPS runs (llama-bench: its mean of REPS).
# llama.cpp is built once by bench/llama-cpp-build (llama-cpp-python sdist, explicit ISA flags).
# Peak RSS is each program's maximum resident set (getrusage of the finished child), the
# largest over its runs.
set -euo pipefail
cd "$(dirname "$0")/.."
threads="${1:-2}"
reps="${2:-5}"
model="$(scripts/fetch-test-model)"
bin="$(bench/llama-cpp-build)"
cargo build --release -p ingot >&2

work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
# A prompt of exactly 200 tokens for ingot (llama-bench uses random tokens of that count),
# and one of a single token.
python3 - "$work" <<'PY'
import sys
words = ("the harbour town grew quickly as fishing fleets merchants and travellers arrived "
         "from every direction while the old lighthouse keeper wrote in his journal ").split()
open(f"{sys.argv[1]}/p200.txt", "w").write(" ".join(words[i % len(words)] for i in range(200)))
open(f"{sys.argv[1]}/p1.txt", "w").write("the")
PY

# Runs a command and prints its peak resident memory in MiB to stderr.
peak_rss() {
  python3 -c 'import resource, subprocess, sys
code = subprocess.run(sys.argv[1:]).returncode
print(f"peak_rss_mib {resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024:.1f}", file=sys.stderr)
sys.exit(code)' "$@"
}

echo "CPU: $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs), $threads threads"
echo "llama.cpp built with: $(bench/llama-cpp-build --isa)"
peak_rss "$bin/llama-bench" -m "$model" -t "$threads" -p 200 -n 128 -d 0,200 -r "$reps" -o json \
  >"$work/llama.json" 2>"$work/llama.err" || { cat "$work/llama.err" >&2; exit 1; }

for prompt in p200 p1; do
  for _ in $(seq "$reps"); do
    peak_rss ./target/release/ingot generate --model "$model" --prompt-file "$work/$prompt.txt" \
      --max-tokens 128 --ignore-eos --threads "$threads" --format json 2>"$work/ingot.err" \
      >>"$work/$prompt.jsonl" || { cat "$work/ingot.err" >&2; exit 1; }
    cat "$work/ingot.err" >>"$work/ingot.log"
  done
done
echo "ingot kernels: $(grep -o 'cpu ([^)]*)' "$work/ingot.log" | head -n 1)"

python3 - "$work" "$reps" <<'PY'
import json, re, statistics, sys
work, reps = sys.argv[1], sys.argv[2]
llama = json.load(open(f"{work}/llama.json"))
def llama_ts(n_prompt, n_gen, depth):
    for r in llama:
        if (r["n_prompt"], r["n_gen"], r.get("n_depth", 0)) == (n_prompt, n_gen, depth):
            return r["avg_ts"]
    raise SystemExit(f"llama-bench gave no row for pp{n_prompt} tg{n_gen} d{depth}")
def ingot_runs(prompt):
    return [json.loads(l) for l in open(f"{work}/{prompt}.jsonl") if l.strip()]
def rss(path):
    return max(float(m) for m in re.findall(r"peak_rss_mib ([0-9.]+)", open(path).read()))
p200, p1 = ingot_runs("p200"), ingot_runs("p1")
prompt_tokens = sorted({len(r["prompt_token_ids"]) for r in p200 + p1})
generated = sorted({len(r["token_ids"]) for r in p200 + p1})
print(f"ingot prompt tokens {prompt_tokens}, generated tokens {generated}, {reps} runs each")
med = lambda runs, key: statistics.median(r[key] for r in runs)
rows = [
    ("prefill 200 tokens (pp200)", llama_ts(200, 0, 0), med(p200, "prefill_tok_s")),
    ("decode 128, empty context (tg128)", llama_ts(0, 128, 0), med(p1, "decode_tok_s")),
    ("decode 128 after 200 (tg128 @ d200)", llama_ts(0, 128, 200), med(p200, "decode_tok_s")),
]
print("| tok/s | llama.cpp | ingot | ingot / llama.cpp |")
print("| --- | ---: | ---: | ---: |")
for name, l, i in rows:
    print(f"| {name} | {l:.1f} | {i:.1f} | {i / l:.2f}x |")
print(f"| peak RSS (MiB) | {rss(f'{work}/llama.err'):.1f} | {rss(f'{work}/ingot.log'):.1f} | |")
PY
