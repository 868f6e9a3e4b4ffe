"""Built-in schedule generators. Importing this package registers them all.

Each module holds one family; phase comments (warm-up, steady, cool-down) mark the structure.
"""

from . import classic, zero_bubble  # noqa: F401
