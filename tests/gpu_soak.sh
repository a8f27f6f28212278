#!/usr/bin/env bash
# The reliability and operations checks that need the GPU machine (not in CI):
#   1. the daemons on CUDA with metrics: a short loadtest, then /metrics, /healthz, /readyz and
#      `broker status` of the live stack;
#   2. the soak: create/fork/generate/stream/cancel/close churn on a 64-slot worker, GPU memory sampled.
#
#   OUT=out SOAK_S=180 bash tests/gpu_soak.sh     # from the repository root; PYTHONPATH must reach the repo
set -u -o pipefail
OUT="${OUT:-out}"
SOAK_S="${SOAK_S:-180}"
mkdir -p "$OUT"
FAILED=0
port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }
# http URL [FILE]: the status code, the body into FILE (no curl needed)
http() {
    python3 - "$@" <<'PY'
import sys, urllib.error, urllib.request
try:
    with urllib.request.urlopen(sys.argv[1], timeout=5) as r:
        code, body = r.status, r.read()
except urllib.error.HTTPError as e:
    code, body = e.code, e.read()
except OSError:
    code, body = 0, b""
if len(sys.argv) > 2:
    open(sys.argv[2], "wb").write(body)
print(code)
PY
}
CP=$(port); WP=$(port); BM=$(port); WM=$(port)

echo "=== metrics on CUDA"
python3 -m broker.cli start --clients tcp://127.0.0.1:$CP --workers tcp://127.0.0.1:$WP --metrics-port $BM \
    --log-level warning >"$OUT/broker.log" 2>&1 &
BROKER=$!
python3 -m worker.cli start --broker tcp://127.0.0.1:$WP --model random:smollm2-135m --device cuda \
    --max-sessions 64 --name gpu0 --metrics-port $WM --log-level warning >"$OUT/worker.log" 2>&1 &
WORKER=$!
for _ in $(seq 120); do
    [ "$(http "http://127.0.0.1:$WM/readyz")" = 200 ] && break
    sleep 1
done
python3 -m client.bench.loadtest --broker tcp://127.0.0.1:$CP --sessions 16 --prompt-tokens 128 --max-tokens 64 --turns 2 \
    --ignore-eos --no-progress --json "$OUT/loadtest.json" || FAILED=$((FAILED + 1))
python3 -m broker.cli status --clients tcp://127.0.0.1:$CP || FAILED=$((FAILED + 1))
for ep in healthz readyz; do
    echo "broker /$ep: $(http "http://127.0.0.1:$BM/$ep")  worker /$ep: $(http "http://127.0.0.1:$WM/$ep")"
done
[ "$(http "http://127.0.0.1:$BM/metrics" "$OUT/broker.metrics")" = 200 ] || FAILED=$((FAILED + 1))
[ "$(http "http://127.0.0.1:$WM/metrics" "$OUT/worker.serve.metrics")" = 200 ] || FAILED=$((FAILED + 1))
grep -E '^sessionserve:(num_workers|requests_total|worker_capacity)' "$OUT/broker.metrics"
grep -E '^sessionserve:(engine_steps_total|generation_tokens_total|gpu_memory_(allocated|reserved)_bytes|session_bytes|time_to_first_token_seconds_(count|sum)|inter_token_latency_seconds_(count|sum)|engine_step_duration_seconds_(count|sum)|engine_step_batch_size_(count|sum))' \
    "$OUT/worker.serve.metrics"
kill -TERM $WORKER $BROKER
wait $WORKER; echo "worker exit $?"
wait $BROKER; echo "broker exit $?"

echo "=== soak ${SOAK_S}s"
python3 -m client.bench.soak --spawn --model random:smollm2-135m --device cuda --max-sessions 64 --sessions 32 \
    --duration "$SOAK_S" --json "$OUT/soak.json" || FAILED=$((FAILED + 1))
echo "=== done: $FAILED failed"
exit "$FAILED"
