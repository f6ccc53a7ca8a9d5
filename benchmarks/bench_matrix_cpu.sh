#!/usr/bin/env bash
# The standard CPU matrix: concurrency 1/10/50/100 × {unique, prefix-heavy} × cache on/off,
# with `fulcrum bench serve` against `fulcrum serve` on the embedded model.
# Usage: benchmarks/bench_matrix_cpu.sh OUT_DIR [NUM_PROMPTS]
set -euo pipefail
out=${1:?usage: bench_matrix_cpu.sh OUT_DIR [NUM_PROMPTS]}; n=${2:-100}
mkdir -p "$out"
fulcrum() { python -m fulcrum.entrypoints.cli "$@"; }
for cache in on off; do
  flag=$([ "$cache" = on ] && echo --enable-prefix-caching || echo --no-enable-prefix-caching)
  port=$((18000 + RANDOM % 1000))
  fulcrum serve --port "$port" $flag --log-level warning > "$out/server-$cache.log" 2>&1 &
  pid=$!
  for _ in $(seq 120); do curl -sf "localhost:$port/health" >/dev/null && break; sleep 1; done
  common=(--base-url "http://127.0.0.1:$port/v1" --num-prompts "$n" --max-concurrency 1,10,50,100
          --ignore-eos --num-warmups 2 --seed 0 --disable-tqdm)
  fulcrum bench serve "${common[@]}" --dataset-name random --random-input-len 64 \
    --random-output-len 8 --label "unique, cache $cache" --result-file "$out/unique-$cache.json"
  fulcrum bench serve "${common[@]}" --dataset-name prefix-repetition --prefix-num-prefixes 4 \
    --prefix-len 256 --prefix-suffix-len 32 --prefix-output-len 8 \
    --label "prefix-heavy, cache $cache" --result-file "$out/prefix-$cache.json"
  kill -TERM "$pid"; wait "$pid" || true
done
fulcrum bench plot "$out"/unique-on.json "$out"/unique-off.json "$out"/prefix-on.json \
  "$out"/prefix-off.json -o "$out/matrix.png"
