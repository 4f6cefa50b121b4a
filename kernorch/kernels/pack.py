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

from . import winograd


@dataclass(frozen=True)
class Pack:
    """How one operand of logical shape `shape` is stored, blocked by `block`:

    "kn"     a matmul weight `[..., K, N]` (leading dims of extent 1) as `[N / b, K, b]`
    "oihw"   a conv weight `[O, C, kh, kw]` as `[O / b, C, kh, kw, b]`
    "nchwc"  an activation `[N, C, H, W]` as `[N, C / b, H, W, b]` (the blocked layout nChw{b}c)
    "wino2", "wino4"  a 3x3 conv weight `[O, C, 3, 3]` Winograd-transformed for F(m x m, 3 x 3) as
             `[(m+2)^2, O / b, C, b]` (kernels.winograd; not a view: the variant's compute reads it)

    The blocked dimension is innermost, so the `b` values one vector step needs are contiguous.
    """

    kind: str
    block: int
    shape: tuple[int, ...]

    @property
    def layout(self) -> str:
        """A short name for reports, the plan and the saved model's manifest."""
        if self.kind.startswith("wino"):
            return f"OIHW>W{self.kind[4:]}O{self.block}"
        return {"kn": f"KN>N{self.block}", "oihw": f"OIHW>O{self.block}", "nchwc": f"nChw{self.block}c"}[self.kind]

    @property
    def packed_shape(self) -> tuple[int, ...]:
        b = self.block
        if self.kind == "kn":
            k, n = self.shape[-2:]
            return (n // b, k, b)
        if self.kind == "oihw":
            o, c, kh, kw = self.shape
            return (o // b, c, kh, kw, b)
        if self.kind.startswith("wino"):
            a = int(self.kind[4:]) + 2
            return (a * a, self.shape[0] // b, self.shape[1], b)
        n, c, h, w = self.shape
        return (n, c // b, h, w, b)

    def pack(self, arr: np.ndarray) -> np.ndarray:
        arr = np.asarray(arr)
        if tuple(arr.shape) != self.shape:
            raise ValueError(f"pack {self.layout}: array of shape {arr.shape}, expected {self.shape}")
        b = self.block
        if self.kind == "kn":
            k, n = self.shape[-2:]
            return np.ascontiguousarray(arr.reshape(k, n // b, b).transpose(1, 0, 2))
        if self.kind == "oihw":
            o, c, kh, kw = self.shape
            return np.ascontiguousarray(arr.reshape(o // b, b, c, kh, kw).transpose(0, 2, 3, 4, 1))
        if self.kind.startswith("wino"):
            return winograd.transform_weight(arr, int(self.kind[4:]), b)
        n, c, h, w = self.shape
        return np.ascontiguousarray(arr.reshape(n, c // b, b, h, w).transpose(0, 1, 3, 4, 2))

    def unpack(self, packed: np.ndarray) -> np.ndarray:
        """The inverse of `pack` (for checks, and for outputs read back in the logical layout)."""
        p = np.asarray(packed)
        if self.kind == "kn":
            return np.ascontiguousarray(p.transpose(1, 0, 2)).reshape(self.shape)
        if self.kind == "oihw":
            return np.ascontiguousarray(p.transpose(0, 4, 1, 2, 3)).reshape(self.shape)
        if self.kind.startswith("wino"):
            return winograd.untransform_weight(p, int(self.kind[4:]), self.shape)
        return np.ascontiguousarray(p.transpose(0, 1, 4, 2, 3)).reshape(self.shape)

    def te_view(self, T, packed, name: str):
        """A TE compute of the logical shape reading `packed` (a placeholder of `packed_shape`); a
        Winograd-transformed weight has no such view: the placeholder itself (its variant's
        compute reads it, kernels.winograd.te_conv)."""
        if self.kind.startswith("wino"):
            return packed
        b = self.block
        div, mod = T.tir.floordiv, T.tir.floormod
        if self.kind == "kn":
            lead = len(self.shape) - 2

            def body(*i):
                k, n = i[lead], i[lead + 1]
                return packed[div(n, b), k, mod(n, b)]
        elif self.kind == "oihw":
            def body(o, c, kh, kw):
                return packed[div(o, b), c, kh, kw, mod(o, b)]
        else:
            def body(n, c, h, w):
                return packed[n, div(c, b), h, w, mod(c, b)]
        return T.te.compute(self.shape, body, name=name)

    def te_block(self, T, logical, name: str):
        """The packed tensor computed from the logical one (a kernel's output in a blocked layout)."""
        if self.kind != "nchwc":
            raise ValueError(f"only activations are written blocked, not {self.layout}")
        b = self.block
        return T.te.compute(self.packed_shape, lambda n, cb, h, w, ci: logical[n, cb * b + ci, h, w], name=name)
