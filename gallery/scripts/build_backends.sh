#!/usr/bin/env bash
# Build the switchboard's optional CUDA packages, grouped_gemm and deep_ep, as wheels from their PyPI sdists with
# nvcc: works offline (e.g. on a cluster's compute node or the GPU machine), needs torch, nvcc and, for DeepEP,
# the nvidia-nvshmem-cu12/cu13 wheel installed.
#
#   pip download --no-deps --no-binary grouped_gemm,deep-ep grouped_gemm==0.3.0 deep-ep==1.0.0 -d sdist
#   (pip may fail after downloading while it prepares metadata without a GPU; the .tar.gz files are what we need:
#    fetch them where pip works, or pass --no-clean and repack the unpacked trees)
#   gallery/scripts/build_backends.sh sdist wheels all      # then: pip install wheels/*.whl
#
# deep_ep: superseded by gallery/scripts/deepep/ (DeepEP from its source repository, intranode-only).
# The PyPI sdist of deep-ep 1.0.0 ships no headers (csrc/*.hpp, kernels/*.cuh) and cannot build
# (gallery/results/deepep-build-failure.json); put a tarball of DeepEP's source repository in SDIST_DIR instead
# (named deep_ep-<version>.tar.gz, one top folder), e.g. made with `git archive --prefix=deep_ep-1.0.0/`.
# Environment: TORCH_CUDA_ARCH_LIST (default 9.0), MAX_JOBS (default 8), NVSHMEM_DIR (default: the pip wheel's).
set -uo pipefail
SDIST=$(realpath "${1:-.whl/sdist}")
mkdir -p "${2:-wheels}"; OUT=$(realpath "${2:-wheels}")
WHICH=${3:-all}
export TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0}
export MAX_JOBS=${MAX_JOBS:-8}
PY=${PYTHON:-python3}
status=0

build_grouped_gemm() {
  local tmp; tmp=$(mktemp -d)
  tar xzf "$SDIST"/grouped_gemm-*.tar.gz -C "$tmp" || return 1
  (cd "$tmp"/grouped_gemm-* && $PY -m pip wheel --no-deps --no-build-isolation -w "$OUT" .)
}

build_deep_ep() {
  local tmp nv; tmp=$(mktemp -d)
  nv=${NVSHMEM_DIR:-$($PY -c "import nvidia.nvshmem as n; print(list(n.__path__)[0])" 2>/dev/null)}
  if [ -z "$nv" ] || [ ! -d "$nv" ]; then
    echo "deep_ep: no NVSHMEM found: pip install nvidia-nvshmem-cu13 (or cu12), or set NVSHMEM_DIR"; return 1
  fi
  echo "deep_ep: NVSHMEM_DIR=$nv"; ls "$nv/lib"
  tar xzf "$SDIST"/deep_ep-*.tar.gz -C "$tmp" || return 1
  cd "$tmp"/deep_ep-* || return 1
  # DeepEP 1.0.0 links a source-built NVSHMEM (libnvshmem.a); the pip wheel ships libnvshmem_host.so.3 and
  # libnvshmem_device.a instead, and versioned bootstrap plugins.
  local host dev boot
  host=$(cd "$nv/lib" && ls libnvshmem_host.so* 2>/dev/null | head -1)
  dev=$(cd "$nv/lib" && ls libnvshmem_device.a 2>/dev/null | head -1)
  boot=$(cd "$nv/lib" && ls nvshmem_bootstrap_uid.so* 2>/dev/null | head -1)
  if [ -n "$host" ] && [ -n "$dev" ]; then
    sed -i "s|'-l:libnvshmem.a'|'-l:$host', '-l:$dev'|; s|'-lnvshmem'\]|'-lnvshmem_device']|; s|'-l:nvshmem_bootstrap_uid.so'|'-l:${boot:-nvshmem_bootstrap_uid.so}'|" setup.py
    grep -n "nvshmem" setup.py
  fi
  NVSHMEM_DIR="$nv" $PY -m pip wheel --no-deps --no-build-isolation -w "$OUT" .
}

for pkg in grouped_gemm deep_ep; do
  if [ "$WHICH" = all ] || [ "$WHICH" = "$pkg" ]; then
    echo "=== building $pkg ($(date -u +%T))"
    if (build_$pkg); then echo "=== $pkg: built ($(date -u +%T))"; else echo "=== $pkg: BUILD FAILED"; status=1; fi
  fi
done
ls -la "$OUT"
exit $status
