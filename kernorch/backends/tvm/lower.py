"""Lowering: a candidate kernel (a convex set of prims) to one TIR PrimFunc "main".

The primitives' TE computes (kernorch.primitives) are composed in topological order; packed
constant operands (kernorch.kernels.pack) enter as placeholders of their packed shape with an
"unpack" view that the schedule inlines.
"""
from __future__ import annotations

import json

import types
from dataclasses import replace
from typing import Sequence

import tvm
import tvm.sym
from tvm import te, tirx, topi

from ... import primitives
from ...candidates import attention_parts
from ...masks import CAUSAL_OPERAND
from ...ir import Graph, KernorchError, Prim, SymDim, TensorType
from ...kernels import LengthSwitch, Tile, Winograd, blocked, split, variant_out_packs, variant_packs
from ...kernels.tiles import NARROW_KEYS, NARROW_KEYS_COST, SMALL_ROWS, row_tile
from ...kernels.winograd import te_conv as winograd_conv


PERIOD_MAX = 4096  # the longest period `divisible` checks value by value


def divisible(extent, k: int) -> bool:
    """An extent (a symbolic one provably: a length padded to a tile, or a reduction's whole chunks
    n - ((n - 1) % 16 + 1)) is a multiple of `k`. What TVM's analyzer cannot prove is checked over
    one period: an expression of one variable built from integer constants, +, -, * and floor
    division or modulo by constants (products by constants only), taken modulo k, repeats every k
    times the product of its divisors."""
    if isinstance(extent, (int, tirx.IntImm)):
        return int(extent) % k == 0
    if tvm.sym.Analyzer().can_prove(tirx.floormod(extent, k) == 0):
        return True
    names: set[str] = set()
    period = k

    def walk(e) -> bool:  # the variables and divisors of `extent`; False for anything else
        nonlocal period
        if isinstance(e, tirx.Var):
            names.add(e.name)
            return True
        if isinstance(e, tirx.IntImm):
            return True
        if isinstance(e, tirx.Cast):
            return walk(e.value)
        if isinstance(e, (tirx.FloorDiv, tirx.FloorMod)):
            if not isinstance(e.b, tirx.IntImm) or int(e.b.value) <= 0:
                return False
            period *= int(e.b.value)
        if isinstance(e, tirx.Mul) and not isinstance(e.a, tirx.IntImm) and not isinstance(e.b, tirx.IntImm):
            return False  # (a product of variables: not checked)
        return isinstance(e, (tirx.Add, tirx.Sub, tirx.Mul, tirx.FloorDiv, tirx.FloorMod)) and walk(e.a) and walk(e.b)

    def value(e, v: int) -> int:  # `extent` at the variable's value v
        if isinstance(e, tirx.Var):
            return v
        if isinstance(e, tirx.IntImm):
            return int(e.value)
        if isinstance(e, tirx.Cast):
            return value(e.value, v)
        a, b = value(e.a, v), value(e.b, v)
        if isinstance(e, tirx.Add):
            return a + b
        if isinstance(e, tirx.Sub):
            return a - b
        if isinstance(e, tirx.Mul):
            return a * b
        return a // b if isinstance(e, tirx.FloorDiv) else a % b

    if not walk(extent) or len(names) != 1 or period > PERIOD_MAX:
        return False
    return all(value(extent, v) % k == 0 for v in range(1, period + 1))


#: The TVM namespace handed to the primitive table's TE computes (they never import tvm).
T = types.SimpleNamespace(te=te, tir=tirx, topi=topi, divisible=divisible)

NUM_INPUTS_ATTR = "kernorch.num_inputs"
BOUNDS_ATTR = "kernorch.bounds"  # a kernel over a range: {symbol: the largest value it serves}
DERIVED_ATTR = "kernorch.derived"  # its variables for products of symbols: {name: the dimension's JSON} (`Symbols`)
UNPACK = "unpack"  # TE stages that read a packed operand as its logical tensor (always inlined)
VIEW = "view"      # TE stages that read an operand re-indexed (rows clamped, columns masked; always inlined)
BLOCK = "block"    # TE stages that write a kernel output in a blocked layout
ROWS_OUT = "rows_out"  # the TE stage that copies a padded attention's real rows out
QUERIES_PADDED = "queries_padded"  # the TE stage that copies a padded attention's queries into zero rows
OPERAND_PADDED = "operand_padded"  # the TE stages that copy a padded attention's mask or bias into zeros
CAUSAL_ATTR = "kernorch.causal"  # an attention whose keys past each query row are masked (`causal_attention`)


