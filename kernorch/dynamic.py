"""Symbolic dimensions: one primitive graph for a whole range of a dimension (e.g. seq=1..512).

A model exported with a symbolic axis (an ONNX `dim_param`) is fissioned at a few probe values of
that symbol; the prim graphs are aligned by name (fission names a prim after its ONNX node, so the
names agree across probes) and every integer that differs between them (a dimension of a type, a
reshape target, a slice end) is fitted as a polynomial of degree at most 2 in the symbol and checked
on one more probe. The result is one generic graph whose dimensions are `SymDim`s; `bind` turns it
back into the static graph of any value in the range, the same graph fission would give there
(the tests check exactly that on values that were not probes).

A folded constant whose values change with the value (position ids from `Range`, a causal mask
from the shape) becomes a `slice` prim of its value at the range's largest value, when every
probe's value is the leading part of that one along the axes that grow.

Several symbols at once (batch=1..8 and seq=1..512): the model is fissioned at every combination
of their probes (4 x 4), and each integer is fitted one symbol after the other, a polynomial with
each symbol of degree <= 2 (batch*seq for rows flattened by a Reshape to (-1, 64)). The range is
then timed at every combination of each symbol's samples, weighted by the product of their
weights. Plans per sample dispatch along one of the symbols (`pipeline.sample_choices`); buckets
with edges, observed lengths and row copies are one symbol's.

What is refused, with the node named: a graph whose structure changes with the value (a different
set of prims, different wiring, an attribute that is not an integer changing), an integer that
follows no integer polynomial of degree <= 2 (e.g. seq // 2), and a folded constant that changes
with the value in another way.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace
from fractions import Fraction
from typing import Any, Callable, Mapping, Sequence

import numpy as np

from .ir import Graph, KernorchError, Prim, SymDim, TensorType
from .kernels.tiles import SMALL_ROWS
from .options import Options

PRIMES = (61, 67, 71, 73, 79, 83, 89, 97, 101, 103, 107, 109, 113, 127, 131, 137, 139, 149, 151, 157, 163,
          167, 173, 179, 181, 191, 193, 197, 199, 211, 223, 227, 229, 233, 239, 241, 251, 2, 3, 5, 7, 11, 13, 17,
          19, 23, 29, 31, 37, 41, 43, 47, 53, 59)
PROBES = 4   # three to fit a polynomial of degree 2, one to check it


@dataclass(frozen=True)
class Range:
    name: str
    lo: int
    hi: int

    def __post_init__(self):
        if not 1 <= self.lo <= self.hi:
            raise KernorchError(f"shape range {self.name}={self.lo}..{self.hi}: need 1 <= lo <= hi")

    def __contains__(self, value: int) -> bool:
        return self.lo <= value <= self.hi

    def probes(self) -> list[int]:
        """PROBES distinct values in the range, primes first (they collide with no power-of-two dim,
        so a misfit shows), else evenly spread values."""
        out = [p for p in PRIMES if p in self][:PROBES]
        if len(out) < PROBES:
            span = range(self.lo, self.hi + 1)
            out += [v for v in span if v not in out][:PROBES - len(out)]
        if len(out) < PROBES:
            raise KernorchError(f"shape range {self.name}={self.lo}..{self.hi} holds fewer than {PROBES} values: "
                                "bind it with a static shape instead")
        return sorted(out)


SAMPLES = Options().sample_count  # lengths a range of one symbol is timed at, by default (--samples)


def points(ranges, lengths=(), count: int = SAMPLES) -> tuple[dict[str, int], ...]:
    """`count` (>= 3) bindings that stand for a range (`ranges`: (name, lo, hi) triples): its ends
    and, between them, values evenly spaced on a log scale (three over 1..512: 1, 23, 512; four: 1,
    8, 64, 512), or with observed `lengths` (what users send) their percentiles evenly spaced from
    the 10th to the 90th within the range. Several symbols: every combination of each one's
    `count` points (observed lengths weigh one symbol only)."""
    if count < 3:
        raise KernorchError(f"--samples {count}: a range is timed at 3 lengths or more")
    if len(ranges) > 1:  # several symbols: every combination of each one's points
        _one_symbol_lengths(ranges, lengths)
        out = [{}]
        for r in ranges:
            out = [{**b, **p} for b in out for p in points((r,), (), count)]
        return tuple(out)
    name, lo, hi = ranges[0]
    steps = [i / (count - 1) for i in range(count)]
    if lengths:
        inside = sorted(v for v in lengths if lo <= v <= hi)
        if not inside:
            raise KernorchError(f"none of the observed lengths lies in {name}={lo}..{hi}")
        pts = tuple(inside[min(len(inside) - 1, int((0.1 + 0.8 * f) * len(inside) + 1e-9))] for f in steps)
    else:
        pts = tuple(min(hi, max(lo, round(lo * (hi / lo) ** f))) for f in steps)
    return tuple({name: p} for p in pts)


def samples(ranges, lengths=(), weights=(), count: int = SAMPLES) -> tuple:
    """Where a kernel over a range is timed, with weights: the `points`, weighted by the trapezoid
    rule over a log-uniform length (each octave of the range counts the same: three points 1/4,
    1/2, 1/4), with observed lengths over their percentiles; a point met twice counts once with
    both weights. `weights` (one per sample, from `relative_weights`) replace them."""
    if len(ranges) > 1:  # several symbols: every combination of each one's samples, weights multiplied
        _one_symbol_lengths(ranges, lengths)
        grid: list[tuple[tuple, float]] = [((), 1.0)]
        for r in ranges:
            grid = [(b + p, w * v) for b, w in grid for p, v in samples((r,), (), (), count)]
        return _weighted_samples(tuple((tuple(sorted(b)), w) for b, w in grid), weights)
    out: dict[tuple, float] = {}
    pts = points(ranges, lengths, count)
    inner = 1.0 / (len(pts) - 1)
    for i, binding in enumerate(pts):
        key = tuple(sorted(binding.items()))
        out[key] = out.get(key, 0.0) + (inner / 2 if i in (0, len(pts) - 1) else inner)
    return _weighted_samples(tuple(out.items()), weights)


def _weighted_samples(out: tuple, weights) -> tuple:
    """The (binding, weight) pairs `out`, their weights replaced by `weights` when given."""
    if weights:
        if len(weights) != len(out):
            raise KernorchError(f"{len(weights)} sample weights for {len(out)} samples")
        return tuple((b, float(w)) for (b, _), w in zip(out, weights))
    return out


def _one_symbol_lengths(ranges, lengths) -> None:
    if lengths:
        raise KernorchError(f"observed lengths (--lengths) weigh one symbol; {len(ranges)} vary "
                            f"({', '.join(n for n, _, _ in ranges)})")


def along(samples_ns, ranges, name: str) -> dict[int, int]:
    """A kernel's times at its samples (Measurement.samples_ns, named by `sample_key`) where every
    symbol of `ranges` but `name` is at its lowest value, by the value of `name`."""
    if len(ranges) == 1:
        return dict(samples_ns)
    names = sorted(n for n, _, _ in ranges)
    lows = {n: lo for n, lo, _ in ranges}
    i = names.index(name)
    return {key[i]: ns for key, ns in samples_ns
            if all(v == lows[n] for n, v in zip(names, key) if n != name)}


def sample_key(binding) -> int | tuple[int, ...]:
    """What a kernel's time at one sample binding is named by (Measurement.samples_ns, the pipeline's
    lengths): its one symbol's value, or the values of several in the order of their names."""
    items = sorted(dict(binding).items())
    return int(items[0][1]) if len(items) == 1 else tuple(int(v) for _, v in items)


