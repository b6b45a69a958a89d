"""Device meshes for a layout [TP, PP, CP, EP, VP, FSDP] on `world` ranks, and where this rank sits in them.

    meshes = build_meshes(ParallelDims.build(cfg, 4), rank=r, device_type="cpu")   # every rank calls it
    meshes.dense      # 1-D, the dp*cp ranks of this pipeline stage: FSDP2 shards dense parameters over it
    meshes.ep_group   # the process group of this rank's EP peers (None when ep == 1)
    meshes.efsdp      # 1-D, the (dp*cp)/ep ranks that hold the same experts: FSDP2 shards experts over it

The shapes and the rank order come from the layout validator (moelab.layout.dims.ParallelDims); this module
turns them into DeviceMeshes.

Every mesh is a plain torch DeviceMesh built from an explicit rank tensor, so every rank must build all of
them in the same order (each builds the process groups of every mesh dimension).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.distributed.device_mesh import DeviceMesh

from moelab.config import ParallelConfig
from moelab.layout.dims import Coords, ParallelDims


@dataclass
class Meshes:
    """Every DeviceMesh of a layout on this rank, and its coordinates.

        meshes = build_meshes(ParallelDims.build(cfg, 4), rank, "cpu")
        meshes.ep_group, meshes.dense, meshes.coords.pp
    """
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


def build_meshes(dims: ParallelDims, rank: int, device_type: str) -> Meshes:
    """All meshes of the validated layout (collective: every rank calls it with the same dims)."""
    ranks = torch.arange(dims.world_size)
    coords = dims.coords(rank)

    def sub(shape, names, keep):
        """The 1-D mesh along `keep` of a DeviceMesh with `shape` over all ranks, containing this rank."""
        mesh = DeviceMesh(device_type, ranks.view(*shape), mesh_dim_names=names)
        return mesh[keep]

    world = DeviceMesh(device_type, ranks.view(*dims.world_shape), mesh_dim_names=("pp", "dp", "cp"))
    dense = sub(dims.dense_shape, ("pp", "dp_cp"), "dp_cp")
    experts = DeviceMesh(device_type, ranks.view(*dims.expert_shape), mesh_dim_names=("pp", "efsdp", "ep"))
    return Meshes(dims.layout, coords, world, dense, experts["efsdp"], experts["ep"])
