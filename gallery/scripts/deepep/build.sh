#!/usr/bin/env bash
# GPU side of DeepEP from its source (gallery/scripts/deepep/README.md), run from the repo root on the GPU machine
# with DIR (made by prepare.sh, default .deepep) carried:
#
#   bash gallery/scripts/deepep/build.sh build [DIR]   # build the wheel (sm_90, MAX_JOBS=16) into /tmp/deepep/dist
#   bash gallery/scripts/deepep/build.sh check [DIR]   # install the wheel, self-check, then check.py (2 GPUs: the
#                                                      # comparison with all_to_all; 1 GPU: import and 1-rank Buffer)
#   bash gallery/scripts/deepep/build.sh all [DIR]     # both (the default)
#
# The build runs in the background (its own process session), so a build longer than one call goes on after the
# call returns: the same command again within the machine's warm period (30 s) waits for it. Each call that ends
# before the build does leaves $OUT/objects.tar.gz.part* (ninja's objects and log): put them in DIR/cache/, carry DIR,
# and a fresh machine resumes from those objects. A finished build leaves the wheel in $OUT (DIR/cache/ next time:
# no rebuild), and a failed one $OUT/build.log and $OUT/build-failure.json with the compiler's errors.
# Environment: DEEPEP_NVSHMEM=0 (default: intranode kernels only, what backend.dispatcher=deepep uses) or 1 (also
# the internode and low-latency kernels, against the nvidia-nvshmem pip package; needs rdma-core's
# infiniband/mlx5dv.h), DEEPEP_WAIT_S (default 480: how long a call waits for the build), MAX_JOBS (16),
# TORCH_CUDA_ARCH_LIST (9.0), DEEPEP_REBUILD=1 (build again after a failure on this machine). NVLink multicast
# stays off (NCCL_NVLS_ENABLE=0 etc.).
set -u
MODE=${1:-all}; DIR=${2:-.deepep}; ROOT=$(pwd)
OUTD=${OUT:-/tmp/deepep-out}; mkdir -p "$OUTD"
export B=${DEEPEP_BUILD_DIR:-/tmp/deepep}  # fixed: ninja resumes only where every command line is the one in its log
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0} MAX_JOBS=${MAX_JOBS:-16}
NVSHMEM=${DEEPEP_NVSHMEM:-0}; WAIT=${DEEPEP_WAIT_S:-480}
field() { awk -v k="$1" '$1==k{print $2}' "$DIR/manifest"; }
cached_wheel() {  # a wheel carried in DIR/cache, whole or in the parts a call brought back (prints its path)
  local w; w=$(ls "$DIR"/cache/deep_ep-*.whl 2>/dev/null | head -1)
  if [ -z "$w" ] && ls "$DIR"/cache/deep_ep-*.whl.part* >/dev/null 2>&1; then
    w=$(ls "$DIR"/cache/deep_ep-*.whl.part0); w=$(basename "${w%.part0}"); mkdir -p "$B/cached"
    cat $(ls "$DIR"/cache/"$w".part* | sort) > "$B/cached/$w"; w=$B/cached/$w
  fi
  echo "$w"
}

probe() {  # what the image offers DeepEP's build (the answer to "does the pip package ship what it links?")
  python3 - <<'EOF'
import glob, os, shutil, sys
import torch
print("python", sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda,
      "gpus", torch.cuda.device_count(), torch.cuda.get_device_name(0) if torch.cuda.is_available() else "")
print("nvcc", shutil.which("nvcc"), "CUDA_HOME", os.environ.get("CUDA_HOME", ""))
try:
    import nvidia.nvshmem as n
    root = list(n.__path__)[0]
except ImportError:
    root = None
print("nvshmem pip package:", root)
for pat in ("include/nvshmem.h", "include/nvshmemx.h", "include/device_host_transport/nvshmem_common_ibgda.h",
            "lib/libnvshmem_device.a", "lib/libnvshmem_host.so*", "lib/nvshmem_bootstrap_uid.so*"):
    print(f"  {pat}: {sorted(os.path.basename(p) for p in glob.glob(os.path.join(root or '/nonexistent', pat)))}")
print("infiniband/mlx5dv.h:", [p for p in ("/usr/include/infiniband/mlx5dv.h",) if os.path.exists(p)])
print("libcuda stubs:", glob.glob("/usr/local/cuda*/lib64/stubs/libcuda.so") + glob.glob("/usr/local/cuda*/targets/*/lib/stubs/libcuda.so"))
EOF
}