def key_text(ranges, key) -> str:
    """A sample's key (`sample_key`) as text, its symbols named: "seq=8", "batch=1,seq=8"."""
    return _at(tuple(sorted(n for n, _, _ in ranges)), key if isinstance(key, tuple) else (key,))


def samples_of(options: Options) -> tuple:
    """The `samples` a run's options ask for: their range, observed lengths, weights and count."""
    return samples(options.ranges, options.lengths, options.sample_weights, options.sample_count)


def relative_weights(graph, ranges, lengths, floor_ns, count: int = SAMPLES) -> tuple[float, ...]:
    """The samples' weights when each length counts by its time *relative* to the model there: each
    share of `samples` divided by the model's floor at that length (`floor_ns(bound graph)`), then
    normalized; two significant digits, so a run's database namespace stays the same when the
    machine's calibration moves a little. A plain weighted sum of times lets the longest length
    decide every choice (seq=512 takes 150 times as long as seq=1: a tile that is 2x slower at
    seq=1 and 1 % faster at 512 wins); relative, each octave of lengths counts the same in the
    ratio to its own best, which is what a user of every length sees."""
    raw = [w / max(float(floor_ns(bind(graph, dict(b)))), 1.0) for b, w in samples(ranges, lengths, (), count)]
    total = sum(raw)
    return tuple(float(f"{x / total:.2g}") for x in raw)


