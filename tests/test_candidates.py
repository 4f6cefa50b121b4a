"""Partitioning and candidate enumeration, checked against brute force on random DAGs."""
from __future__ import annotations

import itertools
import random
import time
from collections import Counter

import numpy as np
import pytest

from kernorch import primitives
from kernorch.candidates import (NOT_CONNECTED, NOT_CONVEX, OPAQUE, OVER_SIZE, TOO_MANY_OUTPUTS, TWO_LINEAR,
                                 EnumOptions, weight, enumerate_all, enumerate_candidates, enumerate_partition, legality)
from kernorch.ir import Graph, KernorchError, SymDim, TensorType, make_prim
from kernorch.partition import Partition, cut_bytes, cut_widths, partition

OPAQUE_ATTRS = {"onnx_op": "Hardmax", "onnx_attrs": (("axis", -1),), "out_index": 0}


class Builder:
    """Builds a Graph by hand; prim types come from the primitive table."""

    def __init__(self):
        self.inputs, self.constants, self.prims, self.types = [], {}, [], {}

    def input(self, name, shape):
        self.inputs.append((name, TensorType(tuple(shape))))
        self.types[name] = TensorType(tuple(shape))
        return name

    def const(self, name, shape):
        self.constants[name] = np.zeros(shape, dtype=np.float32)
        self.types[name] = TensorType(tuple(shape))
        return name

    def add(self, op, *inputs, name=None, **attrs):
        name = name or f"p{len(self.prims)}"
        if op == "opaque":
            t = self.types[inputs[0]]
            attrs = {**OPAQUE_ATTRS, "out_shape": t.shape, "out_dtype": t.dtype}
        typ = primitives.infer(op, [self.types[t] for t in inputs], attrs)
        self.prims.append(make_prim(name, op, inputs, typ, **attrs))
        self.types[name] = typ
        return name

    def graph(self, outputs=None, name="g"):
        consumed = {t for p in self.prims for t in p.inputs}
        outputs = outputs or [p.name for p in self.prims if p.name not in consumed]
        g = Graph(tuple(self.inputs), tuple(outputs), tuple(self.prims), dict(self.constants), name)
        g.validate()
        return g


def random_graph(seed: int, n: int) -> Graph:
    """A random DAG of n prims over 4x4 tensors: unary, binary, reduce, matmul, opaque; some
    prims read only graph inputs or weights, so graphs may be disconnected."""
    rng = random.Random(seed)
    b = Builder()
    sources = [b.input("x", (4, 4)), b.input("y", (4, 4)), b.const("w", (4, 4))]
    ops = ["relu", "exp", "add", "mul", "sub", "matmul", "matmul", "reduce_sum", "opaque"]
    while len(b.prims) < n:
        op = rng.choice(ops)
        arity = 2 if op in ("add", "mul", "sub", "matmul") else 1
        pool = [p.name for p in b.prims[-5:]] * 3 + [p.name for p in b.prims] + sources
        ins = [rng.choice(pool) for _ in range(arity)]
        attrs = {"axes": (-1,), "keepdims": 1} if op == "reduce_sum" else {}
        try:
            b.add(op, *ins, **attrs)
        except KernorchError:
            continue  # shapes did not fit (matmul of a reduced tensor): draw again
    extra = [p.name for p in b.prims if rng.random() < 0.15]
    consumed = {t for p in b.prims for t in p.inputs}
    outs = [p.name for p in b.prims if p.name not in consumed or p.name in extra]
    return b.graph(outs, name=f"random{seed}")


def whole(g: Graph) -> Partition:
    return partition(g, max_prims=max(1, len(g.prims)))[0]


# ---- brute-force oracle ---------------------------------------------------------------------

def descendants(g: Graph) -> dict[str, set[str]]:
    d: dict[str, set[str]] = {}
    for p in reversed(g.prims):
        d[p.name] = set()
        for c in g.consumers.get(p.name, ()):
            d[p.name] |= {c.name} | d[c.name]
    return d


def brute_convex(g, s, desc) -> bool:
    return not any(x not in s and any(b in desc[x] for b in s) for a in s for x in desc[a])


def brute_connected(g, s) -> bool:
    s = set(s)
    comp = {next(iter(s))}
    changed = True
    while changed:
        changed = False
        for p in g.prims:
            if p.name in s:
                for t in p.inputs:
                    if t in s and (t in comp) != (p.name in comp):
                        comp |= {t, p.name}
                        changed = True
    return comp == s


