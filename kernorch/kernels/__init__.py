"""Kernel templates as data: register tiles derived from the machine, and compile-time weight layouts.

Nothing here imports TVM. `tiles` says which micro-kernel tiles a contraction may use on a given
`Machine` (the register file and vector width decide); `pack` says how a constant operand is
re-laid-out at compile time for a tile, with the numpy packing and the TE view that reads the
packed array as the logical one. The TVM backend applies both; measurement, the database and the
emitted executable agree because all of them go through `variants.variant_packs`.
"""
from .pack import Pack
from .tiles import Tile, contraction_tiles
from .variants import pack_args, prim_tiles, variant_packs

__all__ = ["Pack", "Tile", "contraction_tiles", "pack_args", "prim_tiles", "variant_packs"]
