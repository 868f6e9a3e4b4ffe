"""zbpp.viz: look at schedules. ASCII for terminals; SVG/PNG figures and Perfetto traces.

Imports only `zbpp.schedules` (and matplotlib, lazily, when a figure is drawn).

- `render_ascii(result)`: a text timeline (``zbpp show``).
- `plot(result_or_schedule, costs, path)`: an SVG or PNG figure (``zbpp plot``).
- `write_trace(path, simulated=..., measured=...)`: a Perfetto trace (``zbpp trace``).
"""

from .ascii import render_ascii
from .figure import plot
from .trace import write_trace

__all__ = ["plot", "render_ascii", "write_trace"]
