"""Built-in schedule generators, one family per module; `BUILTIN` lists them for the registry.

Each module holds one family; phase comments (warm-up, steady, cool-down) mark the structure. A
module declares its schedules in a `GENERATORS` table and does not import the registry, which
imports this package and registers `BUILTIN` (so imports point one way: registry -> generators).
"""

from . import auto, classic, dualpipe, interleaved_zb, vshape, zero_bubble

#: Every built-in schedule: name -> (generator, task count or None[, stage count]; one stage per
#: rank without), in the order `available()` lists them.
BUILTIN = {
    **classic.GENERATORS,  # gpipe, 1f1b, interleaved-1f1b
    **zero_bubble.GENERATORS,  # zb-h1, zb-h2
    **interleaved_zb.GENERATORS,  # zb-interleaved
    **vshape.GENERATORS,  # zb-v, v-half, v-min
    **dualpipe.GENERATORS,  # dualpipe-v
    **auto.GENERATORS,  # zb-auto, zbv-auto, zbi-auto
}