def symbol_vars(func) -> dict[str, tirx.Var]:
    """A kernel's symbolic dimensions (kernorch.dynamic) as the variables its parameters' shapes use,
    by name ({} for a static kernel)."""
    return {d.name: d for buf in func.params for d in buf.shape if isinstance(d, tirx.Var)}


def derived_bounds(func, bounds: dict[str, int]) -> dict[str, int]:
    """`bounds` ({symbol: largest value}) with the largest value of each of `func`'s derived
    variables (DERIVED_ATTR: a product of symbols, its largest value at theirs)."""
    attrs = func.attrs
    if not bounds or attrs is None or DERIVED_ATTR not in attrs:
        return bounds
    from ...ir import from_json_value
    out = dict(bounds)
    for name, text in attrs[DERIVED_ATTR].items():
        d = from_json_value(json.loads(str(text)))
        if all(n in bounds for n in d.names):
            out[str(name)] = d.subs(bounds)
    return out


def num_inputs(func) -> int:
    """How many of a kernel's parameters are inputs (NUM_INPUTS_ATTR; without it, all but the last)."""
    attrs = func.attrs
    return int(attrs[NUM_INPUTS_ATTR]) if attrs is not None and NUM_INPUTS_ATTR in attrs else len(func.params) - 1


def bounds_of(func) -> dict[str, int]:
    """A kernel's BOUNDS_ATTR: {symbol: the largest value it serves}, {} for a static kernel."""
    attrs = func.attrs
    return {k: int(v) for k, v in attrs[BOUNDS_ATTR].items()} if attrs is not None and BOUNDS_ATTR in attrs else {}


NARROW_KEYS_FUNC = "narrow_keys"  # the module's copy of an attention in narrow key tiles
NARROW_KEYS_WHEN = "kernorch.narrow_keys_when"  # its attribute: the length condition it runs under
AT_LENGTH_FUNC = "at_length_"  # + n: the module's static copy of a kernel at length n ...
AT_LENGTH_WHEN = "kernorch.at_length_when"  # ... and its attribute: the condition on main's length
SWITCH_FIRST = "first_"  # the functions of a length switch's first tile (kernels.LengthSwitch) are named so


