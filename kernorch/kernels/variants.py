"""A kernel's variants: its micro-kernel tile, which operands it packs, and the layouts of the
activations at its boundary. The glue between a kernel (a graph of prims) and kernels.tiles/pack.

A variant is named by its schedule string:

    default, t14x32p, ...        plain (NCHW) boundary; kernorch's rules or a micro-kernel tile
    b16/default, b16/t6x32p      every 4-D activation at the boundary blocked nChw16c (nChw8c where
                                 16 does not divide the channels; plain where 8 does not either)
    b16/block, b16/unblock       a layout conversion: plain -> blocked, blocked -> plain

The computation itself stays in logical NCHW coordinates: blocked inputs are read through views
and blocked outputs written through one, so every kernel is correct in every boundary layout and
only its speed differs (measured, and chosen by the orchestration program).
"""
from __future__ import annotations

from dataclasses import replace
from typing import Sequence

import numpy as np

from ..ir import SymDim
from .pack import Pack
from .tiles import SERIAL_MAX_MACS, LengthSwitch, Tile, contraction_tiles
from .winograd import Winograd, winograd_variants

CONVERSIONS = ("block", "unblock")


def split(schedule: str) -> tuple[int | None, str]:
    """("b16/t6x32p") -> (16, "t6x32p"); ("t8x32p") -> (None, "t8x32p")."""
    head, sep, tail = schedule.partition("/")
    if sep and head.startswith("b") and head[1:].isdigit():
        return int(head[1:]), tail
    return None, schedule


def blocked(lanes: int, inner: str) -> str:
    return f"b{lanes}/{inner}"