def brute_outputs(g, s) -> list[str]:
    return [p.name for p in g.prims if p.name in s and
            (p.name in g.outputs or any(c.name not in s for c in g.consumers.get(p.name, ())))]


def brute_attention(g, s, desc) -> bool:
    """Two matmuls a, b: b's left operand is computed in the set from a by elementwise prims and
    reductions over the last axis (at least one), with a's shape; b's right operand from outside."""
    a, b = sorted((g.by_name[m] for m in s if primitives.kind(g.by_name[m].op) == "linear"),
                  key=lambda p: [q.name for q in g.prims].index(p.name))
    p_in, v_in = b.inputs
    if a.op != b.op or a.op != "matmul" or p_in not in s or v_in in s or g.type_of(p_in).shape != a.type.shape:
        return False
    between = [g.by_name[m] for m in s if m in desc[a.name] and (m == p_in or p_in in desc[m])]
    kinds = [primitives.kind(p.op) for p in between]
    lasts = all(tuple(x % len(g.type_of(p.inputs[0]).shape) for x in p.attr("axes") or ())
                == (len(g.type_of(p.inputs[0]).shape) - 1,) for p in between if primitives.kind(p.op) == "reduce")
    return set(kinds) <= {"elementwise", "reduce"} and "reduce" in kinds and lasts


def brute_legal(g, s, desc, opts) -> bool:
    kinds = [primitives.kind(g.by_name[m].op) for m in s]
    pairs_ok = kinds.count("linear") <= 1 or (kinds.count("linear") == 2 and brute_attention(g, s, desc))
    closed = [m for m in s if primitives.kind(g.by_name[m].op) == "elementwise"
              and all(t in s or t in g.constants for t in g.by_name[m].inputs)]
    size_ok = len(s) <= opts.max_size or (len(s) <= opts.max_size + opts.max_pointwise
                                          and len(s) - len(closed) <= opts.max_size)
    return (size_ok and pairs_ok and ("opaque" not in kinds or len(s) == 1)
            and brute_connected(g, s) and brute_convex(g, s, desc) and len(brute_outputs(g, s)) <= opts.max_outputs)


# ---- enumeration against brute force --------------------------------------------------------

@pytest.mark.parametrize("seed", range(40))
def test_enumeration_is_exactly_the_legal_sets(seed):
    rng = random.Random(seed)
    g = random_graph(seed, rng.randint(3, 10))
    opts = EnumOptions(max_size=rng.choice([2, 3, 5, 10]), max_outputs=rng.choice([1, 2, 3]),
                       max_pointwise=rng.choice([0, 2, 8]))
    cands, rejected = enumerate_candidates(g, whole(g), opts)
    desc = descendants(g)
    names = [p.name for p in g.prims]
    expected = {frozenset(s) for k in range(1, len(names) + 1) for s in itertools.combinations(names, k)
                if k == 1 or brute_legal(g, set(s), desc, opts)}
    got = [frozenset(c.members) for c in cands]
    assert len(got) == len(set(got)), "a set was generated twice"
    assert set(got) == expected
    for c in cands:
        assert c.outputs == tuple(brute_outputs(g, set(c.members)))
        assert c.members == tuple(sorted(c.members, key=names.index))
        assert c.size == 1 or legality(g, c.members, opts) is None
    for r in rejected:
        assert legality(g, r.members, opts) == r.reason
    # the predicate agrees with the oracle on every subset
    for k in range(2, len(names) + 1):
        for s in itertools.combinations(names, k):
            assert (legality(g, s, opts) is None) == brute_legal(g, set(s), desc, opts)


@pytest.mark.parametrize("seed", range(10))
def test_candidates_of_larger_graphs_are_convex_connected_with_exact_io(seed):
    g = random_graph(100 + seed, 30)
    desc = descendants(g)
    cands, _ = enumerate_candidates(g, whole(g), EnumOptions(max_size=6))
    for c in cands:
        s = set(c.members)
        assert brute_convex(g, s, desc) and brute_connected(g, s)
        assert c.outputs == tuple(brute_outputs(g, s))
        reads = [t for m in c.members for t in g.by_name[m].inputs if t not in s]
        assert c.inputs == tuple(dict.fromkeys(reads))  # ordered by first use, constants included
        assert c.deps == tuple(t for t in c.inputs if t in g.by_name)
        linear = [m for m in c.members if primitives.kind(g.by_name[m].op) == "linear"]
        assert c.linear == (linear[0] if linear else None)
        assert len(linear) <= 1 or (len(linear) == 2 and brute_attention(g, s, desc))


