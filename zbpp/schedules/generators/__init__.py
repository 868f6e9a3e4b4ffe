"""Built-in schedule generators. Importing this package registers them all.

Each module holds one family; phase comments (warm-up, steady, cool-down) mark the structure.
"""

from . import classic, zero_bubble  # noqa: F401
from . import vshape  # noqa: F401  (zb-v, v-half, v-min)
from . import dualpipe  # noqa: F401  (dualpipe-v)
from . import auto  # noqa: F401  (zb-auto, zbv-auto)
