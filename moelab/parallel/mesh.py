"""Device meshes for a layout [TP, PP, CP, EP, VP, FSDP] on `world` ranks, and where this rank sits in them.

    meshes = build_meshes(ParallelDims.build(cfg, 4), rank=r, device_type="cpu")   # every rank calls it
    meshes.dense      # 1-D, the dp*cp ranks of this pipeline stage: FSDP2 shards dense parameters over it
    meshes.tp         # 1-D, this rank's tensor-parallel peers (a sibling of `dense`: FSDP2's 2-D mesh)
    meshes.ep_group   # the process group of this rank's EP peers (None when ep == 1)
    meshes.efsdp      # 1-D, the (dp*cp*tp)/ep ranks that hold the same experts: FSDP2 shards experts over it

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
    world: DeviceMesh  # ("pp", "dp", "cp", "tp")
    dense: DeviceMesh  # 1-D "dp_cp": FSDP for dense parameters
    efsdp: DeviceMesh  # 1-D "efsdp": FSDP for this rank's experts
    ep_mesh: DeviceMesh  # 1-D "ep": the expert-parallel peers
    tp: DeviceMesh | None = None  # 1-D "tp", sliced from the same 2-D mesh as `dense` (None when tp == 1)
    moe_dp: DeviceMesh | None = None  # 1-D "dp_cp_tp": FSDP for the MoE layers' router and shared experts under TP
    tokens: DeviceMesh | None = None  # 1-D "cp_tp": the ranks sharing one dp rank's sequences (None: only this one)

    @property
    def ep_group(self):
        return self.ep_mesh.get_group() if self.layout.ep > 1 else None

    @property
    def cp_group(self):
        return self.world.get_group("cp") if self.layout.cp > 1 else None

    @property
    def pp_group(self):
        return self.world.get_group("pp") if self.layout.pp > 1 else None

    @property
    def tp_group(self):
        return self.tp.get_group() if self.tp is not None else None


def build_meshes(dims: ParallelDims, rank: int, device_type: str) -> Meshes:
    """All meshes of the validated layout (collective: every rank calls it with the same dims)."""
    ranks = torch.arange(dims.world_size)
    coords = dims.coords(rank)

    def mesh(shape, names):
        return DeviceMesh(device_type, ranks.view(*shape), mesh_dim_names=names)

    world = mesh(dims.world_shape, ("pp", "dp", "cp", "tp"))
    if dims.tp == 1:  # the layouts before TP: the same meshes as ever
        dense, tp = mesh(dims.dense_shape[:2], ("pp", "dp_cp"))["dp_cp"], None
        moe_dp = None
    else:  # FSDP2 over TP's DTensors needs both 1-D meshes sliced from one parent
        dense_tp = mesh(dims.dense_shape, ("pp", "dp_cp", "tp"))
        dense, tp = dense_tp["dp_cp"], dense_tp["tp"]
        moe_dp = mesh((dims.pp, dims.dp * dims.cp * dims.tp), ("pp", "dp_cp_tp"))["dp_cp_tp"]
    experts = mesh(dims.expert_shape, ("pp", "efsdp", "ep"))
    tokens = mesh(dims.token_shape, ("pp", "dp", "cp_tp"))["cp_tp"] if dims.tp > 1 else None
    return Meshes(dims.layout, coords, world, dense, experts["efsdp"], experts["ep"], tp, moe_dp, tokens)