def lower(graph: Graph, members: Sequence[Prim], inputs: Sequence[str], outputs: Sequence[str],
          schedule: str = "default") -> tvm.IRModule:
    """Compose the members' TE computes into one PrimFunc `main(*inputs, *outputs)`.

    `members` must be in topological order; every input of a member is another member or a name in
    `inputs` (graph inputs, constants/weights and other kernels' results are all plain params here).
    `schedule` names the kernel variant (kernorch.kernels.variants): inputs it takes in another
    layout (a packed weight, a blocked activation) are parameters of the packed shape read through
    an "unpack" view, and outputs it writes blocked are computed through a "block" view, so the
    members' computes stay in logical coordinates.

    An attention over a symbolic length in key tiles wider than NARROW_KEYS columns also gets a
    copy in key tiles of NARROW_KEYS (`NARROW_KEYS_FUNC`, its keys padded to NARROW_KEYS), with the
    condition on `main`'s length under which it runs (attribute `NARROW_KEYS_WHEN`,
    kernorch.kernels.tiles.narrow_keys); `schedule` joins the two.

    A tiled kernel over a symbolic length whose matmul's columns are that length (an attention, its
    scores) also gets a static copy at each length of SMALL_ROWS (`AT_LENGTH_FUNC` + n, lowered on
    the graph bound to that length, unpadded, with the condition `AT_LENGTH_WHEN` on `main`'s
    length), which `schedule` runs under the default rule there (`_static_copies`).

    A length switch (kernels.LengthSwitch) is lowered once per tile: its `then` tile's module, and
    its `first` tile's functions named with SWITCH_FIRST before them; `schedule` joins the two.
    """
    layout, inner = split(schedule)
    switch = LengthSwitch.parse(inner)
    if switch is not None:
        def tile(name: str) -> str:
            return name if layout is None else blocked(layout, name)
        first = lower(graph, members, inputs, outputs, tile(switch.first))
        then = lower(graph, members, inputs, outputs, tile(switch.then))
        return tvm.IRModule({**{SWITCH_FIRST + gv.name_hint: first[gv] for gv in first.get_global_vars()},
                             **{gv.name_hint: then[gv] for gv in then.get_global_vars()}})
    func, padded = _lowered(graph, members, inputs, outputs, schedule)
    funcs = {"main": func}
    if padded is not None and padded.narrow:
        layout, inner = split(schedule)
        narrow_name = replace(Tile.parse(inner), nb=NARROW_KEYS).name
        narrow, _ = _lowered(graph, members, inputs, outputs,
                             narrow_name if layout is None else blocked(layout, narrow_name))
        funcs[NARROW_KEYS_FUNC] = narrow.with_attr(NARROW_KEYS_WHEN, padded.narrow_when())
    if Tile.parse(split(schedule)[1]) is not None:
        funcs.update(_static_copies(graph, members, inputs, outputs, schedule, func))
    return tvm.IRModule(funcs)


def _static_copies(graph: Graph, members: Sequence[Prim], inputs: Sequence[str], outputs: Sequence[str],
                   schedule: str, main: tirx.PrimFunc) -> dict[str, tirx.PrimFunc]:
    """The static copies of a tiled kernel over one symbolic length whose contraction's columns are
    that length (an attention, its scores: the tile pads the keys as well as the rows) at each
    length of SMALL_ROWS: {AT_LENGTH_FUNC + n: the members lowered on the graph bound to n, with
    AT_LENGTH_WHEN, a condition on `main`'s length}; none when the kernel takes an operand in
    another layout (the copies read the plain ones). The tiles' padded domain costs a short length
    as much as 7 rows and 16 keys: the transformer block's attention over seq (t8x32r, Zen 4, 2
    threads) took 9 us at seq=1, 2 and 4, where the static kernel in the default schedule takes
    0.3, 1.8 and 5.7; its scores alone 3.4 and 3.6 us at seq=1 and 2, static 0.1 and 0.5 (inside
    the executable at seq=1, 3 -> 2 us). Not probabilities x values (a symbolic depth): there the
    default schedule's copy took 4 us inside the executable at seq=1, the tile's 1."""
    from ...dynamic import bind, symbols
    names = symbols(graph)
    if len(names) != 1 or variant_packs(graph, inputs, schedule) or variant_out_packs(graph, outputs, schedule):
        return {}
    (name,) = names

    def wide(p: Prim) -> bool:  # a matmul whose columns are symbolic
        return p.op == "matmul" and isinstance(p.type.shape[-1], SymDim)
    length = symbol_vars(main).get(name)
    if length is None or not any(wide(p) for p in members):
        return {}
    out = {}
    for n in SMALL_ROWS:
        bound = bind(graph, {name: n})
        func, _ = _lowered(bound, [bound.by_name[p.name] for p in members], inputs, outputs, "default")
        out[f"{AT_LENGTH_FUNC}{n}"] = func.with_attr(AT_LENGTH_WHEN, length == tirx.IntImm(length.ty.dtype, n))
    return out


