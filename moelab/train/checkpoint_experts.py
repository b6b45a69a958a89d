"""Expert tensors in checkpoints: under expert parallelism every EP rank holds num_experts/ep experts under the
same names, so moelab.train.checkpoint saves and loads them through a view in which each is one DTensor of the
true global shape [num_experts, ...]; any layout can then read any other's checkpoint.

    view = global_experts(state, meshes)   # shares storage with `state`
    dcp.load(view, checkpoint_id=path); copy_back(view, state)
"""
from __future__ import annotations

import torch
import torch.distributed as dist


def global_experts(state: dict, meshes) -> dict:
    """With expert parallelism each EP rank holds num_experts/ep experts under the same names (FSDP2 DTensors
    whose "global" shape is only this rank's experts); DCP would take them for one replicated tensor and keep
    one rank's copy. Return a view of `state` in which every expert tensor is instead a DTensor of the true
    global shape [num_experts, ...], sharded over EP ranks (outer) then expert-FSDP ranks (inner) exactly as
    moelab.parallel lays them out, sharing storage with the original (so a load into the view fills it)."""
    if meshes is None or meshes.layout.ep == 1:
        return state
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor, Replicate, Shard

    ep_ranks, efsdp_ranks = meshes.ep_mesh.mesh.tolist(), meshes.efsdp.mesh.tolist()
    me = dist.get_rank()
    # rank = base + efsdp_index * ep + ep_index: the block of ranks sharing this rank's experts' layer slices
    block = torch.tensor([[e + f - me for f in efsdp_ranks] for e in ep_ranks])
    mesh = DeviceMesh.from_group([meshes.ep_mesh.get_group(), meshes.efsdp.get_group()],
                                 meshes.ep_mesh.device_type, mesh=block, mesh_dim_names=("ep", "efsdp"))
    ep = meshes.layout.ep

    def globalize(value):
        if not isinstance(value, torch.Tensor) or value.dim() == 0:
            return value
        local = value.to_local() if isinstance(value, DTensor) else value
        shape = torch.Size((value.shape[0] * ep, *value.shape[1:]))
        stride = torch.empty(shape, device="meta").stride()
        # plain tensors: experts replicated over the expert-FSDP ranks (parallel.expert_dp=replicate)
        inner = Shard(0) if isinstance(value, DTensor) else Replicate()
        return DTensor.from_local(local, mesh, [Shard(0), inner], run_check=False, shape=shape, stride=stride)

    def walk(node, is_expert=False):
        if isinstance(node, dict):
            return {k: walk(v, is_expert or (isinstance(k, str) and ".experts." in f".{k}")) for k, v in node.items()}
        if isinstance(node, list):
            return node  # param_groups: no tensors
        return globalize(node) if is_expert else node

    return walk(state)


def copy_back(view, state) -> None:
    """Values DCP put into the view's containers (not in place) go back into the original state dict."""
    for k, v in view.items():
        if isinstance(v, dict) and isinstance(state.get(k), dict):
            copy_back(v, state[k])
        elif v is not state.get(k) and not isinstance(v, torch.Tensor):
            state[k] = v
