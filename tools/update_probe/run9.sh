# The update with four gradient rows in flight in the apart kernel: its GPU tests, then the acceptance's figures.
export PYTHONPATH=/tmp/site:$PWD
t0=$(date +%s)
(KIT=.kit bash tools/gpu-check.sh setup > $OUT/setup.log 2>&1; tail -2 $OUT/setup.log)
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader); echo "$gpu setup $(( $(date +%s) - t0 )) s"
timeout 240 python -m pytest -q -rs -m gpu -p no:cacheprovider tests/test_bench.py tests/test_kernels_gpu.py -k "bench_embedding or singles_apart or row_traffic or zipf_hot" > $OUT/tests.log 2>&1
tail -3 $OUT/tests.log; grep -E "^(FAILED|ERROR)" $OUT/tests.log | head -5
echo "tests done at $(( $(date +%s) - t0 )) s"
for ids in uniform zipf; do
  timeout 90 python -m pipeline bench embedding --device cuda --hots 1,20 --ids $ids --optimizer adagrad --no-baseline \
    --reps 10 --json $OUT/emb-$ids.json > $OUT/emb-$ids.log 2>&1
  grep -E "device-to-device|back to back|floor|alone" $OUT/emb-$ids.log | cut -c1-400
done
echo "end at $(( $(date +%s) - t0 )) s"
