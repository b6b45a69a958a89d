"""Device meshes for a layout [TP, PP, CP, EP, VP, FSDP] on `world` ranks, and where this rank sits in them.

    meshes = build_meshes(layout, world_size=4, rank=r, device_type="cpu")   # every rank calls it
    meshes.dense      # 1-D, the dp*cp ranks of this pipeline stage: FSDP2 shards dense parameters over it
    meshes.ep_group   # the process group of this rank's EP peers (None when ep == 1)
    meshes.efsdp      # 1-D, the (dp*cp)/ep ranks that hold the same experts: FSDP2 shards experts over it

Rank order (innermost last): rank = (pp_rank * dp + dp_rank) * cp + cp_rank, tp being 1. Within a pipeline
stage the dp*cp ranks are numbered s = dp_rank * cp + cp_rank; expert parallelism carves them as
s = efsdp_rank * ep + ep_rank, so EP peers are neighbours (one node when ep <= GPUs per node), borrowed from
the CP ranks first and then from the data-parallel ranks (torchtitan's and NeMo's convention).

Every mesh is a plain torch DeviceMesh built from an explicit rank tensor, so every rank must build all of
them in the same order (each builds the process groups of every mesh dimension).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.distributed.device_mesh import DeviceMesh

from moelab.config import ConfigError, ParallelConfig


@dataclass(frozen=True)
class Coords:
    """This rank's position: pipeline stage, data-parallel index, context-parallel index, EP index and
    expert-FSDP index (the last two within the stage's dp*cp ranks)."""
    pp: int
    dp: int
    cp: int
    ep: int
    efsdp: int


def coords_of(layout: ParallelConfig, rank: int) -> Coords:
    dp, cp, ep = layout.fsdp, layout.cp, layout.ep
    pp_rank, s = divmod(rank, dp * cp)
    dp_rank, cp_rank = divmod(s, cp)
    efsdp_rank, ep_rank = divmod(s, ep)
    return Coords(pp_rank, dp_rank, cp_rank, ep_rank, efsdp_rank)


@dataclass
class Meshes:
    layout: ParallelConfig
    coords: Coords
    world: DeviceMesh  # ("pp", "dp", "cp")
    dense: DeviceMesh  # 1-D "dp_cp": FSDP for dense parameters
    efsdp: DeviceMesh  # 1-D "efsdp": FSDP for this rank's experts
    ep_mesh: DeviceMesh  # 1-D "ep": the expert-parallel peers

    @property
    def ep_group(self):
        return self.ep_mesh.get_group() if self.layout.ep > 1 else None

    @property
    def cp_group(self):
        return self.world.get_group("cp") if self.layout.cp > 1 else None

    @property
    def pp_group(self):
        return self.world.get_group("pp") if self.layout.pp > 1 else None


def check_supported(layout: ParallelConfig) -> None:
    """Raise ConfigError for a valid layout that moelab cannot run yet (the planner may still plan it)."""
    if layout.vp > 1 and layout.pp_schedule != "interleaved_1f1b":
        raise ConfigError(f"parallel.pp_schedule={layout.pp_schedule!r}: runs one stage per rank; with "
                          f"parallel.vp={layout.vp} virtual stages use interleaved_1f1b")
    if layout.cp > 1 and layout.pp > 1:
        raise ConfigError(f"parallel.cp={layout.cp} with parallel.pp={layout.pp}: context parallelism does not "
                          f"compose with pipeline stages yet; use one of them")


def build_meshes(layout: ParallelConfig, world_size: int, rank: int, device_type: str) -> Meshes:
    """All meshes of the layout (collective: every rank calls it with the same layout)."""
    pp, dp, cp, ep = layout.pp, layout.fsdp, layout.cp, layout.ep
    if layout.tp != 1:
        raise ValueError("moelab.parallel.mesh: tp > 1 is rejected by the config; got a layout with tp > 1")
    if pp * dp * cp != world_size:
        raise ValueError(f"moelab.parallel.mesh: pp*fsdp*cp = {pp * dp * cp} but the world size is {world_size} "
                         f"(use cfg.resolved_parallel(world_size))")
    ranks = torch.arange(world_size)
    coords = coords_of(layout, rank)

    def sub(shape, names, keep):
        """The 1-D mesh along `keep` of a DeviceMesh with `shape` over all ranks, containing this rank."""
        mesh = DeviceMesh(device_type, ranks.view(*shape), mesh_dim_names=names)
        return mesh[keep]

    world = DeviceMesh(device_type, ranks.view(pp, dp, cp), mesh_dim_names=("pp", "dp", "cp"))
    dense = sub((pp, dp * cp), ("pp", "dp_cp"), "dp_cp")
    experts = DeviceMesh(device_type, ranks.view(pp, dp * cp // ep, ep), mesh_dim_names=("pp", "efsdp", "ep"))
    return Meshes(layout, coords, world, dense, experts["efsdp"], experts["ep"])
