#!/usr/bin/env bash
# The GPU checks, on a GPU machine, by group: tests against their references and the benchmarks of
# docs/BENCHMARKS.md, each step logged to <step>.log (its figures and profiles beside it) in CHECK_LOGS, and
# at the end all of it packed into $OUT/gpu-check.tgz with the summary in $OUT/summary.txt (two files: a
# transfer that brings back few files gets everything).
#
#   OUT=/tmp/out bash tools/gpu-check.sh GROUP...
#
# Groups, in the order given:
#   setup      install the wheels of tools/offline-wheels.sh (parts found under KIT/d*, gathered in
#              KIT_STORE as they arrive over several calls; each set installed once all its parts are
#              there: base into SITE, the served models' environment into MODELS_ENV with the machine's
#              torch) and cuDF from RAPIDS_PARTS
#   preflight  versions, the GPU, what --device auto picks
#   warm       every kernel source compiled for the GPU into the kernels' disk cache, all at once (a fresh machine
#              otherwise compiles each at its first launch, one after the other, inside the first benchmark's time)
#   kernels    every `-m gpu` test but serving, ETL and the embedding kernels' (hash table, dynamic and
#              host-cached tables, syncs of a training step, the embedding store)
#   embedding  the embedding kernels' GPU tests (every update kernel), then bench embedding's sweep of the
#              update kernels against the byte floor, uniform and Zipf ids
#   train      bench train at the MLPerf shape, Zipf and uniform ids, row-wise Adagrad
#   dense      tools/dense_profile.py: DLRM's and DCNv2's dense parts alone at the MLPerf shape, by kind of kernel, and
#              DCNv2's with train.compile=max-autotune
#   dynamic    bench train --dynamic, Zipf and uniform ids, 26 tables of DYNAMIC_ROWS (1,000,000) rows of capacity
#   hostcache  the host-cached tables' GPU tests, then bench train --embedding-budget-mb: 26 x 2M rows under 8 GiB
#   hostcache-large  the same at 26 x 5M rows (62 GiB of tables) under a quarter of them (a call of its own)
#   host-copies  tools/host_copies.py: rows between device and host memory (row kernel against copy engines) out of a
#              host table of HOST_COPY_ROWS (38,000,000: 19.5 GB, the 19 host tables of `hostcache`)
#   serve      the GPU serving tests, then bench serve --device cuda, the chain of three models and the fused one
#   serve-parts  the GPU tests of the served parts that need no server: the dense part's CUDA graphs (those that gather
#              a GPU cache's rows too), the GPU caches, the workflow on the GPU and the whole batch as one graph
#   serve-profile  bench serve --device cuda of the fused model, tools/ranker_profile.py on its export (its
#              phases in one process, its GPU cache's rows gathered before the dense part and in its graph), then
#              tools/serve_profile.py on its export: where a
#              request's time goes (client, transport and Triton, the python backend, the model's work), with the
#              instances as exported, one instance, and each on a core of its own (--pin)
#   serve-latency  the GPU serving tests, bench serve --device cuda of the fused model, then tools/serve_profile.py
#              on its export at batch 1 and 32, with the instances as exported and with one, and
#              tools/instance_layouts.py: 8 instances taken in turn, 8 by priority, one
#   loader     bench loader on 8M synthetic rows, LZ4 pages and uncompressed (etl.compression)
#   loader-split  bench loader on the ETL's split of E2E_ROWS rows (run etl, once, as e2e), the cudf reader beside the
#              pyarrow one where cuDF imports; then the loader's GPU tests
#   mlp        the MLP op's GPU tests (cuBLASLt's forward epilogue and the mask kernel against the reference), then
#              tools/dense_profile.py of DLRM's and DCNv2's dense parts with their MLPs through torch and through
#              cuBLASLt, in turn
#   e2e        run etl of E2E_ROWS (10,000,000) synthetic rows (once), then bench e2e of each model on it (E2E_STEPS
#              timed steps, 100) with each train.mlp_backend of E2E_MLP_BACKENDS (torch) in turn, and of DCNv2 with
#              train.compile=max-autotune (E2E_AUTOTUNE= leaves it out)
#   quality    the same split (made once, as e2e), then run train of each model of QUALITY_MODELS (dlrm dcnv2 deepfm
#              wide_deep) on it, with QUALITY_SETTINGS (e.g. train.mlp_backend=cublaslt): its test AUC against the
#              oracle's (docs/BENCHMARKS.md, Model quality)
#   etl        the data stage's GPU tests (the CuPy text readers against the CPU's), the cuDF-vs-pandas tests,
#              tools/etl_profile.py --backend cudf (one partition's steps), the ETL stage on cuDF, bench data's
#              Criteo TSV and CSV table readers (CuPy against the CPU's)
#   etl-bench  bench etl --device cuda: cuDF against every CPU core and plain pandas (a call of its own)
#   etl-variants  tools/etl_variants.py: the cuDF side of bench etl as is, with one worker a GPU, and with one worker
#              of two threads, a cluster and a report each (the same rows as etl-bench)
#   etl-trace  tools/etl_gpu_trace.py: each cuDF worker's GPU work in one fit and one transform+write (CUPTI), the
#              client's hottest functions (the same rows as etl-bench)
#   criteo-scale  tools/criteo_scale.py: SCALE_ROWS (100,000,000) rows of Criteo TSV through the data and ETL stages
#              on the GPU, each stage timed with its memory peaks, a sample compared with the CPU's (a call of its own)
# A step that fails or runs out of time is recorded and the next one runs. All steps share one time
# budget (CHECK_BUDGET_S, 560 s by default: under a ten-minute limit on one command).
# Knobs: PYTHON (python3), SITE (/tmp/site), KIT (.kit), KIT_STORE (/root/kit), MODELS_ENV
# (/tmp/venv-triton), RAPIDS_PARTS, E2E_WORKDIR (/tmp/e2e), E2E_MODELS (dlrm dcnv2 deepfm wide_deep), E2E_ROWS,
# E2E_STEPS, E2E_MLP_BACKENDS, E2E_AUTOTUNE, QUALITY_MODELS, QUALITY_SETTINGS, E2E_ETL_SETTINGS (settings for that split's run etl, e.g. etl.row_group_rows=65536,
# with an E2E_WORKDIR of its own), DYNAMIC_ROWS, ETL_BENCH_ARGS, ETL_PROFILE_ROWS, SERVE_ARGS (extra settings for bench serve, e.g. export.instances=4).
set -o pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/gpu-check-out}
W=${CHECK_LOGS:-/tmp/gpu-check}
PY=${PYTHON:-python3}
SITE=${SITE:-/tmp/site}
KIT=${KIT:-.kit}
KIT_STORE=${KIT_STORE:-/root/kit}
MODELS_ENV=${MODELS_ENV:-/tmp/venv-triton}
BUDGET=${CHECK_BUDGET_S:-560}
mkdir -p "$OUT" "$SITE" "$W"
export PYTHONUNBUFFERED=1 PYTHONPATH="$SITE:$PWD${PYTHONPATH:+:$PYTHONPATH}" PIPELINE_TRITON_ENV="$MODELS_ENV"
summary=$(mktemp)