def block_of(ty, lanes: int) -> int | None:
    """The channel block of a 4-D float32 activation: the vector lanes, or half of them, whichever
    divides its channels (None: it stays NCHW)."""
    if ty.rank != 4 or ty.dtype != "float32" or not all(isinstance(d, int) for d in ty.shape[1:]):
        return None  # (a symbolic batch blocks as any: nChw{b}c keeps the images outermost)
    c = int(ty.shape[1])
    for b in (lanes, lanes // 2):
        if b >= 4 and c % b == 0:
            return b
    return None


def _activation_packs(graph, names: Sequence[str], schedule: str, side: str) -> dict[int, Pack]:
    lanes, inner = split(schedule)
    if lanes is None or (inner, side) in (("block", "in"), ("unblock", "out")):
        return {}
    out = {}
    for i, t in enumerate(names):
        if t in graph.constants:
            continue
        ty = graph.type_of(t)
        b = block_of(ty, lanes)
        if b is not None:
            out[i] = Pack("nchwc", b, tuple(d if isinstance(d, SymDim) else int(d) for d in ty.shape))
    return out


def layout_of(graph, tensor: str, schedule: str, side: str) -> str:
    """The layout of `tensor` at the boundary of a kernel in variant `schedule` ("plain" or e.g.
    "nChw16c"); `side` is "in" or "out". The orchestration program names tensors by it."""
    packs = _activation_packs(graph, [tensor], schedule, side)
    return packs[0].layout if packs else "plain"


def variant_out_packs(graph, outputs: Sequence[str], schedule: str) -> dict[int, Pack]:
    """The outputs a kernel variant writes blocked: {index into `outputs`: Pack}."""
    return _activation_packs(graph, outputs, schedule, "out")


def variant_packs(graph, inputs: Sequence[str], schedule: str) -> dict[int, Pack]:
    """The inputs a kernel variant takes in another layout: {index into `inputs`: Pack}.

    `graph` is the kernel's own graph (its constants are the weights it reads). A tile schedule
    whose name asks for packing ("t14x32p") packs the constant weight of the kernel's matmul
    ("KN>N32") or conv ("OIHW>O32"); a blocked variant ("b16/...") takes its 4-D activations blocked.
    A length switch ("t14x32pr|2|t14x32p") takes what its two tiles take, which must be the same.
    """
    layout, inner = split(schedule)
    switch = LengthSwitch.parse(inner)
    if switch is not None:  # (one kernel takes one layout of each input: both tiles must agree)
        first, then = (variant_packs(graph, inputs, name if layout is None else blocked(layout, name))
                       for name in (switch.first, switch.then))
        if first != then:
            raise ValueError(f"schedule {schedule}: its two tiles take the inputs in different layouts")
        return then
    packs = _activation_packs(graph, inputs, schedule, "in")
    tile = Tile.parse(inner) or Winograd.parse(inner)
    if tile is None or not getattr(tile, "pack", True):
        return packs
    lin = [p for p in graph.prims if p.op in ("matmul", "conv")]
    if len(lin) != 1:
        raise ValueError(f"schedule {schedule} packs the weight of one matmul or conv; the kernel has {len(lin)}")
    w = lin[0].inputs[1]
    if w not in graph.constants or w not in inputs:
        raise ValueError(f"schedule {schedule}: the {lin[0].op}'s weight {w!r} is not a constant input")
    shape = tuple(int(d) for d in np.shape(graph.constants[w]))
    if isinstance(tile, Winograd):
        if len(shape) != 4 or shape[2:] != (3, 3) or shape[0] % tile.nb:
            raise ValueError(f"schedule {schedule}: conv weight of shape {shape} is no 3x3 weight in blocks of {tile.nb}")
        packs[list(inputs).index(w)] = Pack(f"wino{tile.m}", tile.nb, shape)
    elif lin[0].op == "matmul":
        if len(shape) < 2 or any(d != 1 for d in shape[:-2]) or shape[-1] % tile.nb:
            raise ValueError(f"schedule {schedule}: weight of shape {shape} cannot be packed in blocks of {tile.nb}")
        packs[list(inputs).index(w)] = Pack("kn", tile.nb, shape)
    else:
        if len(shape) != 4 or shape[0] % tile.nb:
            raise ValueError(f"schedule {schedule}: conv weight of shape {shape} cannot be packed in blocks of {tile.nb}")
        packs[list(inputs).index(w)] = Pack("oihw", tile.nb, shape)
    return packs


def pack_args(graph, inputs: Sequence[str], schedule: str, arrays: Sequence[np.ndarray]) -> list[np.ndarray]:
    """The arrays a kernel variant takes: `arrays` (one per input, logical layouts) with the
    operands it packs or blocks in their packed layout."""
    packs = variant_packs(graph, inputs, schedule)
    return [packs[i].pack(x) if i in packs else x for i, x in enumerate(arrays)]


def unpack_outputs(graph, outputs: Sequence[str], schedule: str, arrays: Sequence[np.ndarray]) -> list[np.ndarray]:
    """A kernel variant's outputs back in their logical layout."""
    packs = variant_out_packs(graph, outputs, schedule)
    return [packs[i].unpack(x) if i in packs else x for i, x in enumerate(arrays)]


# ------------------------------------------------------------------------------------------------
# which variants a kernel has
# ------------------------------------------------------------------------------------------------

def prim_tiles(machine, graph, prim, blocked_layout: bool = False) -> tuple[Tile | Winograd, ...]:
    """The micro-kernel tiles worth timing for linear prim `prim` of `graph` on `machine`.

    Matmuls (2-D or batched, constant or activation right operand): rows M, columns N, depth K;
    the tile packs the right operand when it is a constant; a matmul of at most SERIAL_MAX_MACS
    multiply-adds also gets every tile serial (`s`, no parallel loop). Convolutions, only in a blocked
    variant (their vector is a block of output channels): rows are output columns, columns the
    output channels, depth C/g x kh x kw; the constant weight is packed OIHW>O{nb}. When the packed
    weight fits in half of L2, each tile also comes with rows outside the channel tiles (`r`: an
    input row stays in cache while every channel tile passes over it); a matmul whose packed weight
    fits gets both orders as well (seq x 384 x 384, weights cold, 2 threads, Xeon family 6 model
    207: rows outside took 48 us at 7 rows against 26, 169 against 139 at 128, the same at 512:
    each thread streams the whole weight into its own L2; with panels outside, each streams half).
    A 3x3 stride-1 convolution also gets its Winograd variants (kernels.winograd: F(2x2,3x3) and
    F(4x4,3x3)), raced like tiles.

    A convolution in the plain layout whose output channels are no multiple of the vector lanes
    (a 150-class classifier, a 3-channel image output) has no blocked tile; it gets tiles of the
    GEMM it is in NCHW: rows are the output channels (unrolled, broadcast from the weight, a
    guarded tail), columns the output width (vectors of the input and output rows), depth
    C/g x kh x kw; not packed. Its default schedule is timed beside them (see pipeline.tile_jobs).
    """
    if not prim.type.static:
        return ()
    if prim.op == "matmul" and not blocked_layout:
        m, n = (int(d) for d in prim.type.shape[-2:])
        k = int(graph.type_of(prim.inputs[0]).shape[-1])
        pack = packable(graph, prim)
        tiles = contraction_tiles(machine, m, n, k, pack, pad_cols=True)
        if pack and any(t.rows_outer for t in tiles):  # column panels outside too
            tiles += tuple(replace(t, rows_outer=False) for t in tiles)
        if prim.type.size * k <= SERIAL_MAX_MACS:  # small: serial too, and the faster one is kept
            tiles += tuple(replace(t, serial=True) for t in tiles)
        return tiles
    if prim.op == "conv" and blocked_layout and prim.type.rank == 4 and prim.inputs[1] in graph.constants:
        o, ow = int(prim.type.shape[1]), int(prim.type.shape[3])
        w = np.shape(graph.constants[prim.inputs[1]])
        tiles = contraction_tiles(machine, ow, o, int(np.prod(w[1:])), True, split_vectors=True)
        out = tuple(Tile(t.mr, t.nb, True) for t in tiles)
        if any(t.rows_outer for t in tiles):  # the weight fits in half of L2: rows outside the channel tiles too
            out += tuple(Tile(t.mr, t.nb, True, True) for t in tiles)
        return out + winograd_variants(machine, graph, prim, block_of(graph.type_of(prim.inputs[0]), machine.lanes))
    if prim.op == "conv" and not blocked_layout and plain_conv_tiles(machine, graph, prim):
        o, ow = int(prim.type.shape[1]), int(prim.type.shape[3])
        w = np.shape(graph.constants[prim.inputs[1]])
        return contraction_tiles(machine, o, ow, int(np.prod(w[1:])))
    return ()


def plain_conv_tiles(machine, graph, prim) -> bool:
    """Does conv `prim` get the plain-layout tiles (channels as rows; see prim_tiles)?"""
    return (prim.type.rank == 4 and prim.inputs[1] in graph.constants and prim.attr("group", 1) == 1
            and int(prim.type.shape[1]) % machine.lanes != 0)


def packable(graph, prim) -> bool:
    """Is the right operand of matmul `prim` a constant that a tile schedule may pack?"""
    if prim.op != "matmul" or prim.inputs[1] not in graph.constants:
        return False
    shape = np.shape(graph.constants[prim.inputs[1]])
    return len(shape) >= 2 and all(d == 1 for d in shape[:-2])


def _channel_transparent(p) -> bool:
    """Does the prim keep channels apart (so a blocked layout around it can pay off)?"""
    from .. import primitives
    kind = primitives.kind(p.op)
    if kind == "elementwise":
        return True
    if p.op in ("conv", "pool"):
        return True
    rank = p.type.rank
    if p.op.startswith("reduce_"):
        return 1 not in {a % 4 for a in p.attr("axes", ())} and rank == 4
    if p.op == "pad":
        pads = p.attr("pads", ())
        return len(pads) == 8 and pads[1] == 0 and pads[5] == 0
    if p.op == "concat":
        return p.attr("axis") in (1, -3) and rank == 4
    if p.op in ("gather", "slice"):
        axes = p.attr("axes", (p.attr("axis"),))
        return rank == 4 and all(a is not None and a % 4 != 1 for a in axes)
    return False


def has_blocked_variant(graph, members, inputs, outputs, lanes: int) -> bool:
    """A blocked variant is offered for kernels of channel-transparent prims with at least one
    blockable 4-D activation at their boundary."""
    if not all(_channel_transparent(graph.by_name[m] if isinstance(m, str) else m) for m in members):
        return False
    names = [t for t in inputs if t not in graph.constants] + list(outputs)
    return any(block_of(graph.type_of(t), lanes) is not None for t in names)
