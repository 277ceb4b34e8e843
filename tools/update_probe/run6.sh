# A short device call: the GPU tests of the row traffic, the bench and the update kernel training runs, then each
# kernel's time in a step (the segment lists' compaction).
export PYTHONPATH=/tmp/site:$PWD
t0=$(date +%s)
(KIT=.kit bash tools/gpu-check.sh setup > $OUT/setup.log 2>&1; tail -2 $OUT/setup.log)
nvidia-smi --query-gpu=name --format=csv,noheader
timeout 150 python -m pytest -q -rs -m gpu -p no:cacheprovider tests/test_kernels_gpu.py tests/test_bench.py \
  -k "row_traffic or bench_embedding or singles_apart" > $OUT/tests.log 2>&1; tail -3 $OUT/tests.log
echo "tests done at $(( $(date +%s) - t0 )) s"
timeout 50 python tools/update_probe/kernels.py singles_apart > $OUT/kernels.log 2>&1; cut -c1-1500 $OUT/kernels.log
echo "end at $(( $(date +%s) - t0 )) s"