def _lowered(graph: Graph, members: Sequence[Prim], inputs: Sequence[str], outputs: Sequence[str],
             schedule: str) -> tuple[tirx.PrimFunc, "_PaddedAttention | None"]:
    """`lower`'s PrimFunc for `schedule`, and the padded attention it computes (or None)."""
    env: dict[str, te.Tensor] = {}
    params: list[te.Tensor] = []
    packs = variant_packs(graph, inputs, schedule)
    out_packs = variant_out_packs(graph, outputs, schedule)
    sym = Symbols()
    sym.define([graph.type_of(n).shape for n in (*inputs, *outputs)])
    wino = Winograd.parse(split(schedule)[1])  # a Winograd variant: its conv is computed by kernels.winograd
    for i, name in enumerate(inputs):
        t = sym.type(graph.type_of(name))
        if any(isinstance(d, str) for d in t.shape):
            raise KernorchError(f"kernel input {name!r} has an unbound symbolic shape {t}; bind the shape first")
        if i in packs:
            pk = sym.pack(packs[i])
            ph = te.placeholder(pk.packed_shape, t.dtype, name=f"in{i}_packed_{_ident(name)}")
            env[name] = pk.te_view(T, ph, f"{UNPACK}{i}")
        else:
            ph = te.placeholder(tuple(t.shape), t.dtype, name=f"in{i}_{_ident(name)}")
            env[name] = ph
        params.append(ph)
    member_names = {p.name for p in members}
    padded = _PaddedAttention.of(graph, members, schedule, sym)
    norm = _InTileNormalization.of(graph, members, schedule)
    for p in members:
        if norm is not None and p.name == norm.final:
            env[p.name] = env[norm.values]  # (normalized before the contraction: `_InTileNormalization`)
            continue
        d = primitives.get(p.op)
        if d.te is None:
            raise KernorchError(f"prim {p.name} ({p.op}, from {p.origin or '?'}) has no TE compute; "
                                "it must run as an opaque kernel, not inside a TIR kernel")
        missing = [t for t in p.inputs if t not in env]
        if missing:
            kind = "a later member" if any(m in member_names for m in missing) else "neither a member nor an input"
            raise KernorchError(f"prim {p.name} ({p.op}) reads {missing} which is {kind} of the kernel")
        args = [env[t] for t in p.inputs]
        want = sym.type(p.type)
        if padded is not None and padded.padded(p.name):
            args, want = padded.operands(graph, p, args), padded.type(p.type)
        if norm is not None and p.name == norm.values:
            args = [norm.normalized(args[0], env[norm.row]), *args[1:]]
        if wino is not None and p.op == "conv":
            out = winograd_conv(T, args[0], args[1], p.a, want.shape, wino)
        else:
            out = d.te(T, args, sym.value(p.a), want)
        if not sym.same_shape(out.shape, want.shape) or out.dtype != p.type.dtype:
            raise KernorchError(f"TE compute of {p.op} ({p.name}) gave {out.dtype}{list(out.shape)}, "
                                f"expected {p.type}")
        if padded is not None and p.name == padded.values:
            out = padded.rows_out(out, sym.type(p.type))
        elif padded is not None and padded.padded(p.name):
            out = padded.result(p, out)
        env[p.name] = out
    for o in outputs:
        if o not in member_names:
            raise KernorchError(f"kernel output {o!r} is not computed by a member")
    results = [sym.pack(out_packs[j]).te_block(T, env[o], f"{BLOCK}{j}") if j in out_packs else env[o]
               for j, o in enumerate(outputs)]
    func = te.create_prim_func(params + results, index_dtype_override="int64" if sym.vars else None)
    if causal_attention(graph, members, outputs):
        func = func.with_attr(CAUSAL_ATTR, True)
    return sym.with_derived(func.with_attr(NUM_INPUTS_ATTR, len(inputs))), padded


def causal_attention(graph: Graph, members: Sequence[Prim], outputs: Sequence[str]) -> bool:
    """Whether the kernel is an attention (kernorch.candidates.attention_parts) whose softmax input
    is its scores plus a causal mask (kernorch.masks: an add marked CAUSAL_OPERAND read only by the
    softmax's max and shift), and whose outputs hold no tensor along the keys: then each row tile
    may skip the keys past its last row (the schedule's `_skip_masked_keys`)."""
    if not any(p.attr(CAUSAL_OPERAND) is not None for p in members):
        return False  # (most kernels: no attention's parts to find)
    parts = attention_parts(graph, [p.name for p in members])
    if parts is None:
        return False
    scores, chain, values = parts
    inside = {p.name for p in members}
    for name in chain:
        p = graph.by_name[name]
        if p.op != "add" or p.attr(CAUSAL_OPERAND) is None:
            continue
        readers = [c for c in graph.consumers.get(name, ()) if c.name in inside]
        if name in outputs or not readers or any(c.op not in ("reduce_max", "sub") for c in readers):
            continue
        keys = graph.type_of(scores).shape[-1]
        along = [o for o in outputs if o != values and (o == scores or o in chain)
                 and graph.type_of(o).shape[-1] == keys]
        return not along
    return False