unpack() {  # the source into $B/src (archive mtimes kept), patched for the mode; carried objects restored
  local archive; archive="$DIR/$(field archive)"
  echo "$(field sha256)  $archive" | sha256sum -c - || { echo "build.sh: $archive does not match $DIR/manifest"; return 3; }
  rm -rf "$B/src" && mkdir -p "$B/src" && tar xzf "$archive" -C "$B/src" --strip-components=1 || return 3
  if ls "$DIR"/cache/objects.tar.gz* >/dev/null 2>&1; then  # whole, or the parts a call brought back
    cat $(ls "$DIR"/cache/objects.tar.gz* | sort) | tar xzf - -C "$B/src" && echo "build.sh: resuming from $DIR/cache/objects.tar.gz*"
  fi
  if [ "$NVSHMEM" = 0 ]; then
    # Intranode kernels only: setup.py's own no-NVSHMEM mode (-DDISABLE_NVSHMEM, no internode sources), which it
    # takes when it finds no NVSHMEM; and no relocatable device code, which would need a device-link step that this
    # mode does not add (DeepEP issue 429: "undefined symbol: __cudaRegisterLinkedBinary_..._intranode_cu").
    unset NVSHMEM_DIR
    sed -i 's/importlib.util.find_spec("nvidia.nvshmem").submodule_search_locations\[0\]/None.submodule_search_locations[0]/; s/'"'"'-rdc=true'"'"', //' "$B/src/setup.py"
    if ! grep -q "None.submodule_search_locations" "$B/src/setup.py" || grep -q "rdc=true" "$B/src/setup.py"; then
      echo "build.sh: this DeepEP's setup.py does not take the intranode-only patch (is it commit $(field commit)?)"; return 3
    fi
    # That mode still calls three low-latency kernels (the shrink-mode mask buffer) outside its #ifndef
    # DISABLE_NVSHMEM guards, so the module would not import ("undefined symbol: ...update_mask_buffer..."):
    # guard them as the other low-latency entry points are.
    python3 - "$B/src/csrc/deep_ep.cpp" <<'PY' || return 3
import re, sys
path = sys.argv[1]
src = open(path).read()
pattern = re.compile(r"(void Buffer::low_latency_(?:update|query|clean)_mask_buffer\([^)]*\) \{\n)(.*?)(\n\}\n)", re.S)
new, n = pattern.subn(lambda m: m.group(1) + "#ifndef DISABLE_NVSHMEM\n" + m.group(2) + "\n#else\n    EP_HOST_ASSERT("
                      "false and \"NVSHMEM is disabled during compilation\");\n#endif" + m.group(3), src)
if n != 3:
    sys.exit(f"build.sh: expected the 3 mask-buffer functions in {path}, found {n}")
open(path, "w").write(new)
print("build.sh: guarded the 3 mask-buffer functions for the intranode-only build")
PY
  fi
  grep -n "submodule_search_locations\|rdc=true\|register-usage" "$B/src/setup.py"
}

start_build() {
  unpack || return $?
  local stubs; stubs=$(ls -d /usr/local/cuda*/lib64/stubs /usr/local/cuda*/targets/*/lib/stubs 2>/dev/null | tr '\n' ':')
  local cccl; cccl=$(ls -d /usr/local/cuda*/include/cccl 2>/dev/null | head -1)
  rm -f "$B/rc"; mkdir -p "$B/dist"
  # -lcuda links against the driver stub; CUDA 13 keeps CCCL's headers under include/cccl.
  ( cd "$B/src" && LIBRARY_PATH="${stubs}${LIBRARY_PATH:-}" CPATH="${cccl}${CPATH:+:$CPATH}" setsid nohup bash -c \
    'python3 -m pip wheel -v --no-deps --no-build-isolation --no-index -w "$B/dist" . > "$B/build.log" 2>&1; echo $? > "$B/rc"' \
    < /dev/null > /dev/null 2>&1 & )
  date -u +%s > "$B/started"
  echo "build.sh: DeepEP $(field commit | cut -c1-7) building in the background (NVSHMEM=$NVSHMEM, MAX_JOBS=$MAX_JOBS, arch $TORCH_CUDA_ARCH_LIST); log $B/build.log"
}