def test_every_singleton_is_a_candidate_even_when_capped():
    g = random_graph(7, 40)
    r = enumerate_partition(g, whole(g), EnumOptions(max_per_partition=10))
    assert r.cap_hit == "max_per_partition"
    assert {p.name for p in g.prims} <= {c.members[0] for c in r.candidates if c.size == 1}


def test_cap_keeps_smaller_candidates_first():
    g = random_graph(3, 40)
    full = enumerate_partition(g, whole(g), EnumOptions(max_size=6, max_pointwise=0))
    capped = enumerate_partition(g, whole(g), EnumOptions(max_size=6, max_pointwise=0,
                                                          max_per_partition=len(full.candidates) // 2))
    assert full.cap_hit is None and capped.cap_hit == "max_per_partition"
    sizes = [c.size for c in capped.candidates]
    assert sizes == sorted(sizes)
    assert len(capped.candidates) == len(full.candidates) // 2
    assert max(sizes) <= sorted(c.size for c in full.candidates)[len(sizes)]  # no larger set displaced a smaller
    wide = enumerate_partition(g, whole(g), EnumOptions(max_size=6, max_visited=50))
    assert wide.cap_hit == "max_visited"


def test_rejections_are_counted_and_truncated():
    g = random_graph(11, 30)
    r = enumerate_partition(g, whole(g), EnumOptions(keep_rejected=2))
    per_reason = Counter(x.reason for x in r.rejected)
    assert all(per_reason[k] == min(2, v) for k, v in r.rejected_counts.items())
    assert sum(r.rejected_counts.values()) > len(r.rejected)


# ---- structural keys ------------------------------------------------------------------------

def rename(g: Graph, f) -> Graph:
    prims = tuple(make_prim(f(p.name), p.op, [f(t) for t in p.inputs], p.type, **p.a) for p in g.prims)
    return Graph(tuple((f(n), t) for n, t in g.inputs), tuple(f(o) for o in g.outputs), prims,
                 {f(k): v for k, v in g.constants.items()}, g.name)


@pytest.mark.parametrize("seed", range(8))
def test_keys_are_name_independent(seed):
    g = random_graph(200 + seed, 20)
    h = rename(g, lambda n: "zz_" + n[::-1])
    a, _ = enumerate_candidates(g, whole(g))
    b, _ = enumerate_candidates(h, whole(h))
    assert Counter(c.key for c in a) == Counter(c.key for c in b)


def mlp_block(b: Builder, x: str, i: int, width: int) -> str:
    w = b.const(f"w{i}", (width, width))
    bias = b.const(f"b{i}", (width,))
    return b.add("relu", b.add("add", b.add("matmul", x, w, name=f"mm{i}"), bias, name=f"add{i}"), name=f"relu{i}")


def test_identical_blocks_share_keys_and_other_shapes_do_not():
    b = Builder()
    x = b.input("x", (8, 16))
    y = mlp_block(b, mlp_block(b, mlp_block(b, x, 0, 16), 1, 16), 2, 16)
    z = b.add("reshape", y, shape=(8, 4, 4))
    b.add("relu", b.add("reshape", z, shape=(8, 16)))  # keeps block 2's output read outside, like block 1's
    b2 = Builder()
    mlp_block(b2, b2.input("x", (8, 32)), 0, 32)
    mlp_block(b2, b2.input("u", (8, 32)), 1, 32)
    g, g2 = b.graph(), b2.graph()
    keys = {c.members: c.key for c in enumerate_candidates(g, whole(g))[0]}
    blocks = [(f"mm{i}", f"add{i}", f"relu{i}") for i in range(3)]
    assert keys[blocks[0]] == keys[blocks[1]] == keys[blocks[2]]
    assert keys[("add0", "relu0")] == keys[("add1", "relu1")]
    keys2 = {c.members: c.key for c in enumerate_candidates(g2, whole(g2))[0]}
    assert keys2[blocks[0]] == keys2[blocks[1]] != keys[blocks[0]]
    # same prims, different outputs: a different kernel
    assert keys[("mm0", "add0")] != keys2[("mm0", "add0")]


# ---- legality reasons -----------------------------------------------------------------------

def small_graph() -> Graph:
    b = Builder()
    x, w = b.input("x", (8, 16)), b.const("w", (16, 16))
    b.add("matmul", x, w, name="mm1")
    b.add("matmul", "mm1", w, name="mm2")
    b.add("relu", "mm2", name="r")
    b.add("add", "r", "mm2", name="a")
    b.add("opaque", "a", name="op")
    b.add("exp", "op", name="e")
    b.add("transpose", x, perm=(1, 0), name="xt")  # shares only an input with mm1
    # softmax over rows of `e`
    b.add("reduce_max", "e", axes=(-1,), keepdims=1, name="mx")
    b.add("sub", "e", "mx", name="sh")
    b.add("exp", "sh", name="ex")
    b.add("reduce_sum", "ex", axes=(-1,), keepdims=1, name="sm")
    b.add("div", "ex", "sm", name="sf")
    b.add("transpose", "sf", perm=(1, 0), name="st")
    b.add("matmul", "st", "sf", name="mm3")
    b.add("neg", "sf", name="n1")
    b.add("abs", "sf", name="n2")
    b.add("sqrt", "sf", name="n3")
    b.add("tanh", "sf", name="n4")
    return b.graph()


@pytest.mark.parametrize("members,reason", [
    (("mm1", "mm2"), TWO_LINEAR),
    (("a", "op"), OPAQUE),
    (("op",), None),
    (("mm2", "a"), NOT_CONVEX),  # mm2 -> r -> a leaves and re-enters
    (("mm1", "xt"), NOT_CONNECTED),
    (("mm2", "r", "a"), None),  # matmul epilogue
    (("mx", "sh", "ex", "sm", "sf"), None),  # softmax: reductions then broadcasts in one kernel
    (("mx", "sh", "ex", "sm", "sf", "st", "mm3"), None),  # softmax prologue of a matmul
    (("sf", "n1", "n2", "n3", "n4"), TOO_MANY_OUTPUTS),
    (("mx", "sh", "ex", "sm", "sf", "st", "mm3", "n1", "n2"), OVER_SIZE),
])
def test_legality_reasons(members, reason):
    assert legality(small_graph(), members, EnumOptions(max_pointwise=0)) == reason


def attention_graph(axis=-1, chain=True, v_first=False, deferred=False):
    """q @ kt, scaled, a softmax over `axis` (`chain=False`: a relu instead), then @ v (or v @ it).
    `deferred`: the softmax's normalization after the values (kernorch.rewrite.after_attention)."""
    b = Builder()
    q, kt, v = b.input("q", (2, 8, 4)), b.input("kt", (2, 4, 8)), b.input("v", (2, 4, 8) if v_first else (2, 8, 4))
    b.add("matmul", q, kt, name="s")
    b.add("mul", "s", b.const("c", (1,)), name="sc")
    if deferred:
        b.add("reduce_max", "sc", axes=(axis,), keepdims=1, name="mx")
        b.add("sub", "sc", "mx", name="sh")
        b.add("exp", "sh", name="ex")
        b.add("reduce_sum", "ex", axes=(axis,), keepdims=1, name="sm")
        b.add("reciprocal", "sm", name="inv")
        b.add("matmul", "ex", "v", name="u")
        b.add("mul", "inv", "u", name="o")
        b.add("neg", "o", name="y")
        return b.graph()
    if chain:
        b.add("reduce_max", "sc", axes=(axis,), keepdims=1, name="mx")
        b.add("sub", "sc", "mx", name="sh")
        b.add("exp", "sh", name="ex")
        b.add("reduce_sum", "ex", axes=(axis,), keepdims=1, name="sm")
        b.add("div", "ex", "sm", name="p")
    else:
        b.add("relu", "sc", name="p")
    b.add("matmul", *(("v", "p") if v_first else ("p", "v")), name="o")
    b.add("neg", "o", name="y")
    return b.graph()


ATTENTION = ("s", "sc", "mx", "sh", "ex", "sm", "p", "o")


@pytest.mark.parametrize("kw, members, reason", [
    (dict(), ATTENTION, None),  # scores, softmax over the keys, values: one kernel
    (dict(), ATTENTION[1:], None),  # one linear prim
    (dict(axis=-2), ATTENTION, TWO_LINEAR),  # a softmax over the queries needs all of them
    (dict(chain=False), ("s", "sc", "p", "o"), TWO_LINEAR),  # no reduction: two GEMMs
    (dict(v_first=True), ATTENTION, TWO_LINEAR),  # the probabilities as the right operand
    # normalized after the values: one kernel with its normalization, not without it (the sum
    # outside would read the tile's probabilities; inside without its division it has no place)
    (dict(deferred=True), ("s", "sc", "mx", "sh", "ex", "sm", "inv", "u", "o"), None),
    (dict(deferred=True), ("s", "sc", "mx", "sh", "ex", "u"), TWO_LINEAR),
    (dict(deferred=True), ("s", "sc", "mx", "sh", "ex", "sm", "inv", "u"), TWO_LINEAR),
])
def test_attention_is_the_one_legal_pair_of_linear_prims(kw, members, reason):
    assert legality(attention_graph(**kw), members) == reason


def test_attention_kernels_are_enumerated_and_grown():
    from kernorch.candidates import EnumOptions
    g = attention_graph()
    found = {c.members for c in enumerate_candidates(g, whole(g), EnumOptions(max_size=9))[0]}
    assert ATTENTION in found and (*ATTENTION, "y") in found
    assert {c.linear for c in enumerate_candidates(g, whole(g))[0] if c.members == ATTENTION} == {"s"}
    g2 = attention_graph(axis=-2)
    assert not any({"s", "o"} <= set(m) for m in (c.members for c in enumerate_candidates(g2, whole(g2))[0]))


def test_legality_rejects_unknown_prims():
    with pytest.raises(KernorchError):
        legality(small_graph(), ["nope"])


def test_multi_output_candidate():
    g = small_graph()
    c = {c.members: c for c in enumerate_candidates(g, whole(g))[0]}[("mm2", "r", "a")]
    assert c.outputs == ("a",) and c.inputs == ("mm1", "w") and c.deps == ("mm1",) and c.linear == "mm2"
    c = {c.members: c for c in enumerate_candidates(g, whole(g))[0]}[("sf", "n1", "n2")]
    assert c.outputs == ("sf", "n1", "n2")


# ---- partitions -----------------------------------------------------------------------------

def transformer(n_layers: int, d: int = 16, seq: int = 8) -> Graph:
    """Fissioned pre-norm transformer layers: 42 prims each, residual stream of width 1 between them."""
    b = Builder()
    x = b.input("x", (seq, d))
    eps = b.const("eps", (1,))
    for i in range(n_layers):
        c = lambda n, s: b.const(f"{n}{i}", s)  # noqa: E731

        def norm(x, j):
            mean = b.add("reduce_mean", x, axes=(-1,), keepdims=1)
            xc = b.add("sub", x, mean)
            var = b.add("reduce_mean", b.add("mul", xc, xc), axes=(-1,), keepdims=1)
            y = b.add("div", xc, b.add("sqrt", b.add("add", var, eps)))
            return b.add("add", b.add("mul", y, c(f"g{j}_", (d,))), c(f"b{j}_", (d,)))

        h = norm(x, 0)
        q, k, v = (b.add("matmul", h, c(w, (d, d))) for w in "qkv")
        s = b.add("mul", b.add("matmul", q, b.add("transpose", k, perm=(1, 0))), eps)
        e = b.add("exp", b.add("sub", s, b.add("reduce_max", s, axes=(-1,), keepdims=1)))
        p = b.add("div", e, b.add("reduce_sum", e, axes=(-1,), keepdims=1))
        x = b.add("add", x, b.add("matmul", b.add("matmul", p, v), c("o", (d, d))))
        h = b.add("add", b.add("matmul", norm(x, 1), c("f1", (d, 2 * d))), c("fb1", (2 * d,)))
        h = b.add("mul", b.add("mul", h, b.add("add", b.add("erf", b.add("mul", h, eps)), eps)), eps)
        x = b.add("add", x, b.add("add", b.add("matmul", h, c("f2", (2 * d, d))), c("fb2", (d,))))
    return b.graph()


def test_small_graph_is_one_partition():
    g = transformer(1)
    parts = partition(g, max_prims=64)
    assert len(parts) == 1 and parts[0].prims == tuple(p.name for p in g.prims)
    assert parts[0].inputs == ("x",) and parts[0].outputs == g.outputs


def test_cuts_fall_between_transformer_layers():
    g = transformer(4)
    parts = partition(g, max_prims=64)
    assert [len(p.prims) for p in parts] == [42, 42, 42, 42]
    assert [p.inputs for p in parts[1:]] == [(parts[i].outputs[0],) for i in range(3)]
    assert all(len(p.outputs) == 1 for p in parts)
    widths = cut_widths(g)
    assert widths[0] == 0 and min(widths[1:]) == 1


def _narrowing_chain(rows) -> Graph:
    """relu, a matmul down to 4 columns, relu, a matmul up to 256 columns, relu, relu: one tensor
    crosses every cut, of rows x 256, 4, 4, 256, 256 floats."""
    b = Builder()
    x = b.input("x", (rows, 256))
    h = b.add("relu", b.add("matmul", b.add("relu", x), b.const("w1", (256, 4))))
    b.add("relu", b.add("relu", b.add("matmul", h, b.const("w2", (4, 256)))))
    return b.graph()


def test_cuts_of_one_width_fall_where_the_fewest_bytes_cross():
    g = _narrowing_chain(1)
    assert cut_widths(g)[1:] == [1] * 5
    assert cut_bytes(g)[1:] == [1024, 16, 16, 1024, 1024]
    # the window of the first cut is before prims 2..4: the narrow tensor, not the later wide one
    assert [len(p.prims) for p in partition(g, max_prims=4)] == [3, 3]


def test_symbolic_cuts_are_weighed_at_the_symbols_values():
    seq = SymDim("seq", (0, 1, 0))
    b = Builder()
    x = b.input("x", (seq, 4))
    small = b.add("relu", b.add("relu", x))                     # seq x 4
    wide = b.add("matmul", b.add("relu", small), b.const("w", (4, 64)))   # seq x 64
    b.add("relu", b.add("relu", b.add("reduce_sum", wide, axes=(0,), keepdims=1)))  # 1 x 64
    g = b.graph()
    assert cut_widths(g)[1:] == [1] * 6
    assert cut_bytes(g, {"seq": 512})[1:] == [2048 * 4, 2048 * 4, 2048 * 4, 512 * 64 * 4, 256, 256]
    assert cut_bytes(g)[1:3] == [16, 16]  # (a symbol without a value counts as 1)
    # the first cut falls before prim 2..5: at seq=512 after the reduction, at seq=1 before the matmul
    assert [len(p.prims) for p in partition(g, 5, {"seq": 512})] == [5, 2]
    assert [len(p.prims) for p in partition(g, 5, {"seq": 1})] == [3, 4]


def check_partitions(g: Graph, parts: list[Partition], max_prims: int):
    assert [p.index for p in parts] == list(range(len(parts)))
    assert [m for p in parts for m in p.prims] == [p.name for p in g.prims]  # each once, topological
    produced: set[str] = {n for n, _ in g.inputs}
    for part in parts:
        assert 1 <= len(part.prims) <= max_prims
        inside = set(part.prims)
        assert set(part.inputs) <= produced
        reads = {t for m in part.prims for t in g.by_name[m].inputs if t not in inside and t not in g.constants}
        assert set(part.inputs) == reads
        later = {t for q in parts[part.index + 1:] for m in q.prims for t in g.by_name[m].inputs}
        assert set(part.outputs) == {m for m in part.prims if m in g.outputs or m in later}
        produced |= set(part.outputs)


@pytest.mark.parametrize("seed", range(20))
def test_partitions_cover_random_graphs(seed):
    rng = random.Random(seed)
    g = random_graph(300 + seed, rng.randint(1, 60))
    max_prims = rng.randint(1, 20)
    check_partitions(g, partition(g, max_prims), max_prims)


def test_partition_rejects_bad_cap():
    with pytest.raises(KernorchError):
        partition(transformer(1), 0)


def test_enumerate_all_stats_and_cross_partition_outputs():
    g = transformer(3)
    e = enumerate_all(g, EnumOptions(max_size=6), max_prims=64)
    assert len(e.partitions) == 3 and [s.prims for s in e.stats] == [42, 42, 42]
    per_part = [[c for c in e.candidates if c.partition == i] for i in range(3)]
    # identical layers: identical key sets (the last layer's output is a graph output, not read later:
    # both are kernel outputs, so keys still agree)
    assert Counter(c.key for c in per_part[0]) == Counter(c.key for c in per_part[1]) == Counter(
        c.key for c in per_part[2])
    assert all(s.distinct_keys <= s.candidates and not s.cap_hit for s in e.stats)
    assert sum(len(p) for p in per_part) == len(e.candidates)
    last = e.partitions[0].prims[-1]
    assert all(last in c.outputs for c in per_part[0] if last in c.members)
    assert "3 partitions" in e.summary()


def test_64_prim_partition_is_fast():
    g = transformer(2)
    prims = tuple(p.name for p in g.prims[:64])
    part = [p for p in partition(g, 64) if p.index == 0][0]
    part = Partition(0, prims, part.inputs, ())  # the first 64 prims: a contiguous, convex range
    t0 = time.perf_counter()
    r = enumerate_partition(g, part, EnumOptions())
    assert time.perf_counter() - t0 < 5.0 and not r.cap_hit and len(r.candidates) > 64
    t0 = time.perf_counter()
    g = random_graph(1, 64)
    r = enumerate_partition(g, whole(g), EnumOptions())
    assert time.perf_counter() - t0 < 5.0


def test_a_candidates_io_is_computed_once_per_variant():
    """Every refine round's program asks for each candidate's parameters and layouts again: they
    are kept with the graph, per candidate and variant, and equal what a fresh computation gives."""
    from kernorch.ir import kernel_graph
    from kernorch.layouts import _io, candidate_io
    b = Builder()
    x = b.input("x", (1, 32, 8, 8))
    y = b.add("relu", x)
    z = b.add("exp", y)
    g = b.graph([z])
    first = candidate_io(g, (y, z), (x,), (z,), "default")
    assert candidate_io(g, [y, z], [x], [z], "default") is first
    assert candidate_io(g, (y, z), (x,), (z,), "b16/default") is not first
    assert first == _io(kernel_graph(g, (y, z), (x,), (z,)), (x,), (z,), "default", (x,), (z,))


def gemm_gelu_graph(chain_reads_input: bool = False) -> Graph:
    """x @ w + b, then a tanh GELU (9 elementwise prims reading only the GEMM's result and
    weights; or, with `chain_reads_input`, one of them also reads the graph input)."""
    b = Builder()
    x, w, bias = b.input("x", (8, 16)), b.const("w", (16, 16)), b.const("b", (16,))
    c = b.const("c", (1,))
    b.add("matmul", x, w, name="mm")
    h = b.add("add", "mm", bias, name="h")
    sq = b.add("mul", h, h, name="sq")
    cube = b.add("mul", sq, h, name="cube")
    k = b.add("mul", cube, c, name="k")
    inner = b.add("add", h, k, name="inner")
    s = b.add("mul", inner, "x" if chain_reads_input else c, name="s")
    t = b.add("tanh", s, name="t")
    one = b.add("add", t, c, name="one")
    half = b.add("mul", h, c, name="half")
    b.add("mul", half, one, name="y")
    return b.graph(["y"])


def test_closed_pointwise_members_do_not_count_against_the_size_cap():
    g = gemm_gelu_graph()
    every = tuple(p.name for p in g.prims)  # 11 prims: the matmul and 10 elementwise ones reading it
    assert weight(g, set(every)) == 1
    assert legality(g, every, EnumOptions(max_size=8)) is None
    assert legality(g, every, EnumOptions(max_size=8, max_pointwise=2)) == OVER_SIZE  # 11 > 8 + 2
    assert frozenset(every) in {frozenset(c.members) for c in enumerate_candidates(g, whole(g))[0]}
    # a member that also reads the graph input is not free: two members count
    h = gemm_gelu_graph(chain_reads_input=True)
    assert weight(h, set(every)) == 2
    assert legality(h, every, EnumOptions(max_size=1, max_pointwise=20)) == OVER_SIZE
    assert legality(h, every, EnumOptions(max_size=2, max_pointwise=20)) is None
    # a member is free only while every prim it reads is in the set: without "inner", "s" counts
    assert weight(g, set(every) - {"inner"}) == 2
