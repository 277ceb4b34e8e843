export PYTHONPATH=/tmp/site:$PWD
(KIT=.kit bash tools/gpu-check.sh setup > $OUT/setup.log 2>&1; tail -1 $OUT/setup.log)
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader); echo "$gpu"
timeout 110 python tools/update_probe/state.py > $OUT/state.log 2>&1; cut -c1-1200 $OUT/state.log
if [[ "$gpu" == *H200* ]]; then
  for ids in uniform zipf; do
    timeout 70 python -m pipeline bench embedding --device cuda --hots 1,20 --ids $ids --optimizer adagrad --no-baseline \
      --reps 10 --json $OUT/emb-$ids.json > $OUT/emb-$ids.log 2>&1
    grep -E "device-to-device|as a step" $OUT/emb-$ids.log | cut -c1-300
  done
fi
