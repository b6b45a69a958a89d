"""gallery/scripts/deepep on CPU: prepare.sh packs a DeepEP commit with a manifest build.sh checks (the files'
mtimes kept, the figures left out), and build.sh, where no CUDA is, patches setup.py into its intranode-only build,
then records the build's failure with the error."""
import json
import os
import subprocess
import tarfile
from pathlib import Path

import pytest

SCRIPTS = Path(__file__).resolve().parents[2] / "gallery" / "scripts" / "deepep"
MIRROR = Path("/work/.mirror/deepseek-ai+DeepEP/repo")  # where the fetch tool leaves DeepEP's repository
HAS_COMMIT = MIRROR.exists() and subprocess.run(["git", "--git-dir", str(MIRROR), "cat-file", "-e", "567632d^{commit}"],
                                                capture_output=True).returncode == 0


def git(repo, *args):
    return subprocess.run(["git", "-C", str(repo), *args], check=True, capture_output=True, text=True).stdout.strip()


def test_prepare_packs_the_commit_with_its_manifest(tmp_path):
    repo = tmp_path / "DeepEP"
    (repo / "csrc").mkdir(parents=True)
    (repo / "figures").mkdir()
    (repo / "setup.py").write_text("print('setup')\n")
    (repo / "csrc" / "intranode.cu").write_text("// kernels\n")
    (repo / "figures" / "normal.png").write_bytes(b"\x89PNG" * 1000)
    git(tmp_path, "init", "-q", str(repo))
    git(repo, "add", ".")
    env = {**os.environ, "GIT_AUTHOR_DATE": "2026-02-03T07:51:00Z", "GIT_COMMITTER_DATE": "2026-02-03T07:51:00Z"}
    subprocess.run(["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "x"],
                   check=True, env=env)
    sha = git(repo, "rev-parse", "HEAD")
    out = tmp_path / ".deepep"
    subprocess.run(["bash", str(SCRIPTS / "prepare.sh"), str(out), str(repo)], check=True, capture_output=True,
                   env={**os.environ, "DEEPEP_COMMIT": "HEAD"})
    manifest = dict(line.split(" ", 1) for line in (out / "manifest").read_text().splitlines())
    assert manifest["commit"] == sha and manifest["archive"] == f"DeepEP-{sha[:7]}.tar.gz"
    archive = out / manifest["archive"]
    digest = subprocess.run(["sha256sum", str(archive)], capture_output=True, text=True).stdout.split()[0]
    assert manifest["sha256"] == digest
    with tarfile.open(archive) as tar:
        names = tar.getnames()
        assert f"DeepEP-{sha[:7]}/setup.py" in names and f"DeepEP-{sha[:7]}/csrc/intranode.cu" in names
        assert not any("figures" in n for n in names)
        assert tar.getmember(f"DeepEP-{sha[:7]}/setup.py").mtime == 1770105060  # the commit's time
    assert (out / "cache").is_dir()


@pytest.mark.skipif(not HAS_COMMIT, reason="DeepEP's repository (commit 567632d) is not on this machine")
def test_build_patches_the_intranode_build_and_records_a_failure(tmp_path):
    dp = tmp_path / ".deepep"
    subprocess.run(["bash", str(SCRIPTS / "prepare.sh"), str(dp), str(MIRROR)], check=True, capture_output=True)
    env = {**os.environ, "OUT": str(tmp_path / "out"), "DEEPEP_BUILD_DIR": str(tmp_path / "b"),
           "DEEPEP_WAIT_S": "240"}
    env.pop("CUDA_HOME", None)
    r = subprocess.run(["bash", str(SCRIPTS / "build.sh"), "build", str(dp)], capture_output=True, text=True,
                       env=env, timeout=400)
    log = (tmp_path / "b" / "build.log").read_text()
    sources = next(line for line in log.splitlines() if "> Sources:" in line)
    assert "intranode.cu" in sources and "internode" not in sources  # NVSHMEM off: intranode kernels only
    flags = next(line for line in log.splitlines() if "> Compilation flags:" in line)
    assert "-DDISABLE_NVSHMEM" in flags and "-rdc=true" not in flags  # no device link needed
    if r.returncode:  # no CUDA here: the failure is recorded with the error
        failure = json.loads((tmp_path / "out" / "build-failure.json").read_text())
        assert failure["built"] is False and any("CUDA" in e for e in failure["errors"])
        assert "BUILD FAILED" in r.stdout
