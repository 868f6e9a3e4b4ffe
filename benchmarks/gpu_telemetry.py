"""GPU clocks, power and temperature sampled beside a benchmark, averaged over a time window.

An H200 running GEMMs back to back sits at its power cap, so its SM clock is what is left of the
power budget: work beside the GEMMs (NCCL kernels, NVLink traffic) lowers the clock of every kernel,
and a hotter GPU clocks lower at the same power. Comparing a pipeline row's mean SM clock with the
ideal row's says how much of the gap between them is clock, not schedule or runtime::

    telemetry = Telemetry.start()          # nvidia-smi in the background, every 100 ms
    t0 = time.time(); run_steps(); t1 = time.time()
    print(telemetry.window(t0, t1))        # {"0": {"sm_mhz": 1452.1, "power_w": 691.8, "temp_c": 66.0, "samples": 15}, ...}
    telemetry.stop()

The samples cover every GPU of this host that nvidia-smi lists, keyed by its index there (not the
CUDA device index under ``CUDA_VISIBLE_DEVICES``). nvidia-smi runs with ``TZ=UTC`` so that its
timestamps compare with ``time.time()``.
"""

from __future__ import annotations

import datetime
import os
import shutil
import statistics
import subprocess
import tempfile
from dataclasses import dataclass
from typing import IO

__all__ = ["Telemetry", "parse_samples"]

FIELDS = "timestamp,index,clocks.sm,power.draw,temperature.gpu"
Sample = tuple[float, str, float, float, float]  # (unix seconds, GPU index, SM MHz, watts, deg C)


def parse_samples(lines: list[str]) -> list[Sample]:
    """Rows of ``nvidia-smi --query-gpu=timestamp,index,clocks.sm,power.draw,temperature.gpu
    --format=csv,noheader,nounits`` (timestamps in UTC); rows it cannot read (a field shown as
    ``[N/A]``, a line cut short when the process stopped) are skipped.

    >>> parse_samples(["2026/11/30 19:12:45.199, 0, 1452, 691.84, 66", "2026/11/30 19:12:45.2, 1, [N/A], 1, 2"])
    [(1796065965.199, '0', 1452.0, 691.84, 66.0)]
    """
    out = []
    for line in lines:
        parts = [p.strip() for p in line.split(",")]
        if len(parts) != 5:
            continue
        try:
            when = datetime.datetime.strptime(parts[0], "%Y/%m/%d %H:%M:%S.%f").replace(tzinfo=datetime.timezone.utc)
            out.append((when.timestamp(), parts[1], float(parts[2]), float(parts[3]), float(parts[4])))
        except ValueError:
            continue
    return out


@dataclass
class Telemetry:
    """A running ``nvidia-smi`` sampler (`start`) whose samples `window` averages."""

    process: subprocess.Popen[bytes]
    log: IO[str]

    @classmethod
    def start(cls, period_ms: int = 100) -> "Telemetry":
        """Start sampling every `period_ms`; raises RuntimeError where there is no nvidia-smi."""
        exe = shutil.which("nvidia-smi")
        if exe is None:
            raise RuntimeError("GPU telemetry needs nvidia-smi on PATH (NVIDIA GPUs); run without --telemetry")
        log = tempfile.NamedTemporaryFile("w+", prefix="zbpp-telemetry-", suffix=".csv")
        cmd = [exe, f"--query-gpu={FIELDS}", "--format=csv,noheader,nounits", "-lms", str(period_ms)]
        process = subprocess.Popen(cmd, stdout=log, stderr=subprocess.DEVNULL, env=dict(os.environ, TZ="UTC"))
        return cls(process, log)

    def window(self, t0: float, t1: float) -> dict[str, dict[str, float]]:
        """Per GPU index: mean SM clock (MHz), power (W) and temperature (C) of the samples taken
        between unix times `t0` and `t1`, and how many there were (GPUs without one are left out)."""
        self.log.flush()
        with open(self.log.name) as f:
            samples = [s for s in parse_samples(f.read().splitlines()) if t0 <= s[0] <= t1]
        out: dict[str, dict[str, float]] = {}
        for gpu in sorted({s[1] for s in samples}):
            mine = [s for s in samples if s[1] == gpu]
            out[gpu] = {"sm_mhz": statistics.mean(s[2] for s in mine), "power_w": statistics.mean(s[3] for s in mine),
                        "temp_c": statistics.mean(s[4] for s in mine), "samples": len(mine)}
        return out

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.process.kill()
        self.log.close()
