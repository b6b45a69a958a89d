#!/usr/bin/env bash
# SonicMoE for gallery/scripts/gpu_moe_layer.py on the GPU machine (python 3.12, torch 2.11 cu130, no network):
# the wheels unpacked into one site folder and packed as DEST/sonic-site.tar.xz (xz -9: 190 MB -> 53 MB, within a
# device call's 64 MiB carry beside the checkout; about 3 minutes on one core). sonic-moe declares torch <= 2.9.1:
# installed without its dependencies' checks (issue 41 call 4: it ran on torch 2.11). On the device:
#   mkdir -p /tmp/sonic && tar xJf DEST/sonic-site.tar.xz -C /tmp/sonic && export SONIC_SITE=/tmp/sonic/site
#   bash gallery/scripts/sonic_site.sh [DEST]      # default /work/main/.dev41 (git-ignored there)
set -eu
DEST=${1:-/work/main/.dev41}
W=$(mktemp -d); mkdir -p "$DEST" "$W/whl" "$W/site"
PLAT="--platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64
      --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64"
# nvidia-cutlass-dsl-libs-cu13 holds the whole DSL (the -base wheel is the CUDA 12 build of the same files)
for w in sonic-moe==0.1.2.post1 quack-kernels==0.3.11 nvidia-cutlass-dsl==4.4.2 nvidia-cutlass-dsl-libs-cu13==4.4.2 \
         apache-tvm-ffi==0.1.15.post2 torch-c-dlpack-ext==0.1.5; do
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp $PLAT \
    -d "$W/whl" "$w"
done
for w in "$W"/whl/*.whl; do python3 -m zipfile -e "$w" "$W/site"; done
tar cf - -C "$W" site | xz -9 -T1 > "$DEST/sonic-site.tar.xz"
rm -rf "$W"
ls -la "$DEST/sonic-site.tar.xz"
