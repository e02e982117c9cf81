#!/usr/bin/env bash
# One device call: the CUDA test suite, then bench.py's rows (tables to $OUT). Run from the repo root.
set -u -o pipefail
export PYTHONUNBUFFERED=1
OUT="${OUT:-bench/results}"; mkdir -p "$OUT"
python -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1 || echo "pip install -e . failed"
FUSER_TEST_DEVICE=cuda timeout -s INT -k 15 "${TESTS_TIMEOUT:-330}" python -m pytest tests -q -n 12 -p no:cacheprovider \
    > "$OUT/tests.log" 2>&1
echo "tests rc=$?"; grep -E "^FAILED|^ERROR|passed|failed" "$OUT/tests.log" | tail -25
python bench/bench.py --out "$OUT" --budget "${BENCH_BUDGET:-150}" ${ROWS:+--rows "$ROWS"} > "$OUT/bench.log" 2>&1
echo "bench rc=$?"; tail -16 "$OUT/bench.log"
