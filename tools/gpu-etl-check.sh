#!/usr/bin/env bash
# The ETL's GPU check, in one command, on the GPU machine (see docs/BENCHMARKS.md, "ETL on the GPU"):
#   preflight (versions, GPU, backend choice, libcudf's murmur3 convention) -> the cuDF-vs-pandas tests
#   -> bench etl --device cuda (cuDF / pandas-Dask / plain pandas) -> the ETL stage on cuDF -> CPU ETL tests.
# Every step logs to $OUT/NN-step.log; a failing or timed-out step is recorded in the summary printed at the end
# and the next step still runs. Steps share a time budget (CHECK_BUDGET_S) so the bench keeps its share.
#
#   PYTHONPATH=/tmp/site OUT=/tmp/out bash tools/gpu-etl-check.sh
#
# cuDF, dask-cuda, dask and distributed are expected as wheels already installed under /tmp/site
# (GPU.md, "cuDF there"); with RAPIDS_PARTS=DIR (the joined .rapids parts d0..dN, or part0..partN
# files) and no importable cuDF, this script joins and installs them there first.
# Knobs: ETL_GPU_TEST_ROWS (2000000), ETL_BENCH_ROWS (20000000), CHECK_BUDGET_S (570), PYTHON (python3),
# ETL_BENCH_ARGS (extra bench arguments, e.g. --no-baseline: plain pandas takes ~3 min of the 20M-row run),
# CHECK_STEPS (the steps to run, default "00 01 02 03 04 05").
set -o pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/gpu-etl-out}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
SITE=${SITE:-/tmp/site}
BUDGET=${CHECK_BUDGET_S:-570}
export PYTHONUNBUFFERED=1
case ":${PYTHONPATH:-}:" in *":$SITE:"*) ;; *) [ -d "$SITE" ] && export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}" ;; esac
summary=$(mktemp)  # printed at the end; $OUT keeps 8 files (6 logs, 2 JSON): what a device call brings back
: > "$summary"

step() {  # step NAME LIMIT_S COMMAND...: run with a timeout cut to the budget left; never fatal
  local name=$1 limit=$2; shift 2
  case " ${CHECK_STEPS:-00 01 02 03 04 05} " in *" ${name%%-*} "*) ;; *) return ;; esac
  local left=$((BUDGET - SECONDS - 5))
  if [ "$left" -lt 15 ]; then echo "$name: skipped (budget spent)" | tee -a "$summary"; return; fi
  [ "$limit" -gt "$left" ] && limit=$left
  local t0=$SECONDS rc
  echo "== $name (limit ${limit}s): $*" | tee "$OUT/$name.log"
  timeout --kill-after=10 "$limit" "$@" >> "$OUT/$name.log" 2>&1; rc=$?
  echo "$name: rc=$rc$([ $rc -eq 124 ] && echo ' (timed out)') in $((SECONDS - t0))s" | tee -a "$summary"
}

install_parts() {
  "$PY" -c "import cudf" 2>/dev/null && { echo "cudf already importable"; return 0; }
  [ -n "${RAPIDS_PARTS:-}" ] || { echo "cudf not importable and RAPIDS_PARTS not set"; return 1; }
  local work; work=$(mktemp -d)
  # shellcheck disable=SC2046
  cat $(ls -d "$RAPIDS_PARTS"/d*/part* "$RAPIDS_PARTS"/part* 2>/dev/null | sort -V) > "$work/all.tar"
  mkdir -p "$work/wheels" "$SITE" && tar xf "$work/all.tar" -C "$work/wheels" || return 1
  "$PY" -m pip install -q --no-index --no-deps --no-compile --target "$SITE" "$work"/wheels/*.whl
}

export -f install_parts; export PY SITE RAPIDS_PARTS
step 00-install 240 bash -c install_parts
step 01-preflight 90 "$PY" - <<'EOF'
import importlib, subprocess, sys
print(sys.version)
try:
    subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total,driver_version", "--format=csv"], check=False)
except OSError as err:
    print("nvidia-smi:", err)
for name in ["numpy", "pandas", "pyarrow", "torch", "cupy", "numba", "dask", "distributed", "dask_cuda", "cudf",
             "dask_cudf", "rmm", "pylibcudf", "pynvml", "yaml", "tqdm", "pytest", "mmh3"]:
    try:
        module = importlib.import_module(name)
        print(f"{name:12} {getattr(module, '__version__', '?')}")
    except Exception as err:
        print(f"{name:12} MISSING ({type(err).__name__}: {err})")
from pipeline.etl.frame_library import choose_frame_library
print("choose_frame_library(auto):", choose_frame_library("auto"))
from pipeline.etl.ops.hashing import cudf_single_column_offset
print("libcudf one-column murmur3 = mmh3 +", hex(cudf_single_column_offset()))
EOF
step 02-gpu-tests 180 env PIPELINE_ETL_GPU_ROWS="${ETL_GPU_TEST_ROWS:-2000000}" \
  "$PY" -m pytest -q -rs -p no:cacheprovider tests/test_etl_gpu.py
step 03-bench 400 "$PY" -m pipeline bench etl --device cuda --rows "${ETL_BENCH_ROWS:-20000000}" --workers 0 --repeats 2 \
  --json "$OUT/bench-etl.json" --report "$OUT/etl-tasks.json" ${ETL_BENCH_ARGS:-} workdir=/tmp/etl-bench
step 04-stage 60 "$PY" -m pipeline run etl --device cuda data.rows=500000 etl.cluster=local workdir=/tmp/etl-stage
step 05-cpu-tests 60 "$PY" -m pytest -q -p no:cacheprovider --continue-on-collection-errors tests/test_etl_ops.py tests/test_etl_workflow.py \
  tests/test_etl_frame_library.py tests/test_etl_stage.py
echo "== summary ($SECONDS s)"; cat "$summary"
