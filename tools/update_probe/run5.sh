# One device call: the GPU tests of the row traffic, the bench and the update kernel training runs; each kernel's time
# in a step; the acceptance's embedding step figures (H200: both bag sizes, then the lean kernel's ladder; else one-hot).
export PYTHONPATH=/tmp/site:$PWD
t0=$(date +%s)
(KIT=.kit bash tools/gpu-check.sh setup > $OUT/setup.log 2>&1; tail -2 $OUT/setup.log)
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader); echo "$gpu setup $(( $(date +%s) - t0 )) s"
timeout 150 python -m pytest -q -rs -m gpu -p no:cacheprovider tests/test_kernels_gpu.py tests/test_bench.py \
  -k "row_traffic or bench_embedding or singles_apart" > $OUT/tests.log 2>&1; tail -3 $OUT/tests.log
echo "tests done at $(( $(date +%s) - t0 )) s"
timeout 60 python tools/update_probe/kernels.py singles_apart > $OUT/kernels.log 2>&1; cut -c1-1500 $OUT/kernels.log
hots=1; [[ "$gpu" == *H200* ]] && hots=1,20
for ids in uniform zipf; do
  timeout 90 python -m pipeline bench embedding --device cuda --hots $hots --ids $ids --optimizer adagrad --no-baseline \
    --reps 10 --json $OUT/emb-$ids.json > $OUT/emb-$ids.log 2>&1
  grep -E "device-to-device|back to back|floor|alone" $OUT/emb-$ids.log | cut -c1-400
done
echo "bench done at $(( $(date +%s) - t0 )) s"
[[ "$gpu" == *H200* ]] && { timeout 60 python tools/update_probe/lean.py > $OUT/lean.log 2>&1; cut -c1-3000 $OUT/lean.log; }
echo "end at $(( $(date +%s) - t0 )) s"
