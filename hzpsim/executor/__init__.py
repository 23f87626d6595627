"""A small real-torch executor that runs hzpsim's strategies for real and measures them.

Optional part of hzpsim (``pip install -e '.[torch]'``). It builds a decoder transformer from the
same :class:`hzpsim.model.Model` spec the simulator uses, trains it for a few steps with real
``torch.distributed`` (gloo on CPU, NCCL on CUDA: the same code, the device is a flag) and records
per rank and step: step time, every collective call (kind, group size, bytes handed to it),
model-state bytes, peak memory and the loss. It imports nothing from the simulator's engine
(``hzpsim.sim``), so the two can disagree; ``hzpsim/validation/executor.py`` compares them.

Run it::

    hzpsim execute examples/executor-tiny.yaml --world 4
    python -m hzpsim.executor.worker ...      # under torchrun (see docs/executor.md)
"""

from __future__ import annotations

from hzpsim.config import ScenarioError


class TorchMissing(ScenarioError):
    """torch is not installed: the executor commands exit 2 with this message."""


def cuda_available() -> bool:
    """Whether this PyTorch sees a CUDA device (torch must be importable)."""
    import torch

    return bool(torch.cuda.is_available())


def require_torch() -> None:
    """Raise :class:`TorchMissing` (a one-line, exit-2 error) when torch cannot be imported."""
    try:
        import torch  # noqa: F401
        import torch.distributed  # noqa: F401
    except ImportError:
        raise TorchMissing(
            "the executor needs PyTorch: pip install 'hzpsim[torch]' (torch==2.13.0)"
        ) from None
