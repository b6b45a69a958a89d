"""A step's statistics packed into one tensor by name, so that one all-reduce and one host read serve them all.

    pack = StatsPack()
    pack.add("loss", loss_1)                       # tensors in order; each is flattened to float
    pack.add("tokens_per_expert", counts_ME)       # or a list of tensors, concatenated
    packed = all_reduce_sum(pack.pack())           # one collective
    values = pack.unpack(packed.tolist())          # one host read: {"loss": [...], "tokens_per_expert": [...]}
    counts_ME = packed[pack.slice("tokens_per_expert")].view(M, E)   # still on the device
"""
from __future__ import annotations

import torch


class StatsPack:
    """Named slices of one flat float tensor (see the module docstring).

        pack = StatsPack(); pack.add("a", torch.ones(2)); pack.unpack(pack.pack().tolist())   # {"a": [1.0, 1.0]}
    """

    def __init__(self):
        self._parts: list[torch.Tensor] = []
        self._slices: dict[str, slice] = {}
        self._size = 0

    def add(self, name: str, values: "torch.Tensor | list[torch.Tensor]") -> None:
        parts = [values] if isinstance(values, torch.Tensor) else list(values)
        flat = [p.reshape(-1).float() for p in parts]
        n = sum(p.numel() for p in flat)
        self._slices[name] = slice(self._size, self._size + n)
        self._size += n
        self._parts += flat

    def pack(self) -> torch.Tensor:
        return torch.cat(self._parts)

    def slice(self, name: str) -> slice:
        return self._slices[name]

    def unpack(self, values: list[float]) -> dict[str, list[float]]:
        return {name: values[s] for name, s in self._slices.items()}
