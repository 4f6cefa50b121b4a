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
ISAs). A tile one register over does not pay: on Zen 4 a 7x64 GEMM tile (two accumulators
spilled) ran 7 rows in one pass 9-14 % faster than 4x64's two, alone with the weights cold, but in
the transformer block at seq=512 it took 1.2x 4x64's time, and 2x with a GELU prologue fused (its
registers spill too). Which one wins depends on the shape (M tails, cache reuse), so each is
measured and the fastest kept; a tile whose `nb` does not divide the output's columns is not offered (no guarded
vector tail), unless no tile does: a matmul's columns are then padded to the tile (`pad_cols`).
"""
from __future__ import annotations

import re
from dataclasses import dataclass

MAX_ROWS = 16       # longer unrolled row tiles only grow the code: the register budget binds first
MIN_ROWS = 3        # below this, the broadcast loads dominate
_NAME = re.compile(r"t(\d+)x(\d+)(p?)(r?)(s?)((?:~\d+:\d+@\d+(?:,\d+@\d+)*)*)")
_COPY = re.compile(r"~(\d+):([\d@,]+)")
_POINT = re.compile(r"(\d+)@(\d+)")
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
    `copies`: over a symbolic row extent (kernorch.dynamic), the row counts the kernel holds a copy
    of the micro-kernel for, each with its measured cost curve: (mr, ((passes, ns), ...)), the
    time at so many row tiles (passes) of `mr` rows, ascending (`curve_ns` reads between and
    beyond the points). At run time the copy whose curve is least at ceil(rows / mr) passes runs
    (`pick`; ties: the first). "t14x32p~14:2@160000,8@490000~8:1@130000,3@210000": at 7 rows,
    8 rows (1 pass: 130 us against 160, which 14 rows take at 2 passes and are held to below).
    Only `mr` changes: the copies share the packing and the loop order."""

    mr: int
    nb: int
    pack: bool = False
    rows_outer: bool = False
    serial: bool = False
    copies: tuple[tuple[int, tuple[tuple[int, int], ...]], ...] = ()

    def __post_init__(self):
        rows = [m for m, _ in self.copies]
        if len(set(rows)) != len(rows) or any(
                m < 1 or not pts or [p for p, _ in pts] != sorted({p for p, _ in pts}) or pts[0][0] < 1
                or any(t < 0 for _, t in pts) for m, pts in self.copies):
            raise ValueError(f"row copies {self.copies}: distinct row counts, each with a curve of ascending "
                             "pass counts (>= 1) and times >= 0 expected")

    @property
    def name(self) -> str:
        """The schedule name stored in the profile database and the plan, e.g. "t14x32p", "t8x32rs",
        "t14x32p~14:2@160000,8@490000~8:1@130000"."""
        return (f"t{self.mr}x{self.nb}{'p' if self.pack else ''}{'r' if self.rows_outer else ''}"
                f"{'s' if self.serial else ''}"
                + "".join(f"~{m}:" + ",".join(f"{p}@{t}" for p, t in pts) for m, pts in self.copies))

    @staticmethod
    def parse(name: str) -> "Tile | None":
        m = _NAME.fullmatch(name)
        if not m:
            return None
        copies = tuple((int(r), tuple((int(p), int(t)) for p, t in _POINT.findall(pts)))
                       for r, pts in _COPY.findall(m.group(6)))
        try:
            return Tile(int(m.group(1)), int(m.group(2)), bool(m.group(3)), bool(m.group(4)), bool(m.group(5)),
                        copies)
        except ValueError:
            return None

    def pick(self, rows: int) -> int:
        """The row count of the copy that runs at `rows` rows (what the kernel computes at run
        time): with `copies`, at up to max(SMALL_ROWS) rows the least SMALL_ROWS copy that holds
        them, where there is one; else the copy whose curve is least there (among the others: a
        SMALL_ROWS copy was timed at its own row count only, and more rows take it more passes
        over the weights); without, `ran_copy`. At one or two rows a copy of more rows streams the
        same weights and only adds multiply-adds, so it is not timed against the small copies
        there: its curve, held below its first point, gives it the time it took at 5 rows, and a
        384 x 384 GEMM (Zen 3, 2 threads, weights in L3) timed its one-row copy at 9.7-15.4 us in
        four runs against 12.8-13.9 for the 6-row copy at 5 rows: seq=1 ran 6 rows in the
        projections whenever the noise fell that way."""
        if not self.copies:
            return ran_copy(self.mr, rows)
        small = sorted(m for m, _ in self.copies if m in SMALL_ROWS)
        others = [c for c in self.copies if c[0] not in SMALL_ROWS]
        holding = [m for m in small if m >= rows]
        if holding:
            return holding[0]
        if not others:
            return small[-1]
        return min(others, key=lambda c: copy_cost(c[1], c[0], rows))[0]

    def registers(self, lanes: int) -> int:
        """Vector registers the tile occupies (accumulators, operand vectors, one broadcast)."""
        v = -(-self.nb // lanes)
        return self.mr * v + v + 1


@dataclass(frozen=True)
class LengthSwitch:
    """One kernel over a symbolic length in two register tiles, the length choosing at run time:
    `first` (a Tile's name) at lengths up to `until`, `then` above ("t14x32r|22|t6x64r"). An
    attention's fastest tile can change with the length (one of bert_like's over seq=1..512, Xeon
    model 167: t14x32r at 8, 9.9 us against t8x32r's 11.0; t8x32r at 64; t6x64r at 512), while a
    plan over the range is weighed by its short lengths: a gpt_like one plan ran its 14-row tile at
    32 rows, 22 us a layer against 10 in the static plan of 32. Micro-kernels chosen by the length,
    as a tile's row copies are (HAOTuner). The two may also be one packed tile in its two loop orders
    ("t14x32pr~...|2|t14x32p~...", the same packing: executed.measured_loop_order)."""
    first: str
    until: int
    then: str

    @property
    def name(self) -> str:
        return f"{self.first}|{self.until}|{self.then}"

    @staticmethod
    def parse(name: str) -> "LengthSwitch | None":
        parts = name.split("|")
        if len(parts) != 3 or not parts[1].isdigit() or Tile.parse(parts[0]) is None or Tile.parse(parts[2]) is None:
            return None
        return LengthSwitch(parts[0], int(parts[1]), parts[2])


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
                      split_vectors: bool = False, pad_cols: bool = False) -> tuple[Tile, ...]:
    """The tiles worth measuring for a contraction with `rows` x `cols` outputs and reduction `depth`.

    `rows` is the extent of the unrolled row axis (M of a GEMM), `cols` the vectorized one (N),
    `depth` the reduction (K). Returns () when no tile fits the columns (the default schedule then
    applies). The loop order comes from the L2 size: rows outside when the whole right operand
    (depth x cols floats) fits in half of it. `split_vectors`: the schedule unrolls the tile's
    columns over single vector registers (the convolution micro-kernel does), so three vectors
    wide is as good as two or four (48 channels on AVX-512). `pad_cols`: where no tile of two or
    more vectors divides the columns, those longer than a tile are padded to it (the schedule pads
    the contraction's domain and copies its tiles out guarded, backends.tvm.schedule._pad_to_tile:
    the scores of an attention at seq=300, 6 heads, Zen 3, 2 threads: 0.5-0.8 ms in t6x16r against
    2.3 in the default schedule); not for a packed operand, whose layout has no padding.
    """
    lanes, regs = machine.lanes, machine.vector_registers
    rows_outer = depth * cols * 4 <= machine.l2_kib * 1024 // 2
    tiles: list[Tile] = []
    for mr, nb in row_options(lanes, regs, (2, 3, 4) if split_vectors else (2, 4)):
        if cols % nb == 0:
            tiles.append(Tile(min(mr, rows), nb, pack, rows_outer))
    if not tiles and pad_cols and not pack:  # no tile divides the columns: padded to the tile
        tiles += [Tile(min(mr, rows), nb, pack, rows_outer) for mr, nb in row_options(lanes, regs) if cols > nb]
    if not any(cols % t.nb == 0 for t in tiles) and cols % lanes == 0:  # one vector wide
        tiles.append(Tile(min(regs - 3, MAX_ROWS, rows), lanes, pack, rows_outer))
    return tuple(dict.fromkeys(tiles))


