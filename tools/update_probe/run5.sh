# One device call: the row traffic's and the bench's GPU tests, the acceptance's embedding step figures (H200: both bag
# sizes and the lean kernel's ladder; else one-hot only).
export PYTHONPATH=/tmp/site:$PWD
t0=$(date +%s)
(KIT=.kit bash tools/gpu-check.sh setup > $OUT/setup.log 2>&1; tail -2 $OUT/setup.log)
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader); echo "$gpu setup $(( $(date +%s) - t0 )) s"
timeout 120 python -m pytest -q -rs -m gpu -p no:cacheprovider tests/test_kernels_gpu.py tests/test_bench.py \
  -k "row_traffic or bench_embedding" > $OUT/tests.log 2>&1; tail -3 $OUT/tests.log
hots=1; [[ "$gpu" == *H200* ]] && hots=1,20
for ids in uniform zipf; do
  timeout 90 python -m pipeline bench embedding --device cuda --hots $hots --ids $ids --optimizer adagrad --no-baseline \
    --reps 10 --json $OUT/emb-$ids.json > $OUT/emb-$ids.log 2>&1
  grep -E "device-to-device|back to back|floor|alone" $OUT/emb-$ids.log | cut -c1-400
done
echo "bench done at $(( $(date +%s) - t0 )) s"
if [[ "$gpu" == *H200* ]]; then
  timeout 120 python tools/update_probe/lean.py > $OUT/lean.log 2>&1; cut -c1-3000 $OUT/lean.log
  timeout 100 python tools/update_probe/kernels.py singles_apart > $OUT/kernels.log 2>&1; cut -c1-1500 $OUT/kernels.log
fi
echo "end at $(( $(date +%s) - t0 )) s"
