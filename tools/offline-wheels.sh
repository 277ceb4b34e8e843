#!/usr/bin/env bash
# Wheels for a GPU machine without network access, one that already has Python with CUDA torch, numpy,
# pandas and pyarrow (an NGC PyTorch container, a cloud GPU image). Run it where PyPI is reachable:
#
#   tools/offline-wheels.sh DIR [PYTHON_VERSION] [PART_MB [FOLDER_MB]]   # PYTHON_VERSION: the GPU machine's, 3.12
#
#   DIR/base/    what `python -m pipeline` and the tests need beside that Python's own packages
#                (dask, distributed, pyyaml, tqdm, tritonclient, pytest, mmh3, ...)
#   DIR/models/  the served models' environment: numpy<2 (Triton's python-backend stub is built against
#                numpy 1.x), pandas 2.2, pip, setuptools, and nvidia-pytriton for the tritonserver binary
#
# With PART_MB, each folder is also put in a tar cut into parts of at most PART_MB MiB, and the parts, in order,
# into folders DIR/d0, DIR/d1, ... of at most FOLDER_MB MiB each (default PART_MB: one part a folder), for a
# transfer that limits the size of what it carries. `30 60`: d0/base.tar.1-of-1 with d0/models.tar.1-of-3,
# then d1/models.tar.2-of-3 and d1/models.tar.3-of-3. `cat` a tar's parts in order to get it back.
#
# On the GPU machine (README, "GPU machines"):
#   pip install --no-index --no-deps --target SITE DIR/base/*.whl && export PYTHONPATH=SITE
#   make serve-env MODELS_TORCH=system PIP_OPTIONS="--no-index --find-links DIR/models --find-links DIR/base"
set -euo pipefail
dir=${1:?usage: tools/offline-wheels.sh DIR [PYTHON_VERSION] [PART_MB]}
version=${2:-3.12}
part_mb=${3:-}
folder_mb=${4:-$part_mb}
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
  rm -rf "$dir"/d[0-9]* "$dir"/*.tar
  i=0 used=0
  for set in base models; do
    tar cf "$dir/$set.tar" -C "$dir" "$set"
    split -b "${part_mb}M" -d -a 2 "$dir/$set.tar" "$dir/$set.tar.part"
    parts=("$dir/$set.tar.part"*)
    for k in "${!parts[@]}"; do
      size=$(stat -c %s "${parts[$k]}")
      if [ "$used" -gt 0 ] && [ $((used + size)) -gt $((folder_mb * 1048576)) ]; then i=$((i + 1)) used=0; fi
      mkdir -p "$dir/d$i" && mv "${parts[$k]}" "$dir/d$i/$set.tar.$((k + 1))-of-${#parts[@]}"
      used=$((used + size))
    done
    rm "$dir/$set.tar"
  done
  echo "parts of at most $part_mb MiB in folders of at most $folder_mb MiB: $(cd "$dir" && ls d*/* | tr '\n' ' ')"
fi
