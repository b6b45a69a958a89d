"""rank_entry with torch.compile's backend named by TEST_COMPILE_BACKEND, for the multi-process compile tests.

    python -m compile_backend_entry RUN_DIR      (TEST_COMPILE_BACKEND=aot_eager; launched by run_local_processes)

train.compile calls each block's ``nn.Module.compile()`` (moelab.parallel.place.apply_compile); here that call
gets the backend, as the CPU compile tests pass theirs (tests/model/test_fused_experts.py: aot_eager,
tests/model/test_batch_context.py: a counting backend): dynamo traces the block and AOTAutograd builds its
forward and backward graphs as under inductor, which then runs them op by op instead of generating C++ (whose
builds, one per graph and recompile, take minutes per rank on a shared two-core CPU). Each graph handed to the
backend adds a line to RUN_DIR/compiled_rank<r>.txt (its node count), so a test sees that the blocks compiled.
"""
import os
import sys
from pathlib import Path

import torch
from torch import nn
from torch._dynamo import lookup_backend

import rank_entry


def use_backend(name: str, log: Path) -> None:
    """Every nn.Module.compile() call without a backend compiles with backend `name`, logging each graph."""
    compile_graph = lookup_backend(name)

    def backend(gm, example_inputs):
        with open(log, "a") as f:
            f.write(f"{len(gm.graph.nodes)}\n")
        return compile_graph(gm, example_inputs)

    # the fp32 CPU experts' per-expert loop recompiles for each row count (moelab.model.experts): after two, dynamo
    # runs that frame eagerly, which is what it does after its default eight; the blocks' graphs are unchanged
    torch._dynamo.config.recompile_limit = 2
    inner = nn.Module.compile
    nn.Module.compile = lambda self, *args, **kwargs: inner(self, *args, **{"backend": backend, **kwargs})


if __name__ == "__main__":
    use_backend(os.environ["TEST_COMPILE_BACKEND"], Path(sys.argv[1]) / f"compiled_rank{os.environ['RANK']}.txt")
    rank_entry.run(sys.argv[1:])
