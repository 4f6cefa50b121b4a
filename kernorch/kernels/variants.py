"""A kernel's variants: which micro-kernel tiles its contraction may use, and which of its
operands a variant packs. The glue between the kernel (a graph of prims) and kernels.tiles/pack."""
from __future__ import annotations

from typing import Sequence

import numpy as np

from .pack import Pack
from .tiles import Tile, contraction_tiles


def prim_tiles(machine, graph, prim) -> tuple[Tile, ...]:
    """The micro-kernel tiles worth timing for linear prim `prim` of `graph` on `machine`.

    Matmuls (2-D or batched, constant or activation right operand): rows M, columns N, depth K;
    the tile packs the right operand when it is a constant. Other prims: () (their own schedules).
    """
    if prim.op != "matmul" or not prim.type.static:
        return ()
    m, n = (int(d) for d in prim.type.shape[-2:])
    k = int(graph.type_of(prim.inputs[0]).shape[-1])
    return contraction_tiles(machine, m, n, k, packable(graph, prim))


def variant_packs(graph, inputs: Sequence[str], schedule: str) -> dict[int, Pack]:
    """The packed operands of a kernel variant: {index into `inputs`: Pack}.

    `graph` is the kernel's own graph (its constants are the weights it reads). Only tile schedules
    whose name asks for packing ("t14x32p") pack, and only the right operand of the kernel's matmul
    when it is a constant with unit leading dims.
    """
    tile = Tile.parse(schedule)
    if tile is None or not tile.pack:
        return {}
    mm = [p for p in graph.prims if p.op == "matmul"]
    if len(mm) != 1:
        raise ValueError(f"schedule {schedule} packs the weight of one matmul; the kernel has {len(mm)}")
    w = mm[0].inputs[1]
    if w not in graph.constants or w not in inputs:
        raise ValueError(f"schedule {schedule}: the matmul's right operand {w!r} is not a constant input")
    shape = tuple(int(d) for d in np.shape(graph.constants[w]))
    if len(shape) < 2 or any(d != 1 for d in shape[:-2]) or shape[-1] % tile.nb:
        raise ValueError(f"schedule {schedule}: weight of shape {shape} cannot be packed in blocks of {tile.nb}")
    return {list(inputs).index(w): Pack("kn", tile.nb, shape)}


def pack_args(graph, inputs: Sequence[str], schedule: str, arrays: Sequence[np.ndarray]) -> list[np.ndarray]:
    """The arrays a kernel variant takes: `arrays` (one per input, logical layouts) with the
    operands it packs in their packed layout."""
    packs = variant_packs(graph, inputs, schedule)
    return [packs[i].pack(x) if i in packs else x for i, x in enumerate(arrays)]


def packable(graph, prim) -> bool:
    """Is the right operand of matmul `prim` a constant that a tile schedule may pack?"""
    if prim.op != "matmul" or prim.inputs[1] not in graph.constants:
        return False
    shape = np.shape(graph.constants[prim.inputs[1]])
    return len(shape) >= 2 and all(d == 1 for d in shape[:-2])