def _ceil(extent, k: int):
    """`extent` rounded up to a multiple of `k`."""
    return (extent + k - 1) // k * k


KEYS_MULTIPLE = NARROW_KEYS  # static keys not a multiple of this (of 8 or 16 lanes) are padded like symbolic ones


def _index(value, like):
    """`value` (an int or an expression) as an index of `like`'s dtype."""
    dtype = primitives._dt(like)
    return tirx.const(value, dtype) if isinstance(value, int) else value.astype(dtype)


def _zero_padded(x, axis: int, length, padded, name: str):
    """`x` copied with its axis `axis` grown to `padded`, zero past `length` (its reads clamped into
    the buffer)."""
    def value(*i):
        k = i[axis]
        at = list(i)
        at[axis] = tirx.min(k, _index(length - 1, k))
        return tirx.if_then_else(k < _index(length, k), x(*at), tirx.const(0, x.dtype))
    shape = list(x.shape)
    shape[axis] = padded
    return te.compute(tuple(shape), value, name=name)


class _InTileNormalization:
    """An attention kernel (kernorch.candidates.attention_parts) whose values' result is divided
    (or multiplied) row by row by a member of its chain: the softmax normalization moved past the
    values (kernorch.rewrite.after_attention), which spares a pass over the probabilities wherever
    the softmax and the values are kernels of their own. Inside one kernel a row tile has its sums
    before its values' contraction, so the kernel normalizes its probabilities there, in cache,
    and the values' result is the kernel's (the same numbers up to rounding); as written, the
    schedule could not place the sum: TVM moves a block under the row tile only with all of its
    consumers, and the normalization after the values can follow the tile only with all of its
    producers."""

    def __init__(self, values: str, final: str, row: str, op: str):
        self.values, self.final, self.row, self.op = values, final, row, op

    @classmethod
    def of(cls, graph: Graph, members: Sequence[Prim], schedule: str) -> "_InTileNormalization | None":
        if Tile.parse(split(schedule)[1]) is None:
            return None
        inside = {p.name for p in members}
        parts = attention_parts(graph, inside)
        if parts is None:
            return None
        _, chain, values = parts
        readers = graph.consumers.get(values, ())
        if values in graph.outputs or len(readers) != 1 or readers[0].name not in inside:
            return None
        f = readers[0]
        rows = [t for t in f.inputs if t != values]
        if f.op not in ("mul", "div") or len(f.inputs) != 2 or len(rows) != 1 or rows[0] not in chain:
            return None
        if f.op == "div" and f.inputs[0] != values:
            return None
        probs = graph.type_of(graph.by_name[values].inputs[0]).shape
        row = graph.type_of(rows[0]).shape
        if tuple(f.type.shape) != tuple(graph.by_name[values].type.shape) or tuple(row) != (*probs[:-1], 1):
            return None
        return cls(values, f.name, rows[0], f.op)

    def normalized(self, probs, row):
        """The probabilities the values' contraction reads, each row scaled by its factor."""
        def at(*i):
            r = row(*i[:-1], _index(0, i[-1]))
            return probs(*i) * r if self.op == "mul" else probs(*i) / r
        return te.compute(probs.shape, at, name="probs_normalized")