step() {  # step NAME LIMIT_S COMMAND...: run with a timeout cut to the budget left; never fatal
  local name=$1 limit=$2; shift 2
  local left=$((BUDGET - SECONDS - 5))
  if [ "$left" -lt 15 ]; then echo "$name: skipped (budget spent)" | tee -a "$summary"; return; fi
  [ "$limit" -gt "$left" ] && limit=$left
  local t0=$SECONDS rc
  echo "== $name (limit ${limit}s): $*" | tee "$W/$name.log"
  timeout --kill-after=10 "$limit" "$@" >> "$W/$name.log" 2>&1; rc=$?
  echo "$name: rc=$rc$([ $rc -eq 124 ] && echo ' (timed out)') in $((SECONDS - t0))s" | tee -a "$summary"
  tail -n 3 "$W/$name.log"
}

install_kit() {  # gather the parts that came; install each set (base, models) once all its parts are there
  mkdir -p "$KIT_STORE"
  cp -n "$KIT"/d*/*.tar.*-of-* "$KIT_STORE"/ 2>/dev/null
  local set parts want
  for set in base models; do
    [ -f "$KIT_STORE/$set.installed" ] && { echo "$set: installed"; continue; }
    parts=$(ls "$KIT_STORE/$set".tar.*-of-* 2>/dev/null | wc -l)
    want=$(ls "$KIT_STORE/$set".tar.*-of-* 2>/dev/null | head -1 | sed 's/.*-of-//')
    echo "$set: $parts of ${want:-?} parts here"
    [ -n "$want" ] && [ "$parts" -eq "$want" ] || continue
    [ "$set" = models ] && [ ! -f "$KIT_STORE/base.installed" ] && continue  # its find-links need base
    # shellcheck disable=SC2046
    cat $(ls "$KIT_STORE/$set".tar.*-of-* | sort -V) | tar x -C "$KIT_STORE" || return 1
    if [ "$set" = base ]; then
      "$PY" -m pip install -q --no-index --no-deps --no-compile --target "$SITE" "$KIT_STORE"/base/*.whl || return 1
    else
      # the models' environment holds all it needs: the server's stub does not see PYTHONPATH
      env -u PYTHONPATH make serve-env MODELS_TORCH=system PYTHON="$PY" TRITON_VENV="$MODELS_ENV" \
        PIP_OPTIONS="--no-index --find-links $KIT_STORE/models --find-links $KIT_STORE/base" || return 1
    fi
    touch "$KIT_STORE/$set.installed"
  done
}

install_rapids() {
  "$PY" -c "import cudf" 2>/dev/null && { echo "cudf importable"; return 0; }
  [ -n "${RAPIDS_PARTS:-}" ] || { echo "cudf not importable and RAPIDS_PARTS not set"; return 0; }
  local work; work=$(mktemp -d)
  # shellcheck disable=SC2046
  cat $(ls -d "$RAPIDS_PARTS"/d*/part* "$RAPIDS_PARTS"/part* 2>/dev/null | sort -V) > "$work/all.tar"
  tar xf "$work/all.tar" -C "$work" && "$PY" -m pip install -q --no-index --no-deps --no-compile --target "$SITE" \
    $(find "$work" -name '*.whl')
}