def probe_points(ranges, lengths=(), count: int = SAMPLES, along: str | None = None) -> tuple[dict[str, int], ...]:
    """Bindings between the `points`, each the geometric middle of two neighbours (seq=1..512:
    5 and 109), and the lengths in the range a small row copy serves (kernorch.kernels.tiles.
    SMALL_ROWS: seq=2; seq=1 is a point): where a kernel is timed to be seen, not counted
    (kernorch.pipeline.row_copies reads there which micro-kernel wins at which length).

    Several symbols: the values of symbol `along` (a contraction's rows) that one symbol's
    default points and probes have and the samples lack at the other symbols' lowest values
    (batch=1..8 x seq=1..512 along seq: 2, 3, 8, 64 and 181 at batch=1; none without `along`)."""
    if len(ranges) > 1:
        if along is None:
            return ()
        lows = {n: lo for n, lo, _ in ranges if n != along}
        one = next((r,) for r in ranges if r[0] == along)
        sampled = {b[along] for b in points(ranges, lengths, count) if all(b[n] == v for n, v in lows.items())}
        values = {b[along] for b in (*points(one), *probe_points(one))} - sampled
        return tuple({**lows, along: v} for v in sorted(values))
    name, lo, hi = ranges[0]
    values = sorted({b[name] for b in points(ranges, lengths, count)})
    out = ({round(math.sqrt(a * b)) for a, b in zip(values, values[1:])}
           | {r for r in SMALL_ROWS if lo <= r <= hi}) - set(values)
    return tuple({name: v} for v in sorted(out))


def sample_edges(rng: tuple[str, int, int], values) -> tuple[int, ...]:
    """The bucket edges that give each of the ascending lengths `values` in the range `rng` the
    lengths nearer it than its neighbours on a log scale (1, 23, 512 over 1..512: 4, 108, so
    1..4, 5..108, 109..512): a length `v` belongs below the edge between `a` and `b` when
    v * v < a * b. A plan per sample (`kernorch.pipeline.sample_plans`) serves its bucket."""
    _, lo, hi = rng
    return tuple(min(max(math.isqrt(a * b - 1), lo), hi - 1) for a, b in zip(values, values[1:]))


def middle(ranges, lengths=()) -> dict[str, int]:
    """The binding that stands for the range when one length must (tiles, estimates, timing): the
    middle of its three `points`, whatever number of lengths it is timed at (several symbols:
    each one's middle)."""
    if len(ranges) > 1:
        return {n: v for r in ranges for n, v in middle((r,)).items()}
    return points(ranges, lengths, 3)[1]


def parse_lengths(path) -> tuple[int, ...]:
    """Observed lengths from a text file: integers separated by whitespace or commas."""
    from pathlib import Path
    try:
        text = Path(path).read_text()
    except OSError as e:
        raise KernorchError(f"{path}: cannot read the observed lengths ({e.strerror})") from None
    try:
        values = tuple(int(v) for v in text.replace(",", " ").split())
    except ValueError:
        raise KernorchError(f"{path}: observed lengths must be integers separated by spaces, commas or lines") from None
    if not values:
        raise KernorchError(f"{path}: no observed lengths in the file")
    return values


def buckets(rng: tuple[str, int, int], edges: tuple[int, ...]) -> tuple[tuple[str, int, int], ...]:
    """The range `rng` ("seq", lo, hi) cut after each edge: edges (8, 64) over 1..512 give 1..8,
    9..64, 65..512. Each bucket gets a plan of its own; the executable dispatches on the length.
    Every bucket needs PROBES values (its graph is fitted from probes inside it)."""
    name, lo, hi = rng
    cuts = sorted(set(edges))
    if any(not lo <= e < hi for e in cuts):
        raise KernorchError(f"--buckets {','.join(map(str, edges))}: every edge must lie in {lo}..{hi - 1} "
                            f"(the last length of a bucket of {name}={lo}..{hi})")
    out = cut(rng, cuts)
    for _, start, e in out:
        if e - start + 1 < PROBES:
            raise KernorchError(f"bucket {name}={start}..{e} holds fewer than {PROBES} lengths; "
                                "choose edges further apart")
    return out