class _PaddedAttention:
    """An attention kernel (kernorch.candidates.attention_parts) over a symbolic length (or over
    static keys that are no multiple of KEYS_MULTIPLE: seq=300), computed on a domain padded to its
    tile, so that the schedule's micro-kernels, row tiles and reductions run without a guard at any
    length:

    * the scores' rows (queries) are padded to the tile's rows: the queries are copied into a
      buffer with zero rows past the length (rows past the length compute on them and are never
      written out). Read in place, clamped to the last row, each of a tile's rows took a pointer of
      its own, spilled and reloaded at every step of the scores' micro-kernel (seq=512, 6 heads
      of 64, one thread, Xeon family 6 model 207: 7.7 -> 7.2 ms);
    * the scores' columns (keys) are padded to the tile's columns: the keys are copied into a
      buffer with zero columns past the length (read along the vectorized columns, a clamp would
      make each vector load a gather), every reduction of the chain over the columns reads the
      columns past the length as its identity (the lowest float for a max, 0 for a sum), and the
      probabilities are computed as 0 there (`result`). The values' matmul contracts over the
      padded columns (over the real ones alone, the probabilities would be computed over a
      symbolic width, one element at a time), so the values are copied into a buffer with zero
      rows past the length too. Read clamped to the last row, every step of the values'
      micro-kernel clamped its row index and reloaded spilled pointers (seq=512, 6 heads of 64,
      t4x64r, one thread, Xeon family 6 model 207: 4.83 and 5.20 -> 4.80 and 4.78 ms; the
      static kernel 4.34);
    * the output's rows are copied out of the padded result (the schedule does it per row tile).

    A member that reads another tensor along the scores' rows or columns (a mask or a bias of the
    length) reads it copied with zeros past the length (`_padded_operand`); a reduction other than
    a max or a sum over the padded keys is refused."""

    IDENTITY = {"reduce_max": lambda dtype: tirx.min_value(dtype), "reduce_sum": lambda dtype: tirx.const(0, dtype)}

    def __init__(self, graph: Graph, parts, tile: Tile, sym: "Symbols"):
        self.scores, chain, self.values = parts
        self.chain = set(chain)
        self.probs = graph.by_name[self.values].inputs[0]
        s = graph.by_name[self.scores]
        self.rdim, self.cdim = s.type.shape[-2], s.type.shape[-1]
        self.rows, self.cols = sym.expr(self.rdim), sym.expr(self.cdim)
        self.pad_rows = not isinstance(self.rdim, int) or self.rdim % row_tile(tile.mr, self.rdim) != 0
        self.pad_cols = not isinstance(self.cdim, int) or self.cdim % KEYS_MULTIPLE != 0
        self.prows = _ceil(self.rows, tile.mr) if self.pad_rows else self.rows
        self.pcols = _ceil(self.cols, tile.nb) if self.pad_cols else self.cols
        self.sym = sym
        # a copy in narrow key tiles serves the short lengths (`lower`)
        self.narrow = self.pad_cols and not isinstance(self.cdim, int) and tile.nb > NARROW_KEYS

    def narrow_when(self):
        """The condition on the length under which the copy in NARROW_KEYS-column key tiles runs
        (kernorch.kernels.tiles.narrow_keys)."""
        num, den = (tirx.IntImm("int64", c) for c in NARROW_KEYS_COST)
        return num * _ceil(self.cols, NARROW_KEYS) < den * self.pcols

    @classmethod
    def of(cls, graph: Graph, members: Sequence[Prim], schedule: str, sym: "Symbols") -> "_PaddedAttention | None":
        tile = Tile.parse(split(schedule)[1])
        parts = attention_parts(graph, [p.name for p in members]) if tile is not None else None
        if parts is None:
            return None
        s = graph.by_name[parts[0]].type.shape
        if isinstance(s[-2], int) and isinstance(s[-1], int) and s[-1] % KEYS_MULTIPLE == 0:
            return None  # (static keys a multiple of the vectors: the schedule tiles them as they are)
        return cls(graph, parts, tile, sym)

    def padded(self, name: str) -> bool:
        return name in self.chain or name in (self.scores, self.values)

    def type(self, t: TensorType) -> TensorType:
        """A member's type on the padded domain."""
        shape = list(self.sym.type(t).shape)
        if len(shape) >= 2 and t.shape[-2] == self.rdim:
            shape[-2] = self.prows
        if len(shape) >= 2 and t.shape[-1] == self.cdim and t.shape[-2] == self.rdim:
            shape[-1] = self.pcols
        return TensorType(tuple(shape), t.dtype)

    def operands(self, graph: Graph, p: Prim, args: list) -> list:
        if p.name == self.scores:
            a, b = args
            if self.pad_rows:
                a = _zero_padded(a, -2, self.rows, self.prows, QUERIES_PADDED)
            if self.pad_cols:
                b = _zero_padded(b, -1, self.cols, self.pcols, "keys_padded")
            return [a, b]
        if p.name == self.values:
            probs, v = args
            if self.pad_cols:  # the keys past the length weigh nothing (`result` zeroed their probabilities)
                v = _zero_padded(v, -2, self.cols, self.pcols, "values_padded")
            return [probs, v]
        out = []
        for t, x in zip(p.inputs, args):
            if t != self.scores and t not in self.chain:
                shape = graph.type_of(t).shape
                if any(d != 1 for d in shape[-2:]):
                    x = self._padded_operand(p, t, shape, x)
            elif p.op.startswith("reduce") and self.pad_cols:
                if p.op not in self.IDENTITY:
                    raise KernorchError(f"padded attention: {p.name} is a {p.op} over the "
                                        "padded keys (only a max or a sum can skip them)")
                x = self._masked(x, self.IDENTITY[p.op](x.dtype))
            out.append(x)
        return out

    def _padded_operand(self, p: Prim, t: str, shape, x):
        """A tensor read along the scores' rows or columns (a mask or a bias of the length: BERT's
        key mask, GPT's causal mask) on the padded domain: copied with zeros past the length
        (the columns past it are the reductions' identities and zero probabilities whatever they
        hold, the rows past it are never written out). Any other shape is refused."""
        if len(shape) < 2 or shape[-1] not in (1, self.cdim) or shape[-2] not in (1, self.rdim):
            raise KernorchError(f"padded attention: {p.name} ({p.op}) reads {t} of shape "
                                f"{list(shape)} along the scores' rows or columns")
        if shape[-1] != 1 and self.pad_cols:
            x = _zero_padded(x, -1, self.cols, self.pcols, f"{OPERAND_PADDED}_keys")
        if shape[-2] != 1 and self.pad_rows:
            x = _zero_padded(x, -2, self.rows, self.prows, f"{OPERAND_PADDED}_rows")
        return x

    def result(self, p: Prim, out):
        """A member's result: the probabilities the values' contraction reads, with the columns past
        the length zeroed where they are computed (vectorized along the columns, a blend), so that
        the contraction's inner loop reads them as they are. Masked inside that loop, every step
        loaded each row's probability under a mask (seq=512, 6 heads of 64, one thread, Xeon family
        6 model 207: 5.35 against 5.15 ms; at 2 threads the same, 2.65 ms)."""
        if not self.pad_cols or p.name != self.probs:
            return out
        return self._masked(out, tirx.const(0, out.dtype), "probs_masked")

    def _masked(self, x, identity, name: str = f"{VIEW}_mask"):
        """`x` (a padded intermediate: every column is in bounds) with the columns past the length
        read as `identity`. A Select, which vectorizes to a blend: an if_then_else (evaluated
        lazily) is computed lane by lane (the masked max and sum over 6 x 512 x 512 scores: +1.2 ms)."""
        cols = self.cols
        return te.compute(x.shape, lambda *i: tirx.Select(i[-1] < _index(cols, i[-1]), x(*i), identity), name=name)

    def rows_out(self, out, want: TensorType):
        """The values' result on the real rows (a copy of the padded one)."""
        if not self.pad_rows:
            return out
        return te.compute(tuple(want.shape), lambda *i: out(*i), name=ROWS_OUT)