report_failure() {
  grep -n -E "error|Error|undefined|No such file|fatal" "$B/build.log" | grep -v -E "^\s*$|Werror|error_|_error|-Wno" | head -40 > "$B/errors.txt"
  python3 - "$B/errors.txt" "$OUTD/build-failure.json" "$(field commit)" "$NVSHMEM" <<'EOF'
import json, sys, time
errors = open(sys.argv[1]).read().splitlines()
json.dump({"kind": "backend-build", "package": f"DeepEP {sys.argv[3]} (GitHub source)", "built": False,
           "nvshmem": sys.argv[4] == "1", "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
           "command": "bash gallery/scripts/deepep/build.sh build", "errors": errors}, open(sys.argv[2], "w"), indent=1)
EOF
  echo "build.sh: BUILD FAILED (rc $(cat "$B/rc")); the compiler's errors:"; cat "$B/errors.txt"
  echo "--- last lines of the log"; tail -25 "$B/build.log"
}

do_build() {
  probe > "$OUTD/probe.txt" 2>&1; cat "$OUTD/probe.txt"
  if [ -n "$(cached_wheel)" ]; then echo "build.sh: a built wheel is carried: $(cached_wheel)"; return 0; fi
  if [ -f "$B/rc" ] && [ "$(cat "$B/rc")" = 0 ] && ls "$B"/dist/deep_ep-*.whl >/dev/null 2>&1; then
    echo "build.sh: already built on this machine"
  elif [ -f "$B/rc" ] && [ -z "${DEEPEP_REBUILD:-}" ]; then
    echo "build.sh: the build on this machine has failed already (DEEPEP_REBUILD=1 tries again)"
    cp "$B/build.log" "$OUTD/build.log"; report_failure; return 1
  elif [ ! -f "$B/started" ] || [ -f "$B/rc" ]; then
    start_build || return $?
  else
    echo "build.sh: a build started $(( $(date -u +%s) - $(cat "$B/started") )) s ago is still running: waiting"
  fi
  local t0; t0=$(date -u +%s)
  while [ ! -f "$B/rc" ] && [ $(( $(date -u +%s) - t0 )) -lt "$WAIT" ]; do sleep 5; done
  cp "$B/build.log" "$OUTD/build.log" 2>/dev/null
  if [ ! -f "$B/rc" ]; then
    [ -d "$B/src/build" ] && ( cd "$B/src" && tar czf - build | split -b 15000000 -d -a 1 - "$OUTD/objects.tar.gz.part" )
    echo "build.sh: still building after ${WAIT} s ($(grep -c '\[[0-9]*/[0-9]*\]' "$B/build.log") ninja steps logged). Run the same command again within 30 s to wait on;"
    echo "          on a fresh machine, put this call's objects.tar.gz.part* in $DIR/cache/ first."
    tail -5 "$B/build.log"; return 0
  fi
  [ "$(cat "$B/rc")" = 0 ] || { report_failure; return 1; }
  local whl; whl=$(ls "$B"/dist/deep_ep-*.whl | head -1)
  echo "build.sh: built $(basename "$whl") ($(du -h "$whl" | cut -f1)) in $(( $(date -u +%s) - $(cat "$B/started") )) s"
  if [ "$(stat -c %s "$whl")" -le 16000000 ]; then cp "$whl" "$OUTD/"
  else (cd "$OUTD" && split -b 15000000 -d -a 1 "$whl" "$(basename "$whl").part"); echo "build.sh: the wheel comes back in parts: put them in $DIR/cache/"; fi
}

do_check() {
  local whl; whl=$(cached_wheel); [ -n "$whl" ] || whl=$(ls "$B"/dist/deep_ep-*.whl 2>/dev/null | head -1)
  [ -n "$whl" ] || { echo "build.sh check: no wheel in $DIR/cache/ or $B/dist/: run build first"; return 4; }
  rm -rf /tmp/deepep-site
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/deepep-site "$whl" || return 4
  if ls .whl/*.whl >/dev/null 2>&1; then  # moelab's own pure-Python needs, where the lead carries them
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl > /tmp/pip-site.log 2>&1
  fi
  export PYTHONPATH=/tmp/deepep-site:/tmp/site:$ROOT
  python3 -c "import deep_ep, torch; print('deep_ep imports from', deep_ep.__file__, '; sm90 kernels:', deep_ep.Buffer.is_sm90_compiled())" \
    || { echo "build.sh check: deep_ep does not import"; return 5; }
  timeout "${DEEPEP_CHECK_TIMEOUT:-480}" python3 gallery/scripts/deepep/check.py --out "$OUTD" ${DEEPEP_CHECK_ARGS:-}
}

case $MODE in
  build) do_build ;;
  check) do_check ;;
  all) do_build && if [ -f "$B/rc" ] || [ -n "$(cached_wheel)" ]; then do_check; fi ;;
  *) echo "usage: build.sh build|check|all [DIR]"; exit 2 ;;
esac