def cut(rng: tuple[str, int, int], edges) -> tuple[tuple[str, int, int], ...]:
    """The range `rng` cut after each of the ascending `edges` (each in lo..hi-1)."""
    name, lo, hi = rng
    out, start = [], lo
    for e in (*edges, hi):
        out.append((name, start, e))
        start = e + 1
    return tuple(out)


def bucket_of(parts, value: int) -> int | None:
    """The index of the bucket that holds `value` (None outside every bucket); a bucket is
    (name, lo, hi) as `buckets` makes it or (lo, hi) as `plan_buckets` reads it."""
    return next((i for i, part in enumerate(parts) if part[-2] <= value <= part[-1]), None)


def bucket_weights(parts, lengths=()) -> list[float]:
    """Each bucket's share of its range: of the observed `lengths` when given (a bucket none falls
    in keeps a share of 0), else of the log-uniform length (each octave counts the same, as in
    `samples`)."""
    if lengths:
        inside = [sum(1 for v in lengths if lo <= v <= hi) for _, lo, hi in parts]
        if sum(inside):
            return [n / sum(inside) for n in inside]
    logs = [math.log(hi + 1) - math.log(lo) for _, lo, hi in parts]
    return [x / sum(logs) for x in logs]


# a dispatching plan's meta key: "range" where its buckets' kernels were measured over the whole
# range (pipeline.sample_plans), not each over its bucket (kernorch.backends.tvm.relax.build_module)
BUCKET_BOUNDS = "bucket_bounds"
# a dispatching plan's meta key over several symbols: the one its buckets cut (pipeline.sample_choices)
DISPATCH_ON = "dispatch_on"


def plan_buckets(meta) -> list[tuple[int, int]]:
    """The buckets of a plan that dispatches on a symbol (meta["buckets"]: "1..8,9..64,65..512", of
    `dispatch_symbol`), as (lo, hi) pairs; [] for a plan that serves its range with one set of kernels."""
    out = []
    for part in meta.get("buckets", "").split(","):
        if part:
            lo, _, hi = part.partition("..")
            out.append((int(lo), int(hi)))
    return out


def example_bucket(meta) -> int:
    """The bucket of a dispatching plan that serves the middle of its range (where a model over a
    range is timed and profiled); 0 for a plan without buckets."""
    parts = plan_buckets(meta)
    if not parts:
        return 0
    name = dispatch_symbol(meta)
    lo, hi = plan_ranges(meta)[name]
    return bucket_of(parts, middle(((name, lo, hi),))[name])


def dispatch_symbol(meta) -> str | None:
    """The symbol a dispatching plan's buckets cut: its one symbol, or over several the one named
    (meta[DISPATCH_ON]); None for a plan without buckets."""
    if not plan_buckets(meta):
        return None
    names = list(plan_ranges(meta))
    return meta.get(DISPATCH_ON) or (names[0] if len(names) == 1 else None)


def plan_ranges(meta) -> dict[str, tuple[int, int]]:
    """The ranges a plan serves, from its meta ("seq=1..512", written by `pipeline.plan_meta`):
    {"seq": (1, 512)}; empty for a static plan."""
    rs = [parse_range(r) for r in meta.get("ranges", "").split(",") if r]
    return {r.name: (r.lo, r.hi) for r in rs}


def parse_range(text: str) -> Range:
    """'seq=1..512' -> Range('seq', 1, 512)."""
    name, sep, span = text.partition("=")
    lo, dots, hi = span.partition("..")
    if not sep or not dots or not name.strip():
        raise KernorchError(f"--shape {text!r}: expected NAME=LO..HI for a symbolic dimension, e.g. seq=1..512")
    try:
        return Range(name.strip(), int(lo), int(hi))
    except ValueError:
        raise KernorchError(f"--shape {text!r}: LO and HI must be integers") from None


# -- fitting ---------------------------------------------------------------------------------

