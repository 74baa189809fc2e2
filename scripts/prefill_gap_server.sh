#!/usr/bin/env bash
# One prefill-first server at a time (no other server alive), `sharegpt-like` at 3 req/s, 100
# requests, with Python's GIL switch interval at its default (5 ms) and at 0.5 ms, twice, a
# quick profile before each pair; then served short prefills and decode steps against it.
#     bash scripts/prefill_gap_server.sh docs/data/prefill-gap-2026-11-30
set -euo pipefail
out=${1:?usage: prefill_gap_server.sh OUT_DIR}
mkdir -p "$out"
port=18790
py=.venv/bin/python
run() {  # label, switch interval (s)
  rm -f "$out/$1.steps.jsonl"
  $py -c "import runpy, sys; sys.setswitchinterval($2); sys.argv = ['bullet', 'serve', \
'--port', '$port', '--max-model-len', '768', '--policy', 'prefill-first', \
'--step-log', '$out/$1.steps.jsonl', '--log-level', 'warning']; \
runpy.run_module('bulletserve.cli', run_name='__main__')" > "$out/$1.serve.log" 2>&1 &
  local server=$!
  for _ in $(seq 1 120); do curl -sf "http://127.0.0.1:$port/health" > /dev/null && break; sleep 1; done
  curl -sf "http://127.0.0.1:$port/v1/completions" -H 'Content-Type: application/json' \
    -d '{"prompt": "Hello there", "max_tokens": 8}' > /dev/null
  $py -m bulletserve.cli bench --base-url "http://127.0.0.1:$port" --dataset sharegpt-like \
    --num-prompts 100 --request-rates 3 --ignore-eos --seed 0 --slo-ttft-per-token-ms 1.991 \
    --slo-ttft-base-ms 143.2 --slo-tpot-ms 164.6 --output "$out/$1.json" --no-progress \
    > "$out/$1.bench.txt" 2>&1
  kill "$server"; wait "$server" || true
}
for pair in 1 2; do
  $py -m bulletserve.cli profile --device cpu --quick --output "$out/profile-$pair.json" > /dev/null
  suffix=$([ "$pair" = 1 ] && echo "" || echo "$pair")
  run "default$suffix" 0.005
  run "fast$suffix" 0.0005
done
$py scripts/prefill_gap_report.py "$out"
