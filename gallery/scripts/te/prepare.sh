#!/usr/bin/env bash
# CPU side of bringing Transformer Engine to a GPU machine that has no network (the device machine; see
# gallery/scripts/te/README.md). Downloads TE for the GPU image (Python 3.12, torch 2.11 + CUDA 13) into DIR, an
# ignored folder of the repo, splits the core wheel (about 276 MB) into chunks that fit one call's carry limit, and
# writes a manifest (chunk names and the core wheel's sha256). On a cluster with network none of this is needed:
#   pip install --no-build-isolation "transformer_engine[pytorch,core_cu13]"
# Usage: bash gallery/scripts/te/prepare.sh DIR [CHUNK_BYTES]
set -euo pipefail
DIR=${1:?usage: prepare.sh DIR [CHUNK_BYTES]}; CHUNK=${2:-55000000}; V=${TE_VERSION:-2.20.2}
mkdir -p "$DIR/chunks" "$DIR/wheels" "$DIR/cache"
PLAT="--only-binary=:all: --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64"
T=$(mktemp -d); trap 'rm -rf "$T"' EXIT
python3 -m pip download -q --no-deps $PLAT -d "$T" "transformer-engine-cu13==$V"
# The meta package (TE's import checks that a 'transformer-engine' distribution exists) and TE's pure-Python needs.
for p in "transformer-engine==$V" pydantic pydantic-core annotated-types typing-inspection importlib-metadata; do
  python3 -m pip download -q --no-deps $PLAT -d "$DIR/wheels" "$p"
done
# transformer-engine-torch is an sdist only and its metadata step needs CUDA: keep pip's unpacked source instead.
python3 -m pip download --no-clean --no-deps --no-build-isolation --no-binary=transformer-engine-torch \
  -d "$T" "transformer-engine-torch==$V" >/dev/null 2>&1 || true
src=$(ls -d /tmp/pip-download-*/transformer-engine-torch_* 2>/dev/null | head -1)
[ -n "$src" ] || { echo "prepare.sh: the transformer-engine-torch source was not unpacked" >&2; exit 1; }
rm -rf "$src"/*.egg-info; mv "$src" "$T/transformer_engine_torch-$V"; rm -rf "$(dirname "$src")"
tar czf "$DIR/transformer_engine_torch-$V.tar.gz" -C "$T" "transformer_engine_torch-$V"
W=$(ls "$T"/transformer_engine_cu13-*.whl)
rm -f "$DIR"/chunks/part*
(cd "$DIR/chunks" && split -b "$CHUNK" -d -a 1 "$W" part)
{ echo "version $V"; echo "wheel $(basename "$W")"; echo "sha256 $(sha256sum "$W" | awk '{print $1}')";
  echo "chunks $(ls "$DIR/chunks" | wc -l)"; } > "$DIR/manifest"
cat "$DIR/manifest"; du -sh "$DIR"/chunks/* "$DIR/wheels" "$DIR"/*.tar.gz
echo "carry $DIR/chunks/partN one per call (with $DIR/manifest), and $DIR/wheels, $DIR/*.tar.gz, $DIR/cache in the last"
