#!/usr/bin/env bash
# Download exactly the wheels gallery/scripts/gpu_perf.sh needs on the GPU machine (python 3.12, torch 2.11, no
# network there) into DEST (default /work/main/.whl, git-ignored), then print the total size (keep it < ~40 MiB:
# a device call carries 64 MiB in all).
#   torchtitan 0.2.2 (+ the imports its model code pulls in: datasets<4.8 with dill and multiprocess, torchdata,
#   tyro with docstring_parser, typeguard and shtab, tomli) for the torchtitan peer;
#   torchao (float8 training, the FP8 peer): the release built against torch 2.11;
#   liger-kernel and cut-cross-entropy (backend.loss=liger / cce: pure-Python Triton kernels, 0.9 MB).
#   flash-attn-4 4.0.0b10 (gpu_attention.py, the attention part: FlashAttention-4's CuTe-DSL kernels, 1.4 MB; the
#   last release on QuACK 0.3 and CUTLASS DSL 4.4.2, SonicMoE's pins, which SONIC_TAR brings).
# moelab's own training path (moelab.train.trainer, moelab.train.bench) imports none of submitit / ipywidgets.
#   bash gallery/scripts/carry_wheels.sh [DEST]
set -eu
DEST=${1:-/work/main/.whl}
mkdir -p "$DEST"
PLAT="--platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64
      --platform manylinux2014_x86_64 --platform manylinux1_x86_64 --platform manylinux_2_24_x86_64"
WHEELS="torchtitan==0.2.2 datasets==4.7.0 dill==0.4.0 multiprocess==0.70.18 torchdata==0.11.0 tyro==0.9.35
        docstring_parser==0.17.0 typeguard==4.4.4 shtab==1.7.2 tomli==2.3.0 torchao==${TORCHAO:-0.17.0}
        liger-kernel==0.8.5 cut-cross-entropy==25.1.1 flash-attn-4==4.0.0b10"
for w in $WHEELS; do
  python3 -m pip download -q --pre --no-deps --only-binary=:all: --python-version 3.12 --implementation cp $PLAT \
    -d "$DEST" "$w" || echo "carry_wheels: could not download $w" >&2
done
ls -la "$DEST"
du -ch "$DEST"/*.whl | tail -1
