"""What a model's tensors need at the largest shape it is optimized for, against this host's memory.

    check(graph, ranges, source)   # raises KernorchError naming the tensor, its node and shape

Measuring a kernel allocates its inputs and outputs, and checking it its reference outputs too, in
two worker processes at once; a tensor too large for that is refused before anything is measured,
with the largest length that fits where a range was given. Without the check, the transformer block
over seq=1..100000000 (its attention scores at the top: 6 x 10^16 floats) ran its first stage for
minutes without a word.
"""
from __future__ import annotations

import os
from typing import Sequence

from .ir import Graph, KernorchError, Prim

# the largest tensor may take at most this share of the host's memory: two workers at once, each
# holding a kernel's inputs, outputs and reference outputs (about 4x its largest tensor)
MEMORY_SHARE = 1 / 8


def host_memory() -> int:
    """The host's physical memory in bytes (0 where the system does not say)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 0


def largest(graph: Graph) -> tuple[Prim | None, int]:
    """The prim of a static `graph` whose output is the largest, and its bytes."""
    best, size = None, 0
    for p in graph.prims:
        if p.type.static and p.type.nbytes > size:
            best, size = p, p.type.nbytes
    return best, size


def check(graph: Graph, ranges: Sequence[tuple[str, int, int]] = (), source: str = "model",
          memory: int | None = None) -> None:
    """Refuse `graph` (generic over `ranges`, each (name, lo, hi), or static) where at the top of
    every range its largest tensor exceeds MEMORY_SHARE of `memory` (the host's by default)."""
    memory = host_memory() if memory is None else memory
    if memory <= 0:
        return
    limit = int(memory * MEMORY_SHARE)
    top = {name: hi for name, _, hi in ranges}
    prim, size = largest(_at(graph, top))
    if size <= limit:
        return
    where = ", ".join(f"{n}={v}" for n, v in top.items())
    node = f" (node {prim.origin})" if prim.origin and prim.origin != prim.name else ""
    text = (f"{source}: {'at ' + where + ', ' if where else ''}the tensor {prim.name}{node}, {prim.op} "
            f"{prim.type}, takes {_gib(size)}; measuring its kernels needs about 8x that at once, and this "
            f"host has {_gib(memory)} of memory")
    if len(ranges) == 1:
        name, lo, hi = ranges[0]
        fits = _largest_fitting(graph, name, lo, hi, limit)
        text += (f": the range fits up to {name}={fits} (--shape {name}={lo}..{fits})" if fits
                 else f": not even {name}={lo} fits")
    raise KernorchError(text)


def _at(graph: Graph, binding) -> Graph:
    if not binding:
        return graph
    from .dynamic import bind
    return bind(graph, binding)


def _largest_fitting(graph: Graph, name: str, lo: int, hi: int, limit: int) -> int | None:
    """The largest value of `name` in lo..hi at which the largest tensor fits in `limit` bytes (the
    sizes grow with it), or None."""
    def fits(v: int) -> bool:
        return largest(_at(graph, {name: v}))[1] <= limit
    if not fits(lo):
        return None
    while lo < hi:  # (lo fits, hi does not: the last that fits)
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid - 1)
    return lo


def _gib(n: int) -> str:
    return f"{n / 2 ** 30:.1f} GiB" if n >= 2 ** 28 else f"{n / 2 ** 20:.1f} MiB"