def fit(name: str, xs: list[int], ys: list[int]) -> int | SymDim:
    """The integer polynomial of degree <= 2 through (xs[:3], ys[:3]) checked on the rest; an int
    when ys do not vary; None when no such polynomial exists."""
    if len(set(ys)) == 1:
        return ys[0]
    (x0, x1, x2), (y0, y1, y2) = xs[:3], ys[:3]
    # Newton's divided differences, exactly
    d01 = Fraction(y1 - y0, x1 - x0)
    d12 = Fraction(y2 - y1, x2 - x1)
    c2 = (d12 - d01) / (x2 - x0)
    c1 = d01 - c2 * (x0 + x1)
    c0 = y0 - c1 * x0 - c2 * x0 * x0
    if any(c.denominator != 1 for c in (c0, c1, c2)):
        return None
    poly = SymDim(name, (int(c0), int(c1), int(c2)))
    if any(poly(x) != y for x, y in zip(xs, ys)):
        return None
    return poly


def fit_grid(names: tuple[str, ...], points, ys: list[int]) -> int | SymDim | None:
    """`fit` over several symbols: the integer polynomial, each symbol of degree <= 2, through the
    values `ys` at `points` (tuples of the symbols' values, a full grid: every combination of each
    symbol's probes). Fitted one symbol at a time: for each value of the first, the polynomial in
    the others; then each of its coefficients as a polynomial of the first (a polynomial with
    integer coefficients has integer ones at every integer value, so none is lost on the way)."""
    if len(names) == 1:
        return fit(names[0], [p[0] for p in points], list(ys))
    rows: dict[int, tuple[list, list]] = {}
    for p, y in zip(points, ys):
        rows.setdefault(p[0], ([], []))[0].append(p[1:])
        rows[p[0]][1].append(y)
    xs, inner = sorted(rows), []
    for x in xs:
        f = fit_grid(names[1:], *rows[x])
        if f is None:
            return None
        inner.append(dict(f.terms) if isinstance(f, SymDim) else {(): f})
    terms = []
    for mono in sorted({m for t in inner for m in t}):
        g = fit(names[0], xs, [t.get(mono, 0) for t in inner])
        if g is None:
            return None
        terms += [(mono + m, c) for m, c in g.terms] if isinstance(g, SymDim) else [(mono, g)]
    return SymDim.of(terms)


def _leaves(value: Any) -> list:
    if isinstance(value, tuple):
        return [leaf for v in value for leaf in _leaves(v)]
    return [value]


def _rebuild(value: Any, it) -> Any:
    if isinstance(value, tuple):
        return tuple(_rebuild(v, it) for v in value)
    return next(it)