e2e_split() {  # the synthetic split of e2e, quality and loader-split: E2E_ROWS rows in E2E_WORKDIR, made once
  w=${E2E_WORKDIR:-/tmp/e2e}
  rows=${E2E_ROWS:-10000000}
  [ -f "$w/synthetic/processed/schema.json" ] || step e2e-etl 420 "$PY" -m pipeline run etl --device cpu \
    workdir="$w" data.size=1.0 data.rows="$rows" $E2E_ETL_SETTINGS
}

mlperf=(--device cuda --preset mlperf --batch 65536)
for group in "$@"; do
  case $group in
    setup)
      export -f install_kit install_rapids; export PY SITE KIT KIT_STORE MODELS_ENV RAPIDS_PARTS
      step setup-kit 300 bash -c install_kit
      step setup-rapids 240 bash -c install_rapids ;;
    preflight)
      step preflight 90 "$PY" -c "
import importlib, subprocess, sys
print(sys.version)
try:
    subprocess.run(['nvidia-smi', '--query-gpu=name,memory.total,driver_version', '--format=csv'], check=False)
except OSError as err:
    print('nvidia-smi:', err)
for name in ['numpy', 'pandas', 'pyarrow', 'torch', 'cupy', 'dask', 'distributed', 'dask_cuda', 'cudf', 'yaml',
             'tqdm', 'pytest', 'mmh3', 'tritonclient']:
    try:
        print(f'{name:12}', getattr(importlib.import_module(name), '__version__', '?'))
    except Exception as err:
        print(f'{name:12} MISSING ({type(err).__name__}: {err})')
from pipeline.device import resolve_device
print('--device auto:', resolve_device('auto'))
" ;;
    warm)
      step warm 240 "$PY" -c "
import concurrent.futures, pathlib, time, torch
from pipeline.kernels._compile import cached_cubin
root = pathlib.Path('pipeline/kernels')
sources = sorted(str(p.relative_to(root)) for p in root.rglob('*.cu'))
arch = 'sm_%d%d' % torch.cuda.get_device_capability(0)
start = time.time()
with concurrent.futures.ProcessPoolExecutor() as pool:
    for name, path in zip(sources, pool.map(cached_cubin, sources, [arch] * len(sources))):
        print(f'{name}: {path}')
