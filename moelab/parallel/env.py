"""Who am I: the rank, world and device of this process, read from torchrun's or SLURM's environment.

    env = DistEnv.from_environ()   # RANK/WORLD_SIZE/LOCAL_RANK (torchrun, moelab --nproc) or SLURM_* (srun)
    env.init()                     # init_process_group (gloo on CPU, NCCL on GPU) when world_size > 1
"""
from __future__ import annotations

import datetime
import os
from dataclasses import dataclass

import torch


@dataclass
class DistEnv:
    """Rank, world size, local rank and device of this process.

        env = DistEnv.from_environ()      # torchrun's or SLURM's variables; one process without them
        env.init(); ...; env.shutdown()
    """
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    device: str = "cpu"  # "cpu" or "cuda:<local_rank>"

    @classmethod
    def from_environ(cls, device_pref: str = "auto") -> "DistEnv":
        e = os.environ
        if "RANK" in e and "WORLD_SIZE" in e:
            rank, world, local = int(e["RANK"]), int(e["WORLD_SIZE"]), int(e.get("LOCAL_RANK", 0))
        elif "SLURM_PROCID" in e and "SLURM_NTASKS" in e:
            rank, world, local = int(e["SLURM_PROCID"]), int(e["SLURM_NTASKS"]), int(e.get("SLURM_LOCALID", 0))
        else:
            rank, world, local = 0, 1, 0
        use_cuda = torch.cuda.is_available() if device_pref == "auto" else device_pref == "cuda"
        if use_cuda and not torch.cuda.is_available():
            raise RuntimeError("train.device='cuda' but torch sees no CUDA device; set train.device='cpu' or 'auto'")
        device = f"cuda:{local % max(torch.cuda.device_count(), 1)}" if use_cuda else "cpu"
        return cls(rank, world, local, device)

    @property
    def is_cuda(self) -> bool:
        return self.device.startswith("cuda")

    def init(self, timeout_s: float = 120.0) -> None:
        """Start torch.distributed if there is more than one rank. A collective that waits longer than
        `timeout_s` raises instead of hanging (a dead peer ends the run with an error)."""
        if self.is_cuda:
            torch.cuda.set_device(self.device)
        if self.world_size == 1 or torch.distributed.is_initialized():
            return
        if "MASTER_ADDR" not in os.environ:
            raise RuntimeError("world_size > 1 but MASTER_ADDR is not set: launch with `moelab run --nproc N`, "
                               "torchrun, or submitit's SLURM executor")
        torch.distributed.init_process_group(
            backend="nccl" if self.is_cuda else "gloo", rank=self.rank, world_size=self.world_size,
            timeout=datetime.timedelta(seconds=timeout_s),
            device_id=torch.device(self.device) if self.is_cuda else None)

    def shutdown(self) -> None:
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
