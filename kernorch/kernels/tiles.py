"""Register tiles of the contraction micro-kernel, derived from the machine.

The micro-kernel computes an `mr x nb` block of the output in vector registers: `mr` rows
(unrolled; one broadcast of the left operand per row and k), `nb` columns (`nb / lanes` vectors of
the right operand per k), accumulated over the whole reduction and written back once with the
fused epilogue. It must fit the register file:

    mr * v  accumulators  +  v  right-operand vectors  +  1  broadcast  <=  vector registers,
    v = nb / lanes

and it must keep the FMA units busier than the load ports: per k it issues `mr * v` FMAs for
`mr + v` loads, so v = 1 (one vector of columns) is load-bound and only used when the output has
fewer columns than two vectors. v is a power of two: LLVM splits a 3-register-wide vector badly
(measured on AVX-512: 9x48 ran at 13 GFLOP/s where 14x32 ran at 167). From that rule, per v in
(2, 4), the largest `mr` and about half of it are offered (AVX-512, 32 registers of 16 lanes: 14x32,
8x32, 6x64, 4x64; AVX2, 16 registers of 8 lanes: 6x16, 4x16; BLIS uses 12x32 and 6x16 on those
ISAs). Which one wins depends on the shape (M tails, cache reuse), so each is measured and the
fastest kept; a tile whose `nb` does not divide the output's columns is not offered (no guarded
vector tail).
"""
from __future__ import annotations

import re
from dataclasses import dataclass

MAX_ROWS = 16       # longer unrolled row tiles only grow the code: the register budget binds first
MIN_ROWS = 3        # below this, the broadcast loads dominate
_NAME = re.compile(r"t(\d+)x(\d+)(p?)(r?)(s?)((?:~\d+@\d+)*)")
_SWITCH = re.compile(r"~(\d+)@(\d+)")
# a contraction of at most this many multiply-adds is also offered serial tiles: a parallel launch
# cost about 3 us on a 2-core Zen 4 VM, as long as about 2**17 multiply-adds take on one core there
# (110 GFLOP/s); up to twice that, which of the two is faster is left to the measurement
SERIAL_MAX_MACS = 1 << 18


@dataclass(frozen=True, order=True)
class Tile:
    """One register tile: `mr` rows x `nb` columns. `pack`: the constant operand is packed for it.
    `rows_outer`: the parallel loop walks row tiles outside column tiles (the whole right operand
    stays in L2 while each row panel is reused from L1); otherwise column panels are outside (each
    packed K x nb panel stays in cache while every row tile passes over it). `serial`: no parallel
    loop (a small contraction's whole work costs less than handing half of it to another thread).
    `switch`: over a symbolic row extent (kernorch.dynamic), other row counts for longer lengths,
    as (from this many rows, mr) pairs in ascending order; the kernel holds a copy of the
    micro-kernel per row count and picks one by the length at run time ("t8x32p~14@108": 14 rows
    from 108 rows on). Only `mr` changes: the copies share the packing and the loop order."""

    mr: int
    nb: int
    pack: bool = False
    rows_outer: bool = False
    serial: bool = False
    switch: tuple[tuple[int, int], ...] = ()

    def __post_init__(self):
        starts = [s for s, _ in self.switch]
        if starts != sorted(set(starts)) or any(s < 2 or m < 1 for s, m in self.switch):
            raise ValueError(f"row switch {self.switch}: ascending starts of at least 2 rows expected")

    @property
    def name(self) -> str:
        """The schedule name stored in the profile database and the plan, e.g. "t14x32p", "t8x32rs",
        "t8x32p~14@108"."""
        return (f"t{self.mr}x{self.nb}{'p' if self.pack else ''}{'r' if self.rows_outer else ''}"
                f"{'s' if self.serial else ''}" + "".join(f"~{m}@{s}" for s, m in self.switch))

    @staticmethod
    def parse(name: str) -> "Tile | None":
        m = _NAME.fullmatch(name)
        if not m:
            return None
        switch = tuple((int(s), int(r)) for r, s in _SWITCH.findall(m.group(6)))
        try:
            return Tile(int(m.group(1)), int(m.group(2)), bool(m.group(3)), bool(m.group(4)), bool(m.group(5)),
                        switch)
        except ValueError:
            return None

    def registers(self, lanes: int) -> int:
        """Vector registers the tile occupies (accumulators, operand vectors, one broadcast)."""
        v = -(-self.nb // lanes)
        return self.mr * v + v + 1


def row_options(lanes: int, registers: int, widths=(2, 4)) -> list[tuple[int, int]]:
    """(mr, nb) pairs the register rule allows, before the shape is known, for `widths` vectors."""
    out: list[tuple[int, int]] = []
    for v in widths:
        full = min(MAX_ROWS, (registers - v - 1) // v)
        if full < MIN_ROWS:
            continue
        half = max(MIN_ROWS, full // 2 + 1)
        for mr in dict.fromkeys((full, half) if v != 3 else (full,)):  # three wide: only where 2 and 4 do not fit
            out.append((mr, v * lanes))
    return out


def contraction_tiles(machine, rows: int, cols: int, depth: int, pack: bool = False,
                      split_vectors: bool = False) -> tuple[Tile, ...]:
    """The tiles worth measuring for a contraction with `rows` x `cols` outputs and reduction `depth`.

    `rows` is the extent of the unrolled row axis (M of a GEMM), `cols` the vectorized one (N),
    `depth` the reduction (K). Returns () when no tile fits the columns (the default schedule then
    applies). The loop order comes from the L2 size: rows outside when the whole right operand
    (depth x cols floats) fits in half of it. `split_vectors`: the schedule unrolls the tile's
    columns over single vector registers (the convolution micro-kernel does), so three vectors
    wide is as good as two or four (48 channels on AVX-512).
    """
    lanes, regs = machine.lanes, machine.vector_registers
    rows_outer = depth * cols * 4 <= machine.l2_kib * 1024 // 2
    tiles: list[Tile] = []
    for mr, nb in row_options(lanes, regs, (2, 3, 4) if split_vectors else (2, 4)):
        if cols % nb == 0:
            tiles.append(Tile(min(mr, rows), nb, pack, rows_outer))
    if not tiles and cols % lanes == 0:  # fewer columns than the wider tiles: one vector wide
        tiles.append(Tile(min(regs - 3, MAX_ROWS, rows), lanes, pack, rows_outer))
    return tuple(dict.fromkeys(tiles))


def row_tile(mr: int, extent: int) -> int:
    """The row tile of a micro-kernel of at most `mr` rows over `extent` rows: `mr`, or the largest
    tile of at least half of it that divides `extent` (no guarded tail), or the extent when it is
    shorter."""
    if extent <= mr:
        return extent
    return next((r for r in range(mr, (mr + 1) // 2 - 1, -1) if extent % r == 0), mr)
