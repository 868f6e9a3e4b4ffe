"""zbpp.schedules: the schedule core. Pure Python and networkx; never imports torch.

>>> from zbpp.schedules import build, simulate, Costs, Memory
>>> sched = build("zb-h1", num_ranks=4, num_microbatches=8)
>>> sched.stages_on(2)
[2]
>>> res = simulate(sched, Costs(f=1, b=1, w=1), Memory(activation=1, wgrad=1/3))
>>> res.cost
27.0
"""

from .dag import task_graph, validate
from .ir import Action, Kind, Schedule, ScheduleError
from .registry import available, build, options_of, register
from .select import pick_schedule
from .simulate import Costs, Memory, SimResult, fit_message_overhead, simulate
from .torch_csv import from_torch_csv, to_torch_csv

__all__ = [
    "Action",
    "Costs",
    "Kind",
    "Memory",
    "Schedule",
    "ScheduleError",
    "SimResult",
    "available",
    "build",
    "fit_message_overhead",
    "from_torch_csv",
    "options_of",
    "pick_schedule",
    "register",
    "simulate",
    "task_graph",
    "to_torch_csv",
    "validate",
]
