"""The primitive-graph IR: small, immutable, hashable.

A `Prim` computes exactly one tensor, named like the prim itself; a `Graph` holds its prims in
topological order, its inputs, outputs and constants (weights). Shapes are tuples of ints or of
named symbols (str) for dimensions the user has not bound yet.

The *structural key* of a set of prims ignores tensor names: two kernels with the same key compute
the same function on tensors of the same types, so one measurement serves both.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping

import numpy as np

class KernorchError(Exception):
    """An error a user can act on: the message names the file, node, operator and the problem."""


Monomial = tuple[tuple[str, int], ...]  # (("batch", 1), ("seq", 2)): batch * seq^2; (): 1


@dataclass(frozen=True, init=False)
class SymDim:
    """A dimension over symbols: a polynomial with integer coefficients, each symbol of degree at
    most 2 (`terms`: (monomial, coefficient) pairs, sorted). `SymDim("seq", (c0, c1, c2))` is
    c0 + c1*seq + c2*seq^2; `SymDim.of(terms)` any other (4*batch*seq: ((("batch", 1), ("seq", 1)), 4))."""
    terms: tuple[tuple[Monomial, int], ...]

    def __init__(self, name: str, coeffs: tuple[int, int, int]):
        object.__setattr__(self, "terms", tuple((((name, p),) if p else (), int(c))
                                                for p, c in enumerate(coeffs) if c))

    @staticmethod
    def of(terms) -> "int | SymDim":
        """The polynomial of (monomial, coefficient) pairs: like terms summed, zero ones dropped, an
        int when no symbol is left."""
        out: dict[Monomial, int] = {}
        for mono, c in terms:
            mono = tuple(sorted((n, p) for n, p in mono if p))
            out[mono] = out.get(mono, 0) + int(c)
        kept = tuple(sorted((m, c) for m, c in out.items() if c))
        if all(not m for m, _ in kept):
            return kept[0][1] if kept else 0
        d = object.__new__(SymDim)
        object.__setattr__(d, "terms", kept)
        return d

    @property
    def names(self) -> tuple[str, ...]:
        """The symbols it uses, sorted."""
        return tuple(sorted({n for m, _ in self.terms for n, _ in m}))

    @property
    def name(self) -> str:
        """Its one symbol (a KernorchError when it has several)."""
        names = self.names
        if len(names) != 1:
            raise KernorchError(f"dimension {self} uses {len(names)} symbols, not one")
        return names[0]

    @property
    def coeffs(self) -> tuple[int, int, int]:
        """(c0, c1, c2) of a dimension over one symbol."""
        name, out = self.name, [0, 0, 0]
        for m, c in self.terms:
            out[dict(m).get(name, 0)] = c
        return tuple(out)

    def __call__(self, value: int) -> int:
        """Its value where its one symbol is `value`."""
        return self.subs({self.name: value})

    def subs(self, binding: Mapping[str, int]) -> int:
        """Its value where every one of its symbols is bound."""
        missing = [n for n in self.names if n not in binding]
        if missing:
            raise KernorchError(f"symbol {missing[0]!r} is not bound")
        return self.partial(binding)

    def partial(self, binding: Mapping[str, int]) -> "int | SymDim":
        """The symbols of `binding` replaced by their values; the others stay."""
        terms = []
        for m, c in self.terms:
            for n, p in m:
                if n in binding:
                    c *= int(binding[n]) ** p
            terms.append((tuple((n, p) for n, p in m if n not in binding), c))
        return SymDim.of(terms)

    def solve(self, value: int, lo: int, hi: int) -> int | None:
        """The value in lo..hi of its one symbol at which this dimension is `value` (None: there is none)."""
        c0, c1, c2 = self.coeffs
        if c2:
            return next((v for v in range(lo, hi + 1) if self(v) == value), None)
        v, r = divmod(value - c0, c1)
        return v if r == 0 and lo <= v <= hi else None

    def __str__(self) -> str:
        terms = []
        for m, c in sorted(self.terms, key=lambda t: (-sum(p for _, p in t[0]), t[0])):
            mono = "*".join(n if p == 1 else f"{n}^{p}" for n, p in m)
            terms.append(str(c) if not mono else mono if c == 1 else f"-{mono}" if c == -1 else f"{c}*{mono}")
        return "+".join(terms).replace("+-", "-") or "0"

    def to_json(self) -> dict:
        """{"symbol", "coeffs"} over one symbol (as plans and keys have always had it), else
        {"terms": [[{symbol: power}, coefficient], ...]}."""
        if len(self.names) == 1:
            return {"symbol": self.name, "coeffs": list(self.coeffs)}
        return {"terms": [[dict(m), c] for m, c in self.terms]}


def to_json_value(v: Any) -> Any:
    """An attribute or shape as plain JSON (a SymDim as {"symbol", "coeffs"})."""
    if isinstance(v, SymDim):
        return v.to_json()
    if isinstance(v, (list, tuple)):
        return [to_json_value(x) for x in v]
    return v


def from_json_value(v: Any) -> Any:
    """The inverse of `to_json_value`, frozen (lists as tuples)."""
    if isinstance(v, dict) and set(v) == {"symbol", "coeffs"}:
        return SymDim(v["symbol"], tuple(int(c) for c in v["coeffs"]))
    if isinstance(v, dict) and set(v) == {"terms"}:
        return SymDim.of((tuple(m.items()), int(c)) for m, c in v["terms"])
    if isinstance(v, list):
        return tuple(from_json_value(x) for x in v)
    return v


Dim = int | str | SymDim
Shape = tuple[Dim, ...]





def freeze(value: Any) -> Any:
    """Turn lists (and numpy values) into tuples so attributes can be hashed."""
    if isinstance(value, np.ndarray):
        return freeze(value.tolist())
    if isinstance(value, (list, tuple)):
        return tuple(freeze(v) for v in value)
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, dict):
        return tuple(sorted((k, freeze(v)) for k, v in value.items()))
    return value


@dataclass(frozen=True)
class TensorType:
    shape: Shape
    dtype: str = "float32"

    @property
    def static(self) -> bool:
        return all(isinstance(d, int) for d in self.shape)

    @property
    def rank(self) -> int:
        return len(self.shape)

    @property
    def size(self) -> int:
        n = 1
        for d in self.shape:
            if not isinstance(d, int):
                raise KernorchError(f"shape {self} has an unbound symbol {d}")
            n *= d
        return n

    @property
    def nbytes(self) -> int:
        return self.size * np.dtype(self.dtype).itemsize

    def __str__(self) -> str:
        return f"{self.dtype}[{'x'.join(str(d) for d in self.shape)}]"

    def to_json(self) -> dict:
        return {"shape": to_json_value(self.shape), "dtype": self.dtype}

    @staticmethod
    def from_json(d: Mapping) -> "TensorType":
        return TensorType(tuple(from_json_value(x) for x in d["shape"]), d["dtype"])


@dataclass(frozen=True)
class Prim:
    """One primitive: `name` is also the name of the tensor it computes."""

    name: str
    op: str
    inputs: tuple[str, ...]
    attrs: tuple[tuple[str, Any], ...]
    type: TensorType
    origin: str = ""  # the ONNX node it came from (for error messages and the report)

    @property
    def a(self) -> dict[str, Any]:
        return dict(self.attrs)

    def attr(self, key: str, default: Any = None) -> Any:
        for k, v in self.attrs:
            if k == key:
                return v
        return default


def make_prim(name: str, op: str, inputs: Iterable[str], type: TensorType, origin: str = "", **attrs) -> Prim:
    return Prim(name, op, tuple(inputs), tuple(sorted((k, freeze(v)) for k, v in attrs.items())), type, origin)


@dataclass(frozen=True)
class Graph:
    inputs: tuple[tuple[str, TensorType], ...]
    outputs: tuple[str, ...]
    prims: tuple[Prim, ...]
    constants: Mapping[str, np.ndarray] = field(default_factory=dict, compare=False, hash=False)
    name: str = "graph"

    # -- lookups ---------------------------------------------------------------------------
    @property
    def by_name(self) -> dict[str, Prim]:
        cache = self.__dict__.get("_by_name")
        if cache is None:
            cache = {p.name: p for p in self.prims}
            object.__setattr__(self, "_by_name", cache)
        return cache

    @property
    def consumers(self) -> dict[str, list[Prim]]:
        cache = self.__dict__.get("_consumers")
        if cache is None:
            cache = {}
            for p in self.prims:
                for t in dict.fromkeys(p.inputs):
                    cache.setdefault(t, []).append(p)
            object.__setattr__(self, "_consumers", cache)
        return cache

    def type_of(self, tensor: str) -> TensorType:
        if tensor in self.by_name:
            return self.by_name[tensor].type
        for n, t in self.inputs:
            if n == tensor:
                return t
        if tensor in self.constants:
            c = self.constants[tensor]
            return TensorType(tuple(int(d) for d in c.shape), str(c.dtype))
        raise KernorchError(f"unknown tensor {tensor!r} in graph {self.name!r}")

    def is_source(self, tensor: str) -> bool:
        """Graph inputs and constants: available before any kernel runs."""
        return tensor in self.constants or any(n == tensor for n, _ in self.inputs)

    def histogram(self) -> dict[str, int]:
        h: dict[str, int] = {}
        for p in self.prims:
            h[p.op] = h.get(p.op, 0) + 1
        return dict(sorted(h.items(), key=lambda kv: (-kv[1], kv[0])))

    def to_json(self) -> dict:
        """Everything but the constants' values (their types are recorded), as plain JSON."""
        return {"name": self.name, "inputs": [[n, t.to_json()] for n, t in self.inputs], "outputs": list(self.outputs),
                "prims": [{"name": p.name, "op": p.op, "inputs": list(p.inputs), "attrs": [[k, to_json_value(v)] for k, v in p.attrs],
                           "type": p.type.to_json(), "origin": p.origin} for p in self.prims],
                "constants": {n: TensorType(tuple(int(d) for d in np.shape(c)), str(np.asarray(c).dtype)).to_json()
                              for n, c in self.constants.items()}}

    @staticmethod
    def from_json(d: Mapping) -> "Graph":
        """The graph of `to_json` (without constants: `type_of` still knows the inputs it has)."""
        prims = tuple(Prim(p["name"], p["op"], tuple(p["inputs"]), tuple((k, freeze(from_json_value(v))) for k, v in p["attrs"]),
                           TensorType.from_json(p["type"]), p.get("origin", "")) for p in d["prims"])
        return Graph(tuple((n, TensorType.from_json(t)) for n, t in d["inputs"]), tuple(d["outputs"]), prims, {},
                     d.get("name", "graph"))

    def validate(self) -> None:
        """Topological order, every input defined, every output produced, names unique."""
        known = {n for n, _ in self.inputs} | set(self.constants)
        for p in self.prims:
            for t in p.inputs:
                if t not in known:
                    raise KernorchError(f"prim {p.name} ({p.op}, from {p.origin}) reads {t!r} before it is defined")
            if p.name in known:
                raise KernorchError(f"tensor {p.name!r} is defined twice")
            known.add(p.name)
        for o in self.outputs:
            if o not in known:
                raise KernorchError(f"graph output {o!r} is never produced")