print(f'{len(sources)} sources in {time.time() - start:.0f} s')
" ;;
    kernels)
      step kernels-tests 420 "$PY" -m pytest -q -rs -m gpu -p no:cacheprovider --continue-on-collection-errors tests \
        --ignore=tests/test_serve_gpu.py --ignore=tests/test_etl_gpu.py --ignore=tests/test_notebooks.py \
        --ignore=tests/test_kernels_gpu.py ;;
    embedding)
      step embedding-tests 360 "$PY" -m pytest -q -rs -m gpu -p no:cacheprovider tests/test_kernels_gpu.py
      for ids in uniform zipf; do
        step "embedding-sweep-$ids" 150 "$PY" -m pipeline bench embedding --device cuda --hots 1,20 --ids "$ids" \
          --optimizer adagrad --no-baseline --sweep-update-kernels all
      done ;;
    train)
      for ids in uniform zipf; do
        step "train-$ids" 150 "$PY" -m pipeline bench train "${mlperf[@]}" --rows 1000000 --ids "$ids" \
          --optimizer adagrad --steps 20 --rounds 3 --json "$W/train-$ids/result.json"
      done ;;
    mlp)
      step mlp-tests 240 "$PY" -m pytest -q -rs -m gpu -p no:cacheprovider tests/test_kernels_mlp.py
      for model in dlrm dcnv2; do
        for backend in torch cublaslt; do
          step "mlp-dense-$model-$backend" 100 "$PY" tools/dense_profile.py --model "$model" --device cuda \
            --batch 65536 --pooled-dtype bfloat16 --steps 60 --warmup 10 --mlp-backend "$backend" --profile 5 \
            --json "$W/mlp-dense-$model-$backend.json"
          grep -h "samples/s" "$W/mlp-dense-$model-$backend.log" | head -1 | tee -a "$summary"
        done
      done ;;
    dense)
      for model in dlrm dcnv2; do
        step "dense-$model" 150 "$PY" tools/dense_profile.py --model "$model" --device cuda --batch 65536 --profile 5 \
          --json "$W/dense-$model.json"
      done
      step dense-dcnv2-autotune 300 "$PY" tools/dense_profile.py --model dcnv2 --device cuda --batch 65536 \
        --compile max-autotune --profile 5 --json "$W/dense-dcnv2-autotune.json" ;;
    dynamic)
      for ids in zipf uniform; do
        step "dynamic-$ids" 200 "$PY" -m pipeline bench train "${mlperf[@]}" --ids "$ids" --dynamic \
          --rows "${DYNAMIC_ROWS:-1000000}" --profile 5 --json "$W/dynamic-$ids/result.json"
      done ;;
    hostcache)
      step hostcache-tests 300 "$PY" -m pytest -q -rs -m gpu -p no:cacheprovider tests/test_modules_host_cache.py \
        tests/test_train_host_cache.py tests/test_train_syncs.py tests/test_distributed_pipeline.py
      step hostcache-2m 240 "$PY" -m pipeline bench train "${mlperf[@]}" --rows 2000000 --ids zipf --optimizer adagrad \
        --embedding-budget-mb 8192 --warmup 30 --steps 20 --rounds 3 --profile 5 --json "$W/hostcache-2m/result.json" ;;
    hostcache-large)
      # 26 x 5M rows x dim 128: 62 GiB of fp32 tables, in host memory for the host-cached model and in device
      # memory for the other; a quarter of it is the host-cached model's device budget
      step hostcache-5m 420 "$PY" -m pipeline bench train "${mlperf[@]}" --rows 5000000 --ids zipf --optimizer adagrad \
        --embedding-budget-mb 15872 --warmup 100 --steps 20 --rounds 3 --json "$W/hostcache-5m/result.json" ;;
    host-copies)
      step host-copies 240 "$PY" tools/host_copies.py --rows "${HOST_COPY_ROWS:-38000000}" --json "$W/host-copies.json" ;;
    serve)
      step serve-tests 240 "$PY" -m pytest -q -rs -p no:cacheprovider tests/test_serve_gpu.py
      for fuse in none all; do
        # shellcheck disable=SC2086
        step "serve-$fuse" 200 "$PY" -m pipeline bench serve --device cuda --batches 1,32,64,1024 --requests 200 \
          --clients 16 --throughput-batch 1024 --seconds 5 --json "$W/serve-$fuse.json" export.fuse="$fuse" \
          workdir=/tmp/serve-bench ${SERVE_ARGS:-}
      done ;;
    serve-latency)
      step serve-tests 240 "$PY" -m pytest -q -rs -p no:cacheprovider tests/test_serve_gpu.py
      # shellcheck disable=SC2086
      step serve-ranker 200 "$PY" -m pipeline bench serve --device cuda --batches 1,32,64,1024 --requests 200 \
        --clients 16 --throughput-batch 1024 --seconds 5 --json "$W/serve-ranker.json" export.fuse=all \
        --workdir /tmp/serve-profile ${SERVE_ARGS:-}
      for instances in 0 1; do
        step "serve-profile-$instances" 120 "$PY" tools/serve_profile.py \
          --export "$(ls -d /tmp/serve-profile/*/export | head -1)" --batches 1,32 --requests 200 --rounds 2 \
          --instances "$instances" --json "$W/serve-profile-$instances.json"
      done
      step instance-layouts 200 "$PY" tools/instance_layouts.py --export "$(ls -d /tmp/serve-profile/*/export | head -1)" \
        --layouts 8:turn,8:priority,1:turn --batches 1,32 --clients 16 ;;
    serve-parts)
      step serve-parts-tests 150 "$PY" -m pytest -q -rs -m gpu -p no:cacheprovider tests/test_dense_gpu.py \
        tests/test_export_store.py tests/test_export_device_preprocess.py tests/test_export_device_ranker.py ;;
    serve-profile)
      # shellcheck disable=SC2086
      step serve-ranker 200 "$PY" -m pipeline bench serve --device cuda --batches 1,32,64,1024 --requests 200 \
        --clients 16 --throughput-batch 1024 --seconds 5 --json "$W/serve-ranker.json" export.fuse=all \
        --workdir /tmp/serve-profile ${SERVE_ARGS:-}
      step ranker-profile 120 "$PY" tools/ranker_profile.py --export "$(ls -d /tmp/serve-profile/*/export | head -1)" \
        --device cuda --gather both --batches 1,32,1024 --calls 200 --json "$W/ranker-profile.json"
      step serve-profile 150 "$PY" tools/serve_profile.py --export "$(ls -d /tmp/serve-profile/*/export | head -1)" \
        --batches 1,32,1024 --requests 200 --rounds 2 --json "$W/serve-profile.json"
      step serve-profile-1 150 "$PY" tools/serve_profile.py --export "$(ls -d /tmp/serve-profile/*/export | head -1)" \
        --batches 1,32 --requests 200 --rounds 2 --instances 1 --json "$W/serve-profile-1.json"
      step serve-profile-pinned 150 "$PY" tools/serve_profile.py --export "$(ls -d /tmp/serve-profile/*/export | head -1)" \
        --batches 1,32,1024 --requests 200 --rounds 2 --pin --json "$W/serve-profile-pinned.json" ;;
    e2e)
      e2e_split
      for model in ${E2E_MODELS:-dlrm dcnv2 deepfm wide_deep}; do
        for backend in ${E2E_MLP_BACKENDS:-torch}; do
          name=e2e-$model$([ "$backend" = torch ] || echo "-$backend")
          step "$name" 150 "$PY" -m pipeline bench e2e --device cuda --batch 65536 --steps "${E2E_STEPS:-100}" \
            --warmup 20 workdir="$w" data.size=1.0 data.rows="$rows" train.model="$model" train.mlp_backend="$backend" \
            --out "$W/$name"
        done
      done
      [ -n "${E2E_AUTOTUNE-1}" ] && step e2e-dcnv2-autotune 400 "$PY" -m pipeline bench e2e --device cuda --batch 65536 \
        --steps "${E2E_STEPS:-100}" --warmup 20 workdir="$w" data.size=1.0 data.rows="$rows" train.model=dcnv2 \
        train.compile=max-autotune --out "$W/e2e-dcnv2-autotune" ;;
    quality)
      e2e_split
      for model in ${QUALITY_MODELS:-dlrm dcnv2 deepfm wide_deep}; do
        # shellcheck disable=SC2086
        step "quality-$model" 300 "$PY" -m pipeline run train --device cuda workdir="$w" data.size=1.0 \
          data.rows="$rows" train.model="$model" progress=off $QUALITY_SETTINGS
        grep -h "test AUC" "$W/quality-$model.log" | tail -1 | tee -a "$summary"
      done ;;
    loader)
      # the loader alone on 8M synthetic rows as the ETL writes them, LZ4 pages (the default) and plain ones
      for packing in lz4 none; do
        step "loader-$packing" 150 "$PY" -m pipeline bench loader --device cuda --rows 8000000 --batch-size 65536 \
          --epochs 2 etl.compression="$packing" workdir=/tmp/loader-bench
      done ;;
    loader-split)
      # the loader alone on the ETL's split of E2E_ROWS rows (made once, as e2e makes it): both readers where cuDF
      # imports; then the loader's GPU tests
      e2e_split
      step loader-split 240 "$PY" -m pipeline bench loader --device cuda --data "$w/synthetic/processed/train" \
        --batch-size 65536 --epochs 3
      step loader-tests 180 "$PY" -m pytest -q -rs -p no:cacheprovider -m gpu tests/test_loader.py ;;
    etl)
      step data-tests 150 "$PY" -m pytest -q -rs -p no:cacheprovider -m gpu tests/test_data_vectorized_text.py \
        tests/test_data_nearest_double.py \
        tests/test_data_vectorized_table.py tests/test_data_readers.py tests/test_data_stage.py
      step etl-tests 180 env PIPELINE_ETL_GPU_ROWS="${ETL_GPU_TEST_ROWS:-2000000}" \
        "$PY" -m pytest -q -rs -p no:cacheprovider tests/test_etl_gpu.py
      step etl-profile 150 "$PY" tools/etl_profile.py --backend cudf --rows "${ETL_PROFILE_ROWS:-5000000}" \
        --json "$W/etl-profile.json" --workdir /tmp/etl-profile --python-profile "$W/etl-python-profile.txt"
      step etl-stage 60 "$PY" -m pipeline run etl --device cuda data.rows=500000 etl.cluster=local workdir=/tmp/etl-stage
      step etl-tsv 150 "$PY" -m pipeline bench data --rows 1000000 --ingest-rows "${TSV_ROWS:-2000000}" device=cuda \
        workdir=/tmp/tsv-bench ;;
    criteo-scale)
      step criteo-scale 560 "$PY" tools/criteo_scale.py --rows "${SCALE_ROWS:-100000000}" --device cuda \
        --workdir /tmp/criteo-scale --json "$W/criteo-scale.json" ;;
    etl-bench)
      # shellcheck disable=SC2086
      step etl-bench 540 "$PY" -m pipeline bench etl --device cuda --rows "${ETL_BENCH_ROWS:-20000000}" --workers 0 \
        --repeats 2 --json "$W/bench-etl.json" --report "$W/etl-tasks.json" ${ETL_BENCH_ARGS:-} workdir=/tmp/etl-bench ;;
    etl-variants)
      step etl-variants 540 "$PY" tools/etl_variants.py --rows "${ETL_BENCH_ROWS:-20000000}" --repeats 3 \
        --workdir /tmp/etl-bench --json "$W/etl-variants.json" --report "$W/etl-variants" "as is:" \
        "one worker a GPU:etl.workers_per_gpu=1" "one worker, two threads:etl.workers_per_gpu=1 etl.gpu_threads=2" ;;
    etl-trace)
      step etl-trace 300 "$PY" tools/etl_gpu_trace.py --rows "${ETL_BENCH_ROWS:-20000000}" --workdir /tmp/etl-bench \
        --out "$W/etl-trace" ;;
    *) echo "unknown group $group (setup preflight warm kernels embedding train mlp dense dynamic hostcache hostcache-large host-copies serve serve-parts serve-profile serve-latency loader loader-split e2e quality etl etl-bench etl-variants etl-trace criteo-scale)"; exit 2 ;;
  esac
done
echo "== summary ($SECONDS s)"; cat "$summary"
cp "$summary" "$OUT/summary.txt" && cp "$summary" "$W/summary.txt"
tar czf "$OUT/gpu-check.tgz" -C "$W" .
