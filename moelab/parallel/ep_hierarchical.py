"""Node-aware expert dispatch (parallel.ep_dispatch=hierarchical): a token crosses to another node at most once
per destination node, fans out to its experts inside that node, and the node's weighted sum crosses back once.

Shapes: T tokens on this rank, K top-k, D hidden, E experts, R EP ranks, X = E/R experts per rank, N nodes of the
EP group, G EP ranks per node; S rows this rank sends to nodes (token, node pairs), M rows it receives from them.

The EP group's ranks split into N nodes of G ranks (moelab.layout.dims: rank // ranks_per_node). Two sub-groups
serve each rank: `inter`, the ranks of the EP group with the same place in their node (N ranks, one per node),
and `intra`, the G ranks of its own node. One MoE layer's route:
  1. for each token, the nodes that hold at least one of its kept experts; the (token, node) pairs are sent over
     `inter`, node-major, with an all-to-all of the [N] counts and one device-to-host copy of the split sizes;
     a token bound for its own node goes to this rank itself (a copy, nothing crosses);
  2. each row carries its token's routing: the K expert ids (-1 for dropped ones) and the K weights, in fp32,
     in a second exchange of the same splits; the weights keep their gradient (the router learns through it);
  3. on the receiving rank, the assignments of the received rows to experts of this node go through the flat
     all-to-all dispatcher (moelab.parallel.expert_parallel) over `intra`: its rows to the node's experts, and
     back, summed per received row with the travelled weights (the node's partial output of that token);
  4. the partial outputs cross back over `inter` (the mirror of 1) and each token sums its nodes' parts.
Backward runs the mirrored exchanges. With node-limited routing (model.moe.num_groups / topk_groups, or
max_routed_ranks / routing_ranks, whose blocks nest in nodes) a token reaches at most that many nodes, so at
most that many copies of it cross between nodes. With parallel.ep_overlap the tokens go in two chunks after
routing (as OverlappedAllToAllDispatcher's): chunk 1 crosses between nodes while chunk 0's experts compute, and
chunk 0's sums return while chunk 1's compute; backward mirrors it. Host synchronisations per layer: one for the
node counts, and one per chunk in the node-local dispatch (the flat dispatcher has one).

    d = HierarchicalDispatcher(ep_group, NodeGroups.build(ep_group, ranks_per_node=4))
    y_TD = d.route(experts, x_TD, weights_TK, experts_TK, keep_TK, num_experts)
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.distributed as dist

from moelab.model.moe import Dispatcher
from moelab.parallel.expert_parallel import (AllToAllDispatcher, _Travel, all_to_all, start_all_to_all,
                                             wait_all_to_all)


@dataclass
class NodeGroups:
    """Where the EP ranks sit: node_of[r] and local_of[r] (place within the node) for EP rank r, and this rank's
    two sub-groups, `inter` (same place, one rank per node) and `intra` (its node).

        groups = NodeGroups.build(ep_group, ranks_per_node=2)   # collective over the world: every rank calls it
    """
    node_of: list[int]
    local_of: list[int]
    inter: object
    intra: object

    @classmethod
    def build(cls, ep_group, ranks_per_node: int) -> "NodeGroups":
        """Every EP group's ranks are gathered over the world, so that every rank creates every sub-group in the
        same order (torch.distributed.new_group is collective over the world)."""
        mine = dist.get_process_group_ranks(ep_group)
        groups = [None] * dist.get_world_size()
        dist.all_gather_object(groups, sorted(mine))
        chosen = {}
        for ranks in sorted({tuple(g) for g in groups}):
            nodes = sorted({r // ranks_per_node for r in ranks})
            by_node = [[r for r in ranks if r // ranks_per_node == n] for n in nodes]
            if len({len(b) for b in by_node}) != 1:
                raise ValueError(f"moelab.parallel.ep_hierarchical: EP group {list(ranks)} holds unequal shares of "
                                 f"nodes of {ranks_per_node} ranks ({[len(b) for b in by_node]}); "
                                 f"set parallel.ranks_per_node to divide or be divided by parallel.ep")
            inter = [dist.new_group([b[i] for b in by_node]) for i in range(len(by_node[0]))]
            intra = [dist.new_group(b) for b in by_node]
            if dist.get_rank() in ranks:
                node = nodes.index(dist.get_rank() // ranks_per_node)
                local = by_node[node].index(dist.get_rank())
                node_of = [nodes.index(r // ranks_per_node) for r in ranks]
                local_of = [by_node[n].index(r) for r, n in zip(ranks, node_of)]
                chosen = dict(node_of=node_of, local_of=local_of, inter=inter[local], intra=intra[node])
        return cls(**chosen)


class NodeDispatchCounts:
    """What this rank's forward dispatches sent since the last ``pop`` (host ints it reads anyway): rows and
    bytes to other nodes (activation and routing columns: moelab.planner.node_dispatch), rows and bytes to
    other ranks of the destination node (the node-local all-to-all), and how many tokens reached exactly
    0..N nodes.

        counts = NodeDispatchCounts(nodes=2, intra=AllToAllDispatcher(intra_group).counts)
        counts.pop()["inter_node_bytes"]
    """

    def __init__(self, nodes: int, intra):
        self.nodes, self.intra = nodes, intra
        self.pop()

    def add(self, send_splits: list[int], me: int, row_bytes: int, reached: list[int]) -> None:
        rows = sum(send_splits) - send_splits[me]
        self.values["inter_node_rows"][0] += rows
        self.values["inter_node_bytes"][0] += rows * row_bytes
        self.values["tokens_by_nodes_reached"] = [a + b for a, b in zip(self.values["tokens_by_nodes_reached"],
                                                                        reached)]

    def pop(self) -> dict[str, list[float]]:
        out = getattr(self, "values", None)
        intra = self.intra.pop()
        if out is not None:
            out["intra_node_rows"] = intra["dispatch_rows"]
            out["intra_node_bytes"] = intra["dispatch_bytes"]
        self.values = {"inter_node_rows": [0.0], "inter_node_bytes": [0.0],
                       "tokens_by_nodes_reached": [0.0] * (self.nodes + 1)}
        return out


class HierarchicalDispatcher(Dispatcher):
    """Expert dispatch that crosses between nodes once per token and destination node (module docstring).

        moe.dispatcher = HierarchicalDispatcher(meshes.ep_group, NodeGroups.build(meshes.ep_group, 4))
    """

    exchanges = True

    def __init__(self, group, nodes: NodeGroups, overlap: bool = False):
        self.ep, self.me = dist.get_world_size(group), dist.get_rank(group)
        self.inter, self.num_nodes = nodes.inter, dist.get_world_size(nodes.inter)
        self.per_node = dist.get_world_size(nodes.intra)
        self.node = nodes.node_of[self.me]
        self.node_of_R, self.local_of_R = torch.tensor(nodes.node_of), torch.tensor(nodes.local_of)
        self.overlap = overlap
        self.intra = AllToAllDispatcher(nodes.intra)
        self.counts = NodeDispatchCounts(self.num_nodes, self.intra.counts)
        self._start = torch.compiler.disable(start_all_to_all)  # eager inside a compiled step, as the flat one's
        self._wait = torch.compiler.disable(wait_all_to_all)

    def route(self, experts, x_TD, weights_TK, experts_TK, keep_TK, num_experts):
        T, K = experts_TK.shape
        X, g = num_experts // self.ep, self.inter
        # 1. the (token, node) pairs of each chunk (two under ep_overlap), node-major; one exchange of the counts
        bounds = [0, T // 2, T] if self.overlap and T >= 2 else [0, T]
        chunks = list(zip(bounds, bounds[1:]))
        pairs = [self._pairs(experts_TK[a:b], None if keep_TK is None else keep_TK[a:b], X, a) for a, b in chunks]
        send, recv = self._exchange_counts(pairs, x_TD.shape[-1] * x_TD.element_size() + 8 * K)
        # 2. each row's routing beside it: expert ids (-1 where dropped) and weights, fp32, the weights differentiable
        ids_TK = experts_TK if keep_TK is None else torch.where(keep_TK, experts_TK, -1)
        route_TK2 = torch.cat([weights_TK.float(), ids_TK.float()], 1)
        rows = [(x_TD[token_S], route_TK2[token_S]) for token_S, *_ in pairs]
        in_node = functools.partial(self._in_node, experts, X, weights_TK.dtype)
        if len(chunks) == 1:
            x_MD, route_MK2 = (all_to_all(t, recv[0], send[0], g) for t in rows[0])
            y_SD = [all_to_all(in_node(x_MD, route_MK2), send[0], recv[0], g)]
        else:  # chunk 1 crosses while chunk 0's experts compute, chunk 0's sums return while chunk 1's compute
            x0_MD, route0_MK2 = (all_to_all(t, recv[0], send[0], g) for t in rows[0])
            travels = [_Travel(), _Travel()]
            x1_MD, route1_MK2 = (self._start(t, recv[1], send[1], g, tr) for t, tr in zip(rows[1], travels))
            y0_MD = in_node(x0_MD, route0_MK2)
            x1_MD, route1_MK2 = (self._wait(t, recv[1], send[1], g, tr)
                                 for t, tr in zip((x1_MD, route1_MK2), travels))
            back = _Travel()
            y0_SD = self._start(y0_MD, send[0], recv[0], g, back)
            y1_MD = in_node(x1_MD, route1_MK2)
            y_SD = [self._wait(y0_SD, send[0], recv[0], g, back), all_to_all(y1_MD, send[1], recv[1], g)]
        # 4. each node's part back at the token's rank, summed there
        token_S = torch.cat([p[0] for p in pairs])
        y_SD = torch.cat(y_SD)
        return y_SD.new_zeros(T, y_SD.shape[-1]).index_add(0, token_S, y_SD)

    def _pairs(self, experts_TK, keep_TK, X: int, offset: int):
        """(token_S: the token of each (token, node) pair, node-major, send_N: pairs per node, reached: tokens
        reaching 0..N nodes) for a chunk of tokens starting at `offset`; dropped assignments reach no node."""
        N, T = self.num_nodes, experts_TK.shape[0]
        node_TK = self.node_of_R.to(experts_TK.device)[experts_TK // X]
        if keep_TK is not None:
            node_TK = torch.where(keep_TK, node_TK, N)
        hit_NT = torch.zeros(N + 1, T, dtype=torch.bool, device=experts_TK.device).scatter_(0, node_TK.t(), True)[:N]
        token_S = hit_NT.nonzero(as_tuple=True)[1] + offset
        return token_S, hit_NT.sum(1), torch.bincount(hit_NT.sum(0), minlength=N + 1)

    def _exchange_counts(self, pairs, row_bytes: int):
        """One all-to-all of the chunks' [C, N] pair counts over `inter` and the layer's first device-to-host
        copy: the host split sizes [C][N] to send and to receive (and this dispatch added to ``self.counts``)."""
        C, N = len(pairs), self.num_nodes
        send_NC = torch.stack([p[1] for p in pairs], 1).contiguous()  # grouped by destination: even splits
        recv_NC = torch.empty_like(send_NC)
        dist.all_to_all_single(recv_NC, send_NC, group=self.inter)
        reached = sum(p[2] for p in pairs)
        host = torch.cat([send_NC.t().reshape(-1), recv_NC.t().reshape(-1), reached]).tolist()
        send = [host[c * N:(c + 1) * N] for c in range(C)]
        recv = [host[(C + c) * N:(C + c + 1) * N] for c in range(C)]
        self.counts.add([sum(s) for s in zip(*send)], self.node, row_bytes, host[2 * C * N:])
        return send, recv

    def _in_node(self, experts, X: int, dtype, x_MD, route_MK2):
        """3. The received rows' assignments to this node's experts (numbered within the node) through the
        node-local all-to-all; each row comes back as its experts' outputs summed with the travelled weights."""
        K = route_MK2.shape[1] // 2
        node_of_R, local_of_R = self.node_of_R.to(x_MD.device), self.local_of_R.to(x_MD.device)
        w_MK, ids_MK = route_MK2[:, :K].to(dtype), route_MK2[:, K:].detach().long()
        rank_MK = torch.where(ids_MK >= 0, ids_MK // X, 0)
        here_MK = (ids_MK >= 0) & (node_of_R[rank_MK] == self.node)
        local_MK = torch.where(here_MK, local_of_R[rank_MK] * X + ids_MK % X, 0)
        return self.intra.route(experts, x_MD, w_MK * here_MK, local_MK, here_MK, self.per_node * X)
