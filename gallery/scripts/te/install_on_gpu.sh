#!/usr/bin/env bash
# GPU side (run from the repo root in every call that carries a chunk): parks the carried chunks in /tmp/te; once
# all of them are there (the manifest says how many), reassembles the core wheel, checks its sha256, installs it
# and its needs into one --target folder, and installs the torch extension: from DIR/cache/ if a wheel built
# earlier was carried, else built from source (about 90 s on 16 cores for sm_90), its wheel copied to $OUT so that
# later calls can carry it in DIR/cache/ and skip the build. Afterwards: export PYTHONPATH=/tmp/tesite:$PYTHONPATH
# Usage: bash gallery/scripts/te/install_on_gpu.sh DIR [--park-only]   (exit 0 also while chunks are missing)
set -u
trap 'echo "exit $?"' EXIT
DIR=${1:?usage: install_on_gpu.sh DIR [--park-only]}; SITE=/tmp/tesite; P=/tmp/te
V=$(awk '$1=="version"{print $2}' "$DIR/manifest"); N=$(awk '$1=="chunks"{print $2}' "$DIR/manifest")
mkdir -p $P
for f in "$DIR"/chunks/part*; do [ -f "$f" ] && cp "$f" $P/; done
if [ -f $SITE/.te-ok ]; then echo "TE $V already installed in $SITE"; exit 0; fi
[ "${2:-}" = --park-only ] && { echo "TE: $(ls $P/part* | wc -l) of $N chunks parked in $P"; exit 0; }
have=$(ls $P/part* 2>/dev/null | wc -l)
if [ "$have" -lt "$N" ]; then echo "TE: $have of $N chunks parked in $P"; exit 0; fi
W=$P/$(awk '$1=="wheel"{print $2}' "$DIR/manifest")
cat $(ls $P/part* | sort) > "$W"
echo "$(awk '$1=="sha256"{print $2}' "$DIR/manifest")  $W" | sha256sum -c - || exit 3
# the core and its needs in one folder; the meta wheel's sources overlap the core's, so only its dist-info is kept
python3 -m pip install -q --no-index --no-deps --no-compile --target $SITE "$W" \
  $(ls "$DIR"/wheels/*.whl | grep -v "/transformer_engine-$V-") || exit 4
python3 -m pip install -q --no-index --no-deps --no-compile --target $P/meta "$DIR"/wheels/transformer_engine-$V-*.whl \
  && cp -r $P/meta/*.dist-info $SITE/ || exit 4
built=$(ls "$DIR"/cache/transformer_engine_torch-$V-*.whl 2>/dev/null | head -1)
if [ -z "$built" ]; then
  tar xzf "$DIR/transformer_engine_torch-$V.tar.gz" -C $P
  CUDNN=$(python3 -c "import nvidia, os; print(os.path.join(list(nvidia.__path__)[0], 'cudnn'))")
  t0=$(date +%s)
  ( cd $P/transformer_engine_torch-$V && PYTHONPATH=$SITE NVTE_CUDA_ARCHS=90 MAX_JOBS=16 NVTE_FRAMEWORK=pytorch \
    CUDNN_PATH=$CUDNN python3 -m pip wheel -q --no-index --no-deps --no-build-isolation -w $P/built . ) || exit 5
  built=$(ls $P/built/transformer_engine_torch-*.whl | head -1)   # gpu_te.sh measure brings it back
  echo "TE torch extension built in $(( $(date +%s) - t0 )) s: $(basename "$built")"
fi
# into its own folder, then copied: pip --target would skip (or, with --upgrade, replace) the core's folder
python3 -m pip install -q --no-index --no-deps --no-compile --target $P/torchsite "$built" && cp -r $P/torchsite/* $SITE/ || exit 5
PYTHONPATH=$SITE python3 -c "import transformer_engine.pytorch as te; print('TE', te.__version__ if hasattr(te, '__version__') else '', 'imports')" \
  && touch $SITE/.te-ok
