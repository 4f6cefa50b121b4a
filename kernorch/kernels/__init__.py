"""Kernel templates as data: register tiles derived from the machine, compile-time weight layouts,
and blocked activation layouts.

Nothing here imports TVM. `tiles` says which micro-kernel tiles a contraction may use on a given
`Machine` (the register file and vector width decide); `pack` says how an operand is re-laid-out
(a weight packed for a tile, an activation blocked nChw16c), with the numpy packing and the TE
views; `winograd` is the F(m x m, 3 x 3) convolution (its transforms, its TE compute, its
transformed weight); `variants` names a kernel's variant (its tile and boundary layouts) and derives its packs.
Measurement, the database and the emitted executable agree because all of them go through
`variants`.
"""
from .pack import Pack
from .tiles import LengthSwitch, Tile, contraction_tiles
from .winograd import Winograd
from .variants import (blocked, has_blocked_variant, layout_of, pack_args, prim_tiles, split, unpack_outputs,
                       variant_out_packs, variant_packs)

__all__ = ["LengthSwitch", "Pack", "Tile", "blocked", "contraction_tiles", "has_blocked_variant", "layout_of",
           "pack_args", "prim_tiles", "split", "unpack_outputs", "variant_out_packs", "variant_packs", "Winograd"]
