# One device call (about 10 minutes): the embedding GPU tests, the H200 step figures, the state probe, the sync tests.
export PYTHONPATH=/tmp/site:$PWD
t0=$(date +%s)
left() { echo $(( ${BUDGET:-585} - ($(date +%s) - t0) )); }
(KIT=.kit bash tools/gpu-check.sh setup > $OUT/setup.log 2>&1; tail -2 $OUT/setup.log)
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader); echo "$gpu setup $(( $(date +%s) - t0 )) s"
if [[ "$gpu" == *H200* ]]; then
  for ids in uniform zipf; do
    timeout 75 python -m pipeline bench embedding --device cuda --hots 1,20 --ids $ids --optimizer adagrad --no-baseline \
      --reps 10 --json $OUT/emb-$ids.json > $OUT/emb-$ids.log 2>&1
    grep -E "device-to-device|as a step|floor" $OUT/emb-$ids.log | cut -c1-300
  done
fi
t=$(left); timeout $(( t < 240 ? t : 240 )) python -m pytest -q -rs -m gpu -p no:cacheprovider tests/test_kernels_gpu.py > $OUT/kernels-tests.log 2>&1; tail -4 $OUT/kernels-tests.log
echo "tests done at $(( $(date +%s) - t0 )) s"
t=$(left); [ $t -gt 20 ] && timeout $(( t < 100 ? t : 100 )) python tools/update_probe/state.py > $OUT/state.log 2>&1; cut -c1-4000 $OUT/state.log
t=$(left); [ $t -gt 20 ] && timeout $t python -m pytest -q -rs -m gpu -p no:cacheprovider tests/test_train_syncs.py > $OUT/syncs.log 2>&1; tail -3 $OUT/syncs.log
echo "end at $(( $(date +%s) - t0 )) s"