class Symbols:
    """The TIR variables of one kernel's symbolic dimensions (kernorch.dynamic.SymDim): one int64
    variable per symbol, shared by every shape and attribute that uses it.

    A PrimFunc learns its variables from its parameters' shapes, and only where a dimension is the
    variable itself. A kernel whose parameters hold a symbol only inside a product (a GEMM over the
    flattened rows batch*seq of batch=1..8, seq=1..512) gets a variable of its own for that
    dimension (`define`: "batch_seq" for batch*seq, named in DERIVED_ATTR), and every other
    dimension of the kernel is written over it where it can be (batch*seq*4 as 4*batch_seq);
    where it cannot (batch alone in an attribute, no parameter holding it), the kernel is refused."""

    def __init__(self):
        self.vars: dict[str, tirx.Var] = {}
        self.derived: dict[str, SymDim] = {}  # variable name -> the dimension it stands for (c * monomial)

    def define(self, shapes) -> None:
        """The variables of a kernel whose parameters have `shapes`: each symbol that some parameter
        has as a whole dimension; then a variable for each remaining dimension of one term (c *
        a monomial of the other symbols)."""
        dims = [d for shape in shapes for d in shape if isinstance(d, SymDim)]
        bare = {d.names[0] for d in dims if d.terms == ((((d.names[0], 1),), 1),)}  # (the symbol itself)
        for d in dims:
            if len(d.terms) == 1 and not set(d.names) & bare and not any(d == x for x in self.derived.values()):
                self.derived["_".join(n if p == 1 else f"{n}{p}" for n, p in d.terms[0][0])
                             + (f"_{d.terms[0][1]}" if d.terms[0][1] != 1 else "")] = d

    def _term(self, mono, c):
        """c * mono over the variables: its derived factor first (c must hold that factor's
        coefficient to the power taken), the bare symbols after."""
        rest, factor = dict(mono), None
        for name, d in self.derived.items():
            (dm, dc), = d.terms
            k = min((rest.get(n, 0) // p for n, p in dm), default=0)
            if k and all(rest.get(n, 0) == k * p for n, p in dm) and c % (dc ** k) == 0:
                factor, c = (name, k), c // (dc ** k)
                for n, _ in dm:
                    del rest[n]
                break
        missing = [n for n in rest if n in {m for d in self.derived.values() for m in d.names}]
        if missing:
            raise KernorchError(f"the kernel uses {missing[0]} in {SymDim.of([(mono, c)])}, which none of its "
                                f"parameters holds on its own ({', '.join(map(str, self.derived.values()))})")
        t = None
        for n, p in ([factor] if factor else []) + list(rest.items()):
            v = self.vars.setdefault(n, tirx.Var(n, "int64"))
            for _ in range(p):
                t = v if t is None else t * v
        return tirx.IntImm("int64", c) if t is None else t if c == 1 else tirx.IntImm("int64", c) * t

    def expr(self, d):
        if not isinstance(d, SymDim):
            return d
        e = None
        for mono, c in d.terms:
            t = self._term(mono, c)
            e = t if e is None else e + t
        return e

    def with_derived(self, func):
        """`func` naming its derived variables (DERIVED_ATTR), when it has any."""
        if not self.derived:
            return func
        return func.with_attr(DERIVED_ATTR, {n: json.dumps(d.to_json()) for n, d in self.derived.items()})

    def value(self, v):
        if isinstance(v, dict):
            return {k: self.value(x) for k, x in v.items()}
        if isinstance(v, tuple):
            return tuple(self.value(x) for x in v)
        return self.expr(v)

    def type(self, t: TensorType) -> TensorType:
        return t if t.static else TensorType(tuple(self.expr(d) for d in t.shape), t.dtype)

    def pack(self, pack):
        """`pack` (kernorch.kernels.Pack) over these variables (an activation blocked over a
        symbolic batch)."""
        return replace(pack, shape=tuple(self.expr(d) for d in pack.shape))

    def same_shape(self, got, want) -> bool:
        if len(got) != len(want):
            return False
        if not self.vars:
            return tuple(int(s) for s in got) == tuple(want)
        ana = tvm.sym.Analyzer()
        return all(ana.can_prove_equal(g, w) for g, w in zip(got, want))


def _ident(name: str) -> str:
    return "".join(c if c.isalnum() else "_" for c in name)[:40]

