# One device call (H200 wanted): the acceptance's embedding step figures with the corrected rows-alone rate, the lean
# kernel's ladder, each kernel's time in a step, the forward's order.
export PYTHONPATH=/tmp/site:$PWD
t0=$(date +%s)
(KIT=.kit bash tools/gpu-check.sh setup > $OUT/setup.log 2>&1; tail -2 $OUT/setup.log)
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader); echo "$gpu setup $(( $(date +%s) - t0 )) s"
timeout 200 python -m pytest -q -rs -m gpu -p no:cacheprovider tests/test_bench.py tests/test_kernels_gpu.py -k "bench_embedding or singles_apart or row_traffic" > $OUT/tests.log 2>&1
tail -2 $OUT/tests.log
for ids in uniform zipf; do
  timeout 90 python -m pipeline bench embedding --device cuda --hots 1,20 --ids $ids --optimizer adagrad --no-baseline \
    --reps 10 --json $OUT/emb-$ids.json > $OUT/emb-$ids.log 2>&1
  grep -E "device-to-device|back to back|floor|alone" $OUT/emb-$ids.log | cut -c1-400
done
echo "bench done at $(( $(date +%s) - t0 )) s"
timeout 60 python tools/update_probe/forward.py > $OUT/forward.log 2>&1; cat $OUT/forward.log
timeout 60 python tools/update_probe/lean.py > $OUT/lean.log 2>&1; cut -c1-3000 $OUT/lean.log
timeout 60 python tools/update_probe/kernels.py singles_apart > $OUT/kernels.log 2>&1; cut -c1-1500 $OUT/kernels.log
echo "end at $(( $(date +%s) - t0 )) s"