def row_tile(mr: int, extent: int) -> int:
    """The row tile of a micro-kernel of at most `mr` rows over `extent` rows: `mr`, or the largest
    tile of at least half of it that divides `extent` (no guarded tail), or the extent when it is
    shorter."""
    if extent <= mr:
        return extent
    return next((r for r in range(mr, (mr + 1) // 2 - 1, -1) if extent % r == 0), mr)


# over a symbolic row extent, a tile without fitted `copies` also holds a copy of each row count of
# SMALL_ROWS below its own, run at exactly that many rows (seq=1 and 2), where a padded row tile
# only adds multiply-adds to the same weight stream. At one row the product is a matrix-vector one:
# Zen 3, 2 threads, seq x 384 x 1536 with the weights packed, 1 row took 30 us in the one-row tile,
# 34 in a 2-row one, 45 in a 6-row one; at 2 rows the one-row tile takes 51 us (two passes over the
# weights), the 2-row one 34, the 6-row one 47 (without the 2-row copy the block ran seq=2 in 1.41x
# its time). Each is timed at its length (`kernorch.dynamic.probe_points`).
SMALL_ROWS = (1, 2)


# over a symbolic length, an attention whose key tile is wider than NARROW_KEYS columns also holds a
# copy in key tiles of NARROW_KEYS columns (its keys padded to NARROW_KEYS, not to the tile) for
# short lengths. Measured on a Xeon (family 6 model 207, 2 threads; a transformer block's attention,
# 6 heads of 64, with its K bias, t6x16r against t6x64r): 9.5 against 18.7 us at seq=7, 12.5 against
# 23.5 at 16, 28 against 37 at 32, 41 against 46 at 48; a key of the narrow tile costs 1.10x one
# of the wide at 64, 1.14x at 128, 1.17x at 512
NARROW_KEYS = 16
NARROW_KEYS_COST = (12, 10)  # a key of the narrow copy against a key of the wide tile: 1.2


def narrow_keys(nb: int, length: int) -> bool:
    """Whether an attention with key tiles of `nb` columns runs its NARROW_KEYS copy at `length`
    keys: where its padded keys, at NARROW_KEYS_COST each, cost less than the tile's (for a
    64-wide tile 1-48, 65-96, 129-144 and 193-208 keys; for a 32-wide one 1-16 and 33-48)."""
    num, den = NARROW_KEYS_COST
    return nb > NARROW_KEYS and num * passes(NARROW_KEYS, length) * NARROW_KEYS < den * passes(nb, length) * nb


def passes(mr: int, rows: int) -> int:
    """Row tiles of `mr` rows over `rows` rows (the last one padded)."""
    return -(-rows // mr)


def ran_copy(mr: int, rows: int) -> int:
    """The row count a tile of `mr` rows without fitted copies runs at `rows` symbolic rows: the
    SMALL_ROWS copy of exactly `rows` rows where there is one below `mr` (seq=1 and 2), else its own."""
    return rows if rows in SMALL_ROWS and rows < mr else mr


def curve_ns(points, p: int) -> int:
    """A copy's cost curve (ascending (passes, ns) points) at `p` passes: linear between two
    points; below the first, the first (held, not extrapolated: one pass of 14 rows costs more
    than half of two when the weight stream, not the FMAs, bounds it); beyond the last, the last
    segment's slope (one point alone: proportional). Integer arithmetic, as the kernel's test."""
    (p0, t0) = points[0]
    if p <= p0:
        return t0
    if len(points) == 1:
        return t0 * p // p0
    segments = list(zip(points, points[1:]))
    (p1, t1), (p2, t2) = next((a, b) for a, b in segments if p <= b[0]) if p <= points[-1][0] else segments[-1]
    return t1 + (p - p1) * (t2 - t1) // (p2 - p1)


# a row copy's curve counts its padded rows against it: the rows it computes past the length add
# PADDED_ROWS (a fraction) of their share of its work to its cost. The curves are timed with the
# weights where the model's size puts them, and a copy that streams them from memory hides its
# multiply-adds; in the model some of those weights are still cached, and the padded rows cost.
# gpt_like (30 MB of weights, timed flushed), its seq x 384 x 1536 GEMM at 7 rows: the 14-row copy
# timed 95.4 us, the 8-row one 97.2; in the model the 14-row one ran 56 us, the 8-row one 49.
PADDED_ROWS = (1, 10)


def copy_cost(points, mr: int, rows: int) -> int:
    """What a copy of `mr` rows with cost curve `points` costs at `rows` rows when copies are
    compared (`Tile.pick`): its curve at its passes, plus PADDED_ROWS of it for the share of the
    rows it computes that are padding. Integer arithmetic, as the kernel's own test
    (backends.tvm.schedule._copy_cost)."""
    p = passes(mr, rows)
    t = curve_ns(points, p)
    computed = mr * p
    num, den = PADDED_ROWS
    return t + t * (computed - rows) * num // (den * computed)


def fit_copies(times: dict[int, dict[int, float]]) -> tuple[tuple[int, tuple[tuple[int, int], ...]], ...]:
    """The cost curves of the row copies a tile family holds, from its tiles' times over symbolic
    rows. `times`: per tile row count (a tile without copies), its time in ns at each length it
    was timed at. At each length a tile ran one copy (`ran_copy`: its own or a SMALL_ROWS one) at
    some number of passes; a copy's curve holds its time at every pass count it ran at, three
    significant digits. Where several tiles ran the same copy at the same passes (every tile of a
    family runs the one-row copy at seq=1), that is one code timed several times, and the least
    time is kept: noise only ever slows a timing. (The mean let one slowed timing decide a copy:
    a seq x 384 x 384 GEMM, Zen 3, timed its 2-row copy at seq=1 in 10.7 and 14.2 us, the mean
    lost to the 6-row copy's 12.0 us at seq=5, and seq=1 ran 6 rows: 13.1 us against 9.5, alone and hot.)
    Returns (mr, ((passes, ns), ...)) per copy, the largest row count first."""
    points: dict[int, dict[int, list[float]]] = {}
    for mr, by_length in times.items():
        for rows, ns in by_length.items():
            c = ran_copy(mr, rows)
            points.setdefault(c, {}).setdefault(passes(c, rows), []).append(float(ns))
    return tuple((mr, tuple((p, _three_digits(t)) for p, t in
                            _under_chords([(p, min(ts)) for p, ts in sorted(points[mr].items())])))
                 for mr in sorted(points, reverse=True))


DISTURBED = 1.10  # a curve's inner point this far above the chord of its neighbours was slowed by noise


def _under_chords(points: list[tuple[int, float]]) -> list[tuple[int, float]]:
    """A copy's curve with every inner point more than DISTURBED above the chord of its two
    neighbours lowered onto that chord, until none is: noise only ever slows a timing, and a tile's
    time grows about linearly with its passes (on the Xeon model 207 an 8-row copy was stored at
    839 us for 14 passes where its neighbours, 3 and 64 passes, put 569; the copy chosen at those
    lengths followed the outlier in three sessions). The ends stay as measured."""
    pts = list(points)
    for _ in range(len(pts) ** 2):
        lowered = False
        for i in range(1, len(pts) - 1):
            (p0, t0), (p, t), (p1, t1) = pts[i - 1], pts[i], pts[i + 1]
            chord = t0 + (p - p0) * (t1 - t0) / (p1 - p0)
            if t > DISTURBED * chord:
                pts[i], lowered = (p, chord), True
        if not lowered:
            break
    return pts


def _three_digits(x: float) -> int:
    return int(float(f"{max(x, 0.0):.3g}"))
