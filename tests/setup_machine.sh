#!/usr/bin/env bash
# Machine set-up for the whole test suite on Debian/Ubuntu as root: Debian's chromium (the real-browser test;
# Playwright's own browser download does not work offline), the local single-node SLURM cluster, and beside it
# the two-node cluster of tests/launch/test_two_nodes.py (two slurmd in their own network namespaces).
set -euo pipefail
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
if ! command -v chromium >/dev/null 2>&1; then
  export DEBIAN_FRONTEND=noninteractive
  apt-get -o DPkg::Lock::Timeout=600 update -qq
  apt-get -o DPkg::Lock::Timeout=600 install -y -qq --no-install-recommends chromium >/dev/null
fi
bash "$HERE/slurm/local/start.sh"
bash "$HERE/slurm/local/start-two-nodes.sh"