def _is_slot(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _at(names: tuple[str, ...], point: tuple[int, ...]) -> str:
    return ",".join(f"{n}={v}" for n, v in zip(names, point))


def _generalize_value(names: tuple[str, ...], probes: list, values: list[Any], where: Callable[[], str]) -> Any:
    """One value (a shape, an attribute) seen at every probe: its integer leaves fitted."""
    first, what = values[0], "/".join(names)
    leaves = [_leaves(v) for v in values]
    if any(len(ls) != len(leaves[0]) for ls in leaves) or any(_shape_of(v) != _shape_of(first) for v in values):
        other = next(i for i, v in enumerate(values) if _shape_of(v) != _shape_of(first) or len(leaves[i]) != len(leaves[0]))
        raise KernorchError(f"{where()} changes structure with {what} ({values[0]!r} at {_at(names, probes[0])}, "
                            f"{values[other]!r} at {_at(names, probes[other])}): not one graph over the range")
    out = []
    for i, leaf in enumerate(leaves[0]):
        column = [ls[i] for ls in leaves]
        if not all(_is_slot(v) for v in column):
            if any(v != leaf for v in column):
                other = next(v for v in column if v != leaf)
                raise KernorchError(f"{where()} has a value that changes with {what} and is not an integer "
                                    f"({column[0]!r} vs {other!r})")
            out.append(leaf)
            continue
        f = fit_grid(names, probes, column)
        if f is None:
            raise KernorchError(f"{where()}: an integer follows no polynomial of {what} of degree <= 2 in each "
                                f"({', '.join(f'{v} at {_at(names, p)}' for p, v in zip(probes, column))})")
        out.append(f)
    return _rebuild(first, iter(out))


def _shape_of(value: Any) -> Any:
    if isinstance(value, tuple):
        return tuple(_shape_of(v) for v in value)
    return type(value).__name__ if not _is_slot(value) else "int"


def _sliced_constant(c: str, names: tuple[str, ...], probes: list, arrays: list, largest: tuple[tuple, Graph]):
    """A folded constant that changes with the length, as a slice of its value at the largest length
    (positions from `Range`, a causal mask from the shape: each probe's value is the leading part of
    the largest one). Returns (the largest value, its slice prim) or None when it is no such thing."""
    if c not in largest[1].constants:
        return None
    hi, big = largest[0], np.asarray(largest[1].constants[c])
    if any(np.ndim(a) != big.ndim or np.asarray(a).dtype != big.dtype for a in arrays):
        return None
    axes, ends = [], []
    for ax in range(big.ndim):
        sizes = [np.shape(a)[ax] for a in arrays]
        if len(set(sizes)) == 1 and sizes[0] == big.shape[ax]:
            continue
        f = fit_grid(names, probes, sizes)
        if not isinstance(f, SymDim) or f.subs(dict(zip(names, hi))) != big.shape[ax]:
            return None
        axes.append(ax)
        ends.append(f)
    if not axes or any(not np.array_equal(a, big[tuple(slice(0, np.shape(a)[ax]) for ax in range(big.ndim))])
                       for a in arrays):
        return None
    shape = tuple(ends[axes.index(ax)] if ax in axes else big.shape[ax] for ax in range(big.ndim))
    attrs = (("axes", tuple(axes)), ("begins", (0,) * len(axes)), ("ends", tuple(ends)), ("steps", (1,) * len(axes)))
    return big, Prim(c, "slice", (f"{c}.whole",), attrs, TensorType(shape, str(big.dtype)),
                     f"constant {c} sliced to the length")


def generalize(graphs: Mapping[tuple[int, ...], Graph], names: tuple[str, ...],
               largest: Callable[[], tuple[tuple[int, ...], Graph]] | None = None) -> Graph:
    """One generic graph from the static graphs fissioned at each probe of the symbols `names`
    (keys: tuples of their values, every combination of each symbol's probes). `largest()`: (the
    ranges' largest values, the graph fissioned there), asked for only when a folded constant
    changes with the length: it becomes a slice of its value there, when it is one (see
    `_sliced_constant`)."""
    what = "/".join(names)
    probes = sorted(graphs)
    gs = [graphs[p] for p in probes]
    first = gs[0]
    for p, g in zip(probes[1:], gs[1:]):
        a, b = [q.name for q in first.prims], [q.name for q in g.prims]
        if a != b:
            diff = next((x for x, y in zip(a, b) if x != y), None) or (set(a) ^ set(b) or {"?"}).pop()
            node = next((q.origin for q in first.prims + g.prims if q.name == diff), diff)
            raise KernorchError(f"the graph's structure changes with {what} (node {node!r}: prim {diff!r} at "
                                f"{_at(names, probes[0])} vs {_at(names, p)}): not one graph over the range")
        if first.outputs != g.outputs or [n for n, _ in first.inputs] != [n for n, _ in g.inputs]:
            raise KernorchError(f"the graph's inputs or outputs change with {what}")
    constants, prims, at_largest = dict(first.constants), [], None
    for c in first.constants:
        arrays = [g.constants.get(c) for g in gs]
        if any(a is None or a.shape != arrays[0].shape or a.dtype != arrays[0].dtype or not (a == arrays[0]).all()
               for a in arrays):
            sliced = None
            if largest is not None and not any(a is None for a in arrays):
                at_largest = at_largest or largest()
                sliced = _sliced_constant(c, names, probes, arrays, at_largest)
            if sliced is None:
                raise KernorchError(f"constant {c!r} changes with {what} and is no leading slice of one constant "
                                    "(a mask or positions computed from the shape in another way?): not supported "
                                    "with a symbolic dimension")
            del constants[c]
            constants[f"{c}.whole"] = sliced[0]
            prims.append(sliced[1])
    for i, p in enumerate(first.prims):
        others = [g.prims[i] for g in gs]

        def where(p=p):
            return f"node {p.origin or p.name!r} (prim {p.name}, {p.op})"
        if any(q.op != p.op or q.inputs != p.inputs or [k for k, _ in q.attrs] != [k for k, _ in p.attrs] for q in others):
            raise KernorchError(f"{where()} changes operator, inputs or attributes with {what}")
        shape = _generalize_value(names, probes, [q.type.shape for q in others], where)
        attrs = tuple((k, _generalize_value(names, probes, [dict(q.attrs)[k] for q in others], where))
                      for k, _ in p.attrs)
        prims.append(replace(p, attrs=attrs, type=TensorType(shape, p.type.dtype)))
    inputs = tuple((n, TensorType(_generalize_value(names, probes, [dict(g.inputs)[n].shape for g in gs],
                                                    lambda n=n: f"input {n!r}"), t.dtype))
                   for n, t in first.inputs)
    return Graph(inputs, first.outputs, tuple(prims), constants, first.name)


# -- binding ---------------------------------------------------------------------------------

def _bind_value(value: Any, binding: Mapping[str, int]) -> Any:
    if isinstance(value, tuple):
        return tuple(_bind_value(v, binding) for v in value)
    if isinstance(value, SymDim):
        return value.subs(binding)
    return value


def bind(graph: Graph, binding: Mapping[str, int]) -> Graph:
    """The static graph of a generic one at `binding` (e.g. {"seq": 128})."""
    def ty(t: TensorType) -> TensorType:
        return TensorType(_bind_value(t.shape, binding), t.dtype)
    prims = tuple(Prim(p.name, p.op, p.inputs, tuple((k, _bind_value(v, binding)) for k, v in p.attrs), ty(p.type),
                       p.origin) for p in graph.prims)
    return Graph(tuple((n, ty(t)) for n, t in graph.inputs), graph.outputs, prims, graph.constants, graph.name)


def symbols(graph: Graph) -> set[str]:
    """The symbols a generic graph's dimensions and attributes use."""
    out: set[str] = set()

    def walk(v):
        if isinstance(v, tuple):
            for x in v:
                walk(x)
        elif isinstance(v, SymDim):
            out.update(v.names)
    for _, t in graph.inputs:
        walk(t.shape)
    for p in graph.prims:
        walk(p.type.shape)
        walk(p.attrs)
    return out


def generic_graph(model, ranges: Range | Sequence[Range], shapes: Mapping[str, tuple] | None = None,
                  rewrites: bool = True) -> Graph:
    """Load `model` (a path or ModelProto whose inputs use the dim_params the `ranges` name) at
    each probe value (with several symbols: every combination of their probes, PROBES ** k
    loads), rewrite it (kernorch.rewrite) when `rewrites`, fission it, and generalize (see the
    module docstring)."""
    from itertools import product

    from . import fission
    from .frontend import onnx as frontend
    from .rewrite import rewrite
    ranges = (ranges,) if isinstance(ranges, Range) else tuple(ranges)
    names = tuple(r.name for r in ranges)
    if len(set(names)) != len(names):
        raise KernorchError(f"--shape names a symbol twice ({', '.join(names)})")
    og = frontend.load(model, shapes)
    for r in ranges:
        if r.name not in og.symbols:
            known = ", ".join(sorted(og.symbols)) or "none"
            raise KernorchError(f"{og.source}: --shape names the symbol {r.name!r}, which no input uses "
                                f"(symbolic dimensions: {known})")
    others = sorted(set(og.symbols) - set(names))
    if others:
        raise KernorchError(f"{og.source}: symbolic dimension(s) {', '.join(others)} are not bound: give each a "
                            "range (--shape NAME=LO..HI) or bind the input (--shape INPUT=DIMS)")

    def at(point: tuple[int, ...]) -> Graph:
        value = dict(zip(names, point))
        bound = {n: tuple(value.get(d, d) if isinstance(d, str) else d for d in t.shape) for n, t in og.inputs
                 if any(d in value for d in t.shape)}
        probe = frontend.load(model, {**dict(shapes or {}), **bound})
        return fission.fission(rewrite(probe).graph if rewrites else probe)
    graphs = {point: at(point) for point in product(*(r.probes() for r in ranges))}
    # a constant that changes with the length: the largest length tells whether it is a slice of one
    top = tuple(r.hi for r in ranges)
    return generalize(graphs, names, lambda: (top, graphs.get(top) or at(top)))
