"""The nouns of a simulation: a transformer's architecture and what it costs to train.

One module per job:

- :mod:`~hzpsim.model.architecture`: :class:`Model` (with :class:`MoE` and :class:`MLA`),
  parameter counts, tensors, linears and FLOPs;
- :mod:`~hzpsim.model.activations`: activation bytes kept for the backward and moved by the
  memory-bound kernels;
- :mod:`~hzpsim.model.checkpointing`: recompute modes and policies (torchtitan's per-op
  selective checkpointing);
- :mod:`~hzpsim.model.dispatch`: eager ATen dispatches and fused kernel launches per layer;
- :mod:`~hzpsim.model.hf_config`: a Hugging Face ``config.json`` read into Model fields;
- :mod:`~hzpsim.model.kernels`, :mod:`~hzpsim.model.ops`, :mod:`~hzpsim.model.training`: the
  kernel list, one rank's op graph and the training settings.

Try it::

    python -c "from hzpsim.model import Model; print(Model(4, 256, 4, 1024, 1000, 128).summary())"
"""

from __future__ import annotations

from hzpsim.model.architecture import MLA, Model, MoE
from hzpsim.model.checkpointing import RECOMPUTE_MODES, RecomputeMode

__all__ = ["MLA", "RECOMPUTE_MODES", "Model", "MoE", "RecomputeMode"]
