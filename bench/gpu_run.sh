#!/usr/bin/env bash
# The one command for the GPU machine, from the repo root: the test suite on CUDA, then the
# benchmarks whatever the tests did. Logs and results go to $OUT (bench/results when unset).
set -u -o pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
PYTHON="${PYTHON:-python3}"          # on the GPU image, plain python3 is the one with torch
OUT="${OUT:-bench/results}"
TESTS_TIMEOUT="${TESTS_TIMEOUT:-240}" # leave the benchmarks their minutes of the call
mkdir -p "$OUT"
# register the `fuser` torch.compile backend (entry point); no network there, so no deps, no isolation
"$PYTHON" -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1 || echo "pip install -e . failed"

FUSER_TEST_DEVICE=cuda timeout -s INT -k 15 "$TESTS_TIMEOUT" \
    "$PYTHON" -m pytest tests -q -n "${WORKERS:-8}" -p no:cacheprovider 2>&1 | tee "$OUT/tests.log" | grep -E "^FAILED|passed|failed"
tests_rc=$?

# BENCH_ARGS: e.g. "--rows norm,chain --budget 150"; ATTENTION=0 skips the attention bench
"$PYTHON" bench/bench.py --out "$OUT" ${BENCH_ARGS:-} 2>&1 | tee "$OUT/bench.log" | tail -15
bench_rc=$?
attention_rc=skipped
if [ "${ATTENTION:-1}" != 0 ]; then
    "$PYTHON" bench/attention_bench.py --out "$OUT" 2>&1 | tee "$OUT/attention.log" | tail -10
    attention_rc=$?
fi

echo "tests exit status: $tests_rc (124: stopped at ${TESTS_TIMEOUT} s); bench: $bench_rc; attention bench: $attention_rc"
exit $(( tests_rc != 0 ? tests_rc : bench_rc ))
