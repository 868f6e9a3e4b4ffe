"""examples/train_hf.py under torchrun, with one fault: on the job's first attempt
(``TORCHELASTIC_RESTART_COUNT`` 0), the process of global rank ``ZBPP_KILL_RANK`` sends itself
SIGKILL inside the loss of the second microbatch of step ``ZBPP_KILL_STEP`` (0-based), i.e. mid-step,
with its peers waiting on it. Launched by tests/examples/test_train_hf_restart.py."""

from __future__ import annotations

import os
import runpy
import signal
from pathlib import Path

from zbpp.models.hf import CausalLMLoss

if os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0" and os.environ["RANK"] == os.environ["ZBPP_KILL_RANK"]:
    at = int(os.environ["ZBPP_KILL_STEP"]) * int(os.environ["ZBPP_MICROBATCHES"]) + 1
    calls = {"n": 0}
    loss = CausalLMLoss.__call__

    def dying(self, logits, labels):  # type: ignore[no-untyped-def]
        if calls["n"] == at:
            os.kill(os.getpid(), signal.SIGKILL)
        calls["n"] += 1
        return loss(self, logits, labels)

    CausalLMLoss.__call__ = dying

runpy.run_path(str(Path(__file__).resolve().parents[2] / "examples" / "train_hf.py"), run_name="__main__")
