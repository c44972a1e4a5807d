#!/usr/bin/env bash
# The cost of structured output: the same load against one running server, without and
# with a JSON-schema constraint, and the ratio of their output tok/s.
#
#   bench/structured.sh TOKENIZER [BASE_URL] [CONCURRENCY] [NUM_PROMPTS] [INPUT_LEN] [OUTPUT_LEN]
#
# The schema (bench/schemas/records.json) asks for at least 200 records, so constrained
# answers run to OUTPUT_LEN as the unconstrained ones (ignore_eos) do: both runs generate
# the same number of tokens. A warm-up pair goes first (it also compiles the schema's
# lexer); then ROUNDS (default 3) pairs alternate the two loads, so that a machine whose
# speed drifts weighs on both alike, and the median ratio is the figure. TEMPERATURE
# (default 0, greedy) sets the sampling of both. Runs $INGOT (default target/release/ingot).
set -euo pipefail
cd "$(dirname "$0")/.."
tokenizer=$1
base=${2:-http://127.0.0.1:8000}
concurrency=${3:-16}
prompts=${4:-64}
input=${5:-128}
output=${6:-128}
run() {
  "${INGOT:-target/release/ingot}" bench serve --base-url "$base" --tokenizer "$tokenizer" --format json \
    --num-prompts "$prompts" --max-concurrency "$concurrency" --input-len "$input" \
    --output-len "$output" --temperature "${TEMPERATURE:-0}" "$@"
}
schema=(--json-schema bench/schemas/records.json)
run >/dev/null
run "${schema[@]}" >/dev/null
results=()
for _ in $(seq "${ROUNDS:-3}"); do
  results+=("$(run)" "$(run "${schema[@]}")")
done
python3 - "${results[@]}" <<'PY'
import json, statistics, sys
runs = [json.loads(a) for a in sys.argv[1:]]
ratios = []
for plain, constrained in zip(runs[0::2], runs[1::2]):
    for name, r in (("unconstrained", plain), ("json schema", constrained)):
        print(f"{name:14} {r['completed']:4} ok {r['failed']:3} failed  {r['output_throughput']:8.1f} output tok/s"
              f"  TPOT median {r['tpot_ms']['median']:.2f} ms  TTFT median {r['ttft_ms']['median']:.1f} ms")
        steps = r.get("engine_steps") or {}
        if steps.get("steps"):
            phases = ", ".join(f"{k} {v:.0f}" for k, v in steps["us_per_step"].items() if v is not None)
            print(f"  engine: {steps['steps']:.0f} steps, µs per step: {phases}")
    so = constrained.get("structured_output") or {}
    if so:
        # A figure is null where its denominator is zero (no mask computed, no step).
        f = lambda key: "n/a" if so.get(key) is None else f"{so[key]:.1f}"
        print(f"  masks: {so['masks']:.0f} in {so['steps']:.0f} steps, {f('mask_us_per_token')} µs per mask, "
              f"{f('mask_us_per_step')} µs per step; grammar advances {f('accept_us_per_step')} µs per step (summed)")
    ratios.append(constrained["output_throughput"] / plain["output_throughput"])
    print(f"  ratio {ratios[-1]:.3f}")
print(f"median ratio: {statistics.median(ratios):.3f} (of {', '.join(f'{r:.3f}' for r in ratios)})")
PY
