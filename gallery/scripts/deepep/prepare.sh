#!/usr/bin/env bash
# CPU side of building DeepEP on a GPU machine without network (gallery/scripts/deepep/README.md): packs DeepEP's
# source at a pinned commit into DIR (a git-ignored folder of the repo, default .deepep), small enough to travel
# with one device call (carry DIR), with a manifest (commit, archive name, sha256) that build.sh checks there.
#
#   bash gallery/scripts/deepep/prepare.sh [DIR] [DEEPEP_GIT_DIR]
#
# DEEPEP_GIT_DIR: a clone of github.com/deepseek-ai/DeepEP (default: $DEEPEP_SRC, else the mirror that the fetch
# tool leaves in /work/.mirror/deepseek-ai+DeepEP/repo, else a `git clone` where there is network).
# DEEPEP_COMMIT (default 567632d, the last commit before EPv2, 2026-02-03): DeepEP 1.2.1's Python API (deep_ep.Buffer,
# get_dispatch_layout / dispatch / combine) with setup.py's intranode-only build (no NVSHMEM, no submodules).
# EPv2 (b306af0 on) needs the fmt submodule and NCCL's device API besides NVSHMEM.
set -euo pipefail
DIR=${1:-.deepep}
COMMIT=${DEEPEP_COMMIT:-567632d}
SRC=${2:-${DEEPEP_SRC:-/work/.mirror/deepseek-ai+DeepEP/repo}}
mkdir -p "$DIR/cache"
if ! git --git-dir="$SRC" rev-parse -q --verify "$COMMIT^{commit}" >/dev/null 2>&1 \
   && ! git -C "$SRC" rev-parse -q --verify "$COMMIT^{commit}" >/dev/null 2>&1; then
  echo "prepare.sh: no DeepEP commit $COMMIT in $SRC; cloning github.com/deepseek-ai/DeepEP" >&2
  SRC=$(mktemp -d)/DeepEP
  git clone -q https://github.com/deepseek-ai/DeepEP "$SRC"
fi
GIT=(git --git-dir="$SRC"); "${GIT[@]}" rev-parse -q --verify "$COMMIT^{commit}" >/dev/null 2>&1 || GIT=(git -C "$SRC")
FULL=$("${GIT[@]}" rev-parse "$COMMIT^{commit}")
NAME=DeepEP-${FULL:0:7}
rm -f "$DIR"/DeepEP-*.tar.gz
# The figures (1.2 MB of PNG) are left out; tar keeps the commit's time as every file's mtime, which build.sh
# relies on to resume a build from carried objects (ninja rebuilds what is older than its sources).
"${GIT[@]}" archive --format=tar --prefix="$NAME/" "$FULL" -- . ':(exclude)figures' | gzip -n > "$DIR/$NAME.tar.gz"
{ echo "commit $FULL"; echo "archive $NAME.tar.gz"; echo "sha256 $(sha256sum "$DIR/$NAME.tar.gz" | awk '{print $1}')"
} > "$DIR/manifest"
cat "$DIR/manifest"
du -sh "$DIR"
echo "carry $DIR (with any wheel or objects.tar.gz that came back, put in $DIR/cache/)"
