#!/usr/bin/env bash
# Wheels for a GPU machine without network access, one that already has Python with CUDA torch, numpy,
# pandas and pyarrow (an NGC PyTorch container, a cloud GPU image). Run it where PyPI is reachable:
#
#   tools/offline-wheels.sh DIR [PYTHON_VERSION] [PART_MB]     # PYTHON_VERSION: the GPU machine's, 3.12 by default
#
#   DIR/base/    what `python -m pipeline` and the tests need beside that Python's own packages
#                (dask, distributed, pyyaml, tqdm, tritonclient, pytest, mmh3, ...)
#   DIR/models/  the served models' environment: numpy<2 (Triton's python-backend stub is built against
#                numpy 1.x), pandas 2.2, pip, setuptools, and nvidia-pytriton for the tritonserver binary
#
# With PART_MB, DIR/wheels.tar is also cut into DIR/d0/part0, DIR/d1/part1, ... of at most PART_MB MiB
# each, for a transfer that limits the size of what it carries (each folder also says how many parts there
# are, in `count`); `cat` them in order to get the tar back.
#
# On the GPU machine (README, "GPU machines"):
#   pip install --no-index --no-deps --target SITE DIR/base/*.whl && export PYTHONPATH=SITE
#   make serve-env MODELS_TORCH=system PIP_OPTIONS="--no-index --find-links DIR/models --find-links DIR/base"
set -euo pipefail
dir=${1:?usage: tools/offline-wheels.sh DIR [PYTHON_VERSION] [PART_MB]}
version=${2:-3.12}
part_mb=${3:-}
pip=${PIP:-python3 -m pip}
platform=(--only-binary=:all: --python-version "$version" --implementation cp --platform any
          --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64
          --platform manylinux_2_35_x86_64)
mkdir -p "$dir/base" "$dir/models"
# The machine's own numpy, pandas, pyarrow and torch stay: they are built for its CUDA and for each other.
$pip download -q "${platform[@]}" -d "$dir/base" "dask[dataframe]>=2024.12" "distributed>=2024.12" "pyyaml>=6" \
  "tqdm>=4.60" "tritonclient[http,grpc]>=2.40" "pytest>=8" "pytest-timeout>=2.2" "mmh3>=4"
rm -f "$dir"/base/{numpy,pandas,pyarrow,torch}-*.whl
$pip download -q "${platform[@]}" -d "$dir/models" "numpy>=1.24,<2" "pandas>=2.2,<2.3" pip "setuptools>=68"
$pip download -q "${platform[@]}" --no-deps -d "$dir/models" "nvidia-pytriton>=0.7,<0.8"
echo "$dir/base: $(ls "$dir/base" | wc -l) wheels, $(du -sh "$dir/base" | cut -f1)"
echo "$dir/models: $(ls "$dir/models" | wc -l) wheels, $(du -sh "$dir/models" | cut -f1)"
if [ -n "$part_mb" ]; then
  rm -rf "$dir"/wheels.tar "$dir"/d[0-9]*
  tar cf "$dir/wheels.tar" -C "$dir" base models
  split -b "${part_mb}M" -d -a 1 "$dir/wheels.tar" "$dir/part"
  i=0
  for part in "$dir"/part[0-9]; do mkdir -p "$dir/d$i" && mv "$part" "$dir/d$i/part$i"; i=$((i + 1)); done
  for ((j = 0; j < i; j++)); do echo "$i" > "$dir/d$j/count"; done
  echo "$dir/wheels.tar in $i parts of at most $part_mb MiB: $dir/d0 .. $dir/d$((i - 1))"
fi
