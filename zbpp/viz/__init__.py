"""zbpp.viz: look at schedules. ASCII for terminals; SVG/PNG figures and Perfetto traces.

Imports only `zbpp.schedules` (and matplotlib, lazily, for figures).
"""

from .ascii import render_ascii

__all__ = ["render_ascii"]
