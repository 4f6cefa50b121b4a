"""Winograd convolution F(m x m, 3 x 3): a 3x3 stride-1 convolution in fewer multiplications.

Each output tile of m x m pixels is computed from an (m+2) x (m+2) input tile d and the 3x3
filter g as

    Y = A^T [ (G g G^T) (.) (B^T d B) ] A        ((.): elementwise, per input/output channel pair)

so summed over the input channels, the (m+2)^2 elementwise products of every tile become
(m+2)^2 independent GEMMs  M[e] = V[e] @ U[e]  (rows: input tiles, depth: input channels,
columns: output channels). F(2x2,3x3) does 16 multiplications where direct convolution does 36
(2.25x fewer), F(4x4,3x3) 36 where it does 144 (4x fewer); the transforms are additions and
multiplications by small constants.

In a kernel variant (schedule `w4t14x32`: F(4x4,3x3), GEMM tile of 14 input tiles x 32 output
channels; with a blocked boundary `b16/w4t14x32`):
  * the weight transform U = G g G^T is done at compile time, packed `[(m+2)^2, O/nb, C, nb]` for the
    GEMM's column tile (`Pack("wino4", nb, (O, C, 3, 3))`, pack.py);
  * the input transform V = B^T d B reads the (padded) input tile directly, zero outside the image;
  * the output transform and the kernel's epilogue (bias, activation, residual) are one stage that
    writes the output (kernorch's schedule computes V and M for one row of tiles at a time).

The transforms are exact in real arithmetic; in float32 F(4x4,3x3) loses about two more digits
than direct convolution (its points 0, +-1, +-2 give constants up to 8 and 1/24), which is why each
variant is checked against the numpy reference like every kernel, and the model against ONNX
Runtime. The roofline floor is still counted in direct-convolution FLOPs.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np

from .tiles import row_options

# B^T, G, A^T of F(m x m, 3 x 3) with the interpolation points 0, +-1, (+-2,) infinity (Lavin & Gray)
MATRICES = {
    2: (np.array([[1, 0, -1, 0], [0, 1, 1, 0], [0, -1, 1, 0], [0, 1, 0, -1]], float),
        np.array([[1, 0, 0], [.5, .5, .5], [.5, -.5, .5], [0, 0, 1]], float),
        np.array([[1, 1, 1, 0], [0, 1, -1, -1]], float)),
    4: (np.array([[4, 0, -5, 0, 1, 0], [0, -4, -4, 1, 1, 0], [0, 4, -4, -1, 1, 0],
                  [0, -2, -1, 2, 1, 0], [0, 2, -1, -2, 1, 0], [0, 4, 0, -5, 0, 1]], float),
        np.array([[1 / 4, 0, 0], [-1 / 6, -1 / 6, -1 / 6], [-1 / 6, 1 / 6, -1 / 6],
                  [1 / 24, 1 / 12, 1 / 6], [1 / 24, -1 / 12, 1 / 6], [0, 0, 1]], float),
        np.array([[1, 1, 1, 1, 1, 0], [0, 1, -1, 2, -2, 0], [0, 1, 1, 4, 4, 0], [0, 1, -1, 8, -8, 1]], float)),
}
_NAME = re.compile(r"w(\d)t(\d+)x(\d+)")
#: Direct convolution's multiplications over those of the cheapest variant, F(4x4,3x3): 144 / 36
FEWEST_MULTIPLICATIONS = 4.0


@dataclass(frozen=True, order=True)
class Winograd:
    """A Winograd variant: output tiles of `m` x `m`, its GEMMs in register tiles of `mr` input
    tiles (rows; a smaller divisor of the row of tiles when one of at least half exists) x `nb`
    output channels (columns; the transformed weight is packed for them)."""

    m: int
    mr: int
    nb: int

    @property
    def name(self) -> str:
        return f"w{self.m}t{self.mr}x{self.nb}"

    @property
    def alpha(self) -> int:
        """The edge of an input tile."""
        return self.m + 2

    @staticmethod
    def parse(name: str) -> "Winograd | None":
        g = _NAME.fullmatch(name)
        if g is None or int(g.group(1)) not in MATRICES:
            return None
        return Winograd(int(g.group(1)), int(g.group(2)), int(g.group(3)))


def applies(graph, prim) -> bool:
    """Is `prim` a convolution Winograd computes: 3x3, stride 1, no dilation, one group, a constant
    weight, static 4-D shapes?"""
    if prim.op != "conv" or prim.type.rank != 4 or not prim.type.static or prim.inputs[1] not in graph.constants:
        return False
    w = np.shape(graph.constants[prim.inputs[1]])
    return (len(w) == 4 and tuple(w[2:]) == (3, 3) and tuple(prim.attr("strides", (1, 1))) == (1, 1)
            and tuple(prim.attr("dilations", (1, 1))) == (1, 1) and prim.attr("group", 1) == 1)


def winograd_variants(machine, graph, prim, in_block: int | None) -> tuple[Winograd, ...]:
    """The Winograd variants of conv `prim` in the blocked layout (input blocked by `in_block`):
    F(2x2) and F(4x4), each with the widest output-channel tile that divides the channels (two
    vectors, else one) and the longest row tile the registers allow. () when it does not apply: the
    input transform is vectorized over a block of input channels and the output transform over
    vectors of output channels, so both must be blocked."""
    lanes = machine.lanes
    out_c = int(prim.type.shape[1])
    in_c = int(graph.type_of(prim.inputs[0]).shape[1])
    if not applies(graph, prim) or in_block is None or in_c % in_block or out_c % lanes:
        return ()
    nb = 2 * lanes if out_c % (2 * lanes) == 0 else lanes
    mr = max(r for r, n in row_options(lanes, machine.vector_registers, (nb // lanes,)) if n == nb) \
        if nb > lanes else min(machine.vector_registers - 3, 16)
    ow = int(prim.type.shape[3])
    return tuple(Winograd(m, min(mr, -(-ow // m)), nb) for m in sorted(MATRICES))


def transform_weight(w: np.ndarray, m: int, nb: int) -> np.ndarray:
    """U = G g G^T of every (output, input) channel pair, in float64, packed `[(m+2)^2, O/nb, C, nb]`."""
    _, g, _ = MATRICES[m]
    o, c = w.shape[:2]
    a = m + 2
    u = np.einsum("ai,ocij,bj->aboc", g, np.asarray(w, np.float64), g)
    return np.ascontiguousarray(u.reshape(a * a, o // nb, nb, c).transpose(0, 1, 3, 2).astype(np.float32))


def untransform_weight(u: np.ndarray, m: int, shape: tuple[int, ...]) -> np.ndarray:
    """The 3x3 weight back from its packed transform (G has full column rank: its pseudo-inverse)."""
    _, g, _ = MATRICES[m]
    o, c = shape[:2]
    a = m + 2
    full = np.asarray(u, np.float64).transpose(0, 1, 3, 2).reshape(a, a, o, c)
    gi = np.linalg.pinv(g)
    return np.einsum("ia,aboc,jb->ocij", gi, full, gi).astype(np.float32)


def _lincomb(T, terms):
    """sum(c * x) over (c, x) with small constant coefficients: +-1 as additions."""
    out = None
    for c, x in terms:
        if out is None:
            out = x if c == 1 else (-x if c == -1 else T.tir.const(float(c), "float32") * x)
        elif c == 1:
            out = out + x
        elif c == -1:
            out = out - x
        else:
            out = out + T.tir.const(float(c), "float32") * x
    return out if out is not None else T.tir.const(0.0, "float32")


def _choose(T, index, exprs):
    """exprs[index] for a loop variable `index`; the schedule unrolls that loop, so every choice
    folds to one expression (a lazy if_then_else, so no branch is evaluated for nothing)."""
    out = exprs[-1]
    for k in range(len(exprs) - 2, -1, -1):
        out = T.tir.if_then_else(index == k, exprs[k], out)
    return out


def te_conv(T, data, u, attrs, out_shape, w: Winograd):
    """The convolution of `data` (logical [N, C, H, W]) with the transformed weight `u` (packed as
    `transform_weight` gives it), logical [N, O, OH, OW] out: stages "wino_V" (input transform,
    [a, a, N, TH, TW, C]), "wino_M" (the GEMMs, [a, a, N, TH, TW, O]) and "wino_Y" (output
    transform)."""
    bt, _, at = MATRICES[w.m]
    m, a = w.m, w.alpha
    n_ = data.shape[0]  # (the images: a symbolic batch too, a loop outside every stage)
    c_, h_, w_ = (int(d) for d in data.shape[1:])
    o_, oh, ow = (int(d) for d in out_shape[1:])
    pt, pl = int(attrs["pads"][0]), int(attrs["pads"][1])
    th_, tw_ = -(-oh // m), -(-ow // m)
    zero = T.tir.const(0.0, "float32")

    def v_body(ea, eb, n, th, tw, c):
        def d(i, j):
            y, x = th * m + i - pt, tw * m + j - pl
            return T.tir.if_then_else(T.tir.all(y >= 0, y < h_, x >= 0, x < w_), data[n, c, y, x], zero)
        return _choose(T, ea, [_choose(T, eb, [
            _lincomb(T, [(bt[ka, i] * bt[kb, j], d(i, j)) for i in range(a) for j in range(a) if bt[ka, i] * bt[kb, j]])
            for kb in range(a)]) for ka in range(a)])

    v = T.te.compute((a, a, n_, th_, tw_, c_), v_body, name="wino_V")
    rc = T.te.reduce_axis((0, c_), name="rc")
    nb = w.nb
    mm = T.te.compute((a, a, n_, th_, tw_, o_),
                      lambda ea, eb, n, th, tw, o: T.te.sum(v[ea, eb, n, th, tw, rc] * u[ea * a + eb, o // nb, rc, o % nb],
                                                            axis=rc), name="wino_M")

    def y_body(n, o, h, x):
        th, hi, tw, wi = h // m, h % m, x // m, x % m
        return _choose(T, hi, [_choose(T, wi, [
            _lincomb(T, [(at[i, ka] * at[j, kb], mm[ka, kb, n, th, tw, o]) for ka in range(a) for kb in range(a)
                         if at[i, ka] * at[j, kb]])
            for j in range(m)]) for i in range(m)])

    return T.te.compute((n_, o_, oh, ow), y_body, name="wino_Y")
