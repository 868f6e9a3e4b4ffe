"""zbpp.models: bring a model, get this rank's pipeline stages.

- `pipeline_stages`: cut a model (built on the ``meta`` device) into a schedule's stages by module
  FQNs or balanced over its repeated blocks; only this rank's stages are materialised; weights
  that two stages share come back as tied parameters (`stages.py`, `partition.py`).
- `measure_profile`: a per-layer `zbpp.schedules.profile.Profile` (F, B, W times, activation,
  W-kept and static bytes) measured on one device, for `zbpp.schedules.planner.search`
  (`profile.py`); `measure_causal_lm` builds and measures a Hugging Face causal LM from its config.
- `zbpp.models.hf`: Hugging Face decoder-only causal LMs of every family that fits embed ->
  decoder layers -> final norm -> LM head (79 model types tested exact against HF, from Llama,
  Qwen, Gemma, Mistral and GPT-2 to Qwen3-Next, gpt-oss and DeepSeek-V3:
  ``zbpp.models.hf.SUPPORTED``), each
  stage running the model's own forward for its layers, with HF's loss and the MoE router
  auxiliary loss (needs ``pip install zbpp[hf]``).

Nothing in zbpp imports this package but the command line and the examples.

>>> import torch
>>> from zbpp.models import balanced_partition
>>> balanced_partition([4, 1, 1, 1, 1], 2)  # block costs; max stage load 4
[1, 4]
"""

from __future__ import annotations

from .partition import balanced_partition, partition_loads
from .profile import measure_causal_lm, measure_profile
from .stages import PipelineStages, fqns_per_stage, pipeline_stages

__all__ = ["pipeline_stages", "fqns_per_stage", "PipelineStages", "balanced_partition", "partition_loads",
           "measure_profile", "measure_causal_lm"]