def kernel_graph(graph: Graph, members: Iterable[str], inputs: Iterable[str], outputs: Iterable[str]) -> Graph:
    """The sub-graph of one kernel, self-contained (picklable to a worker): its prims, its
    non-constant inputs as graph inputs, the weights it reads as constants."""
    inputs = tuple(inputs)
    prims = tuple(graph.by_name[m] for m in members)
    consts = {t: graph.constants[t] for t in inputs if t in graph.constants}
    ins = tuple((t, graph.type_of(t)) for t in inputs if t not in graph.constants)
    return Graph(ins, tuple(outputs), prims, consts, name="kernel")


def structural_key(prims: Iterable[Prim], graph: Graph, outputs: Iterable[str] | None = None) -> str:
    """A name-independent hash of a set of prims: ops, attributes, types and wiring.

    External inputs are numbered by first use (constants marked as weights with their type),
    prims by their position in topological order, outputs by their canonical index. Two
    kernels with equal keys compute the same function on equal types.
    """
    prims = sorted(prims, key=lambda p: graph_index(graph, p.name))
    local = {p.name: i for i, p in enumerate(prims)}
    ext: dict[str, int] = {}
    rows = []
    for p in prims:
        ins = []
        for t in p.inputs:
            if t in local:
                ins.append(("p", local[t]))
            else:
                if t not in ext:
                    ext[t] = len(ext)
                kind = "w" if t in graph.constants else "x"
                ins.append((kind, ext[t], str(graph.type_of(t))))
        rows.append((p.op, p.attrs, str(p.type), tuple(ins)))
    outs = sorted(local[o] for o in (outputs or []))
    blob = json.dumps([rows, outs], default=str, separators=(",", ":"))
    return hashlib.sha1(blob.encode()).hexdigest()[:16]


def graph_index(graph: Graph, name: str) -> int:
    cache = graph.__dict__.get("_index")
    if cache is None:
        cache = {p.name: i for i, p in enumerate(graph.prims)}
        object.__setattr__(graph, "_index", cache)
    return cache[name]
