#!/usr/bin/env bash
# One prefill-first server, `sharegpt-like` at 3 req/s, 100 requests, two pairs of runs with a
# quick profile before each pair; then served short prefills and decode steps against it.
# MODE switch: Python's GIL switch interval at its default (5 ms), then at 0.5 ms, no other
# server alive. MODE idle: the server alone, then beside two idle servers (bullet and
# chunked-512, as in an interleaved sweep), at the default switch interval.
#     bash scripts/prefill_gap_server.sh docs/data/prefill-gap-2026-11-30 [switch|idle]
set -euo pipefail
out=${1:?usage: prefill_gap_server.sh OUT_DIR [switch|idle]}
mode=${2:-switch}
mkdir -p "$out"
port=18790
py=.venv/bin/python
idle=()
start_idle() {
  $py -m bulletserve.cli serve --port 18801 --max-model-len 768 --policy bullet \
    --log-level warning > "$out/idle-bullet.log" 2>&1 &
  idle+=($!)
  $py -m bulletserve.cli serve --port 18802 --max-model-len 768 --policy chunked \
    --chunked-prefill-size 512 --log-level warning > "$out/idle-chunked.log" 2>&1 &
  idle+=($!)
  for p in 18801 18802; do
    for _ in $(seq 1 120); do curl -sf "http://127.0.0.1:$p/health" > /dev/null && break; sleep 1; done
    curl -sf "http://127.0.0.1:$p/v1/completions" -H 'Content-Type: application/json' \
      -d '{"prompt": "Hello there", "max_tokens": 8}' > /dev/null
  done
}
stop_idle() { kill "${idle[@]}"; wait "${idle[@]}" || true; idle=(); }
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
  if [ "$mode" = idle ]; then
    start_idle; run "fast$suffix" 0.005; stop_idle
  else
    run "fast$suffix" 0.0005
  fi
done
$py scripts/prefill_gap_report.py "$out" --mode "$mode"
