"""Compile-time layouts of constant operands (weight packing).

A contraction whose right operand is a constant reads it re-laid-out for its register tile: a GEMM
weight `W[K, N]` becomes `Wp[N / nb, K, nb]`, so the `nb` columns one micro-kernel step needs are
contiguous and the whole K-panel of one column block is one linear stream. The packing is part of
the kernel variant: `kernorch.kernels.variants.variant_packs` derives it from the kernel and its
schedule name, and the measurement worker, the emitter and the saved model all call it, so the
packed array that was timed is the one that runs.

`Pack.te_view` gives the lowering a TE tensor of the *logical* shape that reads the packed
placeholder; the primitives' computes stay unchanged and the view is inlined into the contraction,
where the split by `nb` turns its index arithmetic into plain `Wp[jo, k, ji]` loads.
"""
from __future__ import annotations

from dataclasses import dataclass
import numpy as np



@dataclass(frozen=True)
class Pack:
    """How one constant operand of logical shape `shape` is stored: `kind` "kn" packs a
    `[..., K, N]` matrix (leading dims of extent 1) into `[N / block, K, block]`."""

    kind: str
    block: int
    shape: tuple[int, ...]

    @property
    def layout(self) -> str:
        """A short name for reports and the saved model's manifest, e.g. "KN>N32"."""
        return f"KN>N{self.block}"

    @property
    def packed_shape(self) -> tuple[int, ...]:
        k, n = self.shape[-2:]
        return (n // self.block, k, self.block)

    def pack(self, arr: np.ndarray) -> np.ndarray:
        arr = np.asarray(arr)
        if tuple(arr.shape) != self.shape:
            raise ValueError(f"pack {self.layout}: array of shape {arr.shape}, expected {self.shape}")
        k, n = self.shape[-2:]
        m = arr.reshape(k, n // self.block, self.block)
        return np.ascontiguousarray(m.transpose(1, 0, 2))

    def unpack(self, packed: np.ndarray) -> np.ndarray:
        """The inverse of `pack` (for checks and reports)."""
        k, n = self.shape[-2:]
        return np.ascontiguousarray(np.asarray(packed).transpose(1, 0, 2)).reshape(self.shape)

    def te_view(self, T, packed, name: str):
        """A TE compute of the logical shape reading `packed` (a placeholder of `packed_shape`)."""
        lead = len(self.shape) - 2
        nb = self.block

        def body(*i):
            k, n = i[lead], i[lead + 1]
            return packed[T.tir.floordiv(n, nb), k, T.tir.floormod(n, nb)]

        return T.te.compute(self.shape, body, name=name)
