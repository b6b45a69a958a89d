"""Records (or recomputes) the golden training figures of the tiny preset: the loss and routing counts of every
step, on 1 process and on 2 gloo processes with EP=2. The fixture golden_losses.json was written by this script
from the code before the second architecture move (main at 932bbce, which computed the first move's fixture's
losses and routing to the bit; its gradient norms and aux losses differed in the last bits there, with another
processor's MKL reductions); test_golden_losses.py recomputes the figures with
today's code and asserts they are bit-identical. Both fixtures were rewritten once since (--write), when the local
dispatcher's routing weights moved before the experts' down projection: the order of the operations changed, the
1-process scalars by at most 2 float32 ulps, no routing count; the EP=2 path did not change (its chunked figures
were rewritten as the recording machine computes them, within one ulp of the earlier record).

    python tests/train/golden_losses.py            # print today's figures as JSON
    python tests/train/golden_losses.py --write    # rewrite tests/train/golden_losses.json (only on purpose)
    python tests/train/golden_losses.py --loss chunked --write   # rewrite golden_losses_chunked.json

Two fixtures, one per LM-head loss (backend.loss): golden_losses.json holds the figures of the code before the
move, and `backend.loss=full` (today's path for that loss) must still reproduce them bit for bit;
golden_losses_chunked.json holds the default fused loss's figures (moelab.backends.loss), recorded at the commit
that made it the default. They differ from full's in the last bits (fp32 rounding: the loss summed per token and
the head's gradients formed per chunk), so the default has its own record.

Only two stable surfaces are used, so the same script runs against the old and the new layout of the package:
moelab.config (load_config, save_config) and the rank entry point `python -m moelab.launch.entry RUN_DIR`, started
with torchrun's environment. Every rank runs on one CPU thread (OMP_NUM_THREADS=1), so the figures do not depend
on the machine's core count, and on the same kernels whatever the processor (ATEN_CPU_CAPABILITY=default: ATen's
portable kernels rather than its AVX2 / AVX512 ones; MKL_CBWR=COMPATIBLE: MKL's reproducible code path), so they do
not depend on its vector width either (an AMD EPYC with AVX512 computed other last bits than the machine that wrote
the fixture until these were set).
"""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).parent
FIXTURE = HERE / "golden_losses.json"
# backend.loss -> (fixture, overrides added to OVERRIDES); full's override is left out of the fixture's record,
# which predates the option
LOSSES = {"full": (FIXTURE, ["backend.loss=full"]), "chunked": (HERE / "golden_losses_chunked.json", [])}
# Every routing feature that crosses ranks: aux and z losses, capacity dropping, the aux-loss-free bias.
OVERRIDES = ["train.steps=4", "train.seq_len=32", "train.global_batch_size=8", "train.micro_batch_size=2",
             "train.warmup_steps=1", "train.device=cpu", "model.moe.z_loss_coeff=0.001",
             "model.moe.capacity_factor=1.25", "model.moe.bias_update_rate=0.01"]
LAYOUTS = {"1proc": (1, []), "ep2": (2, ["parallel.ep=2"])}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_layout(name: str, run_dir: Path, loss: str = "full") -> dict:
    """Train layout `name` in `run_dir` with LM-head loss `loss`; return its per-step figures."""
    from moelab.config import load_config, save_config

    nproc, layout = LAYOUTS[name]
    run_dir.mkdir(parents=True, exist_ok=True)
    save_config(load_config("tiny", OVERRIDES + LOSSES[loss][1] + layout), run_dir / "config.yaml")
    port, procs = _free_port(), []
    for rank in range(nproc):
        env = {**os.environ, "OMP_NUM_THREADS": "1", "ATEN_CPU_CAPABILITY": "default", "MKL_CBWR": "COMPATIBLE"}
        if nproc > 1:
            env.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(nproc), LOCAL_WORLD_SIZE=str(nproc),
                       MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        procs.append(subprocess.Popen([sys.executable, "-m", "moelab.launch.entry", str(run_dir)], env=env,
                                      stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True))
    errors = [p.communicate()[1] for p in procs]
    for rank, p in enumerate(procs):
        if p.returncode:
            raise RuntimeError(f"{name} rank {rank} failed ({p.returncode}):\n{errors[rank][-3000:]}")
    steps = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [e for e in steps if e.get("event") == "step"]
    return {"loss": [e["loss"] for e in steps], "grad_norm": [e["grad_norm"] for e in steps],
            "aux_loss": [e["aux_loss"] for e in steps],
            "tokens_per_expert": [e["routing"]["tokens_per_expert"] for e in steps],
            "routed_per_expert": [e["routing"]["routed_per_expert"] for e in steps],
            "dropped_tokens": [e["routing"]["dropped_tokens"] for e in steps]}


def compute(names=tuple(LAYOUTS), loss: str = "full") -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        return {name: run_layout(name, Path(tmp) / name, loss) for name in names}


if __name__ == "__main__":
    loss = sys.argv[sys.argv.index("--loss") + 1] if "--loss" in sys.argv else "full"
    layouts = compute(loss=loss)
    # one line per figure: a small fixture whose diff shows which figure moved
    text = "{\n" + f' "overrides": {json.dumps(OVERRIDES)},\n "layouts": {{\n' + ",\n".join(
        f'  "{name}": {{\n' + ",\n".join(f'   "{k}": {json.dumps(v)}' for k, v in figs.items()) + "\n  }"
        for name, figs in layouts.items()) + "\n }\n}"
    if "--write" in sys.argv:
        LOSSES[loss][0].write_text(text + "\n")
    print(text)
