"""Goodput: the share of wall time a run trains, given device failures and checkpoints.

The first-order model of checkpoint/restart (Young, "A first order approximation to the optimum
checkpoint interval", CACM 17(9), 1974; Daly, "A higher order estimate of the optimum
checkpoint interval for restart dumps", FGCS 22(3), 2006):

- the cluster fails as a whole when any device fails: devices fail independently at a constant
  rate, so the cluster's mean time between failures is M = ``mtbf_device_hours`` x 3600 / N;
- every checkpoint stalls training for δ: the write of each rank's shard of the model states to
  storage (a synchronous save), or only the device-to-host snapshot of it (an asynchronous save,
  ``torch.distributed.checkpoint.async_save``, which then writes in the background);
- a failure costs the restart (``restart_s``) and the work since the last complete checkpoint:
  on average half an interval of wall time, (τ + δ)/2, plus, for an asynchronous save, the write
  that had not finished yet (the newest checkpoint is complete only a write's time after it was
  taken); an asynchronous save also waits for the previous one's write, so saving more often
  than a write takes stalls for the difference;
- ``interval: auto`` is Young's optimum τ = √(2 δ M) (for an asynchronous save at least one
  write, below which the stall grows as fast as the interval shrinks); Daly's higher-order terms matter only when
  δ is not small against M, which the report then shows as a low fraction.

The fraction of wall time that trains is the first-order sum (Daly's eq. 1 to first order):
1 − δ/(τ + δ) − (R + (τ + δ)/2 + lag)/M, with R = ``restart_s`` and lag the asynchronous write;
``lost_s_per_day`` splits the rest of each day into ``checkpoint``, ``rework`` and ``restart``.
It holds while τ, δ and R are small against M (what a run that trains at all needs); an
asynchronous save, whose stall is shorter but whose checkpoint completes later, gains exactly
when τ < 2M(W − s)/(W + s) (W the write, s the snapshot): at Young's interval, and at any
interval below about twice the MTBF. Pure arithmetic on the step time and the states' size;
the report (``run.plan_of``) supplies both.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from hzpsim.model.training import Checkpoint, Failures

DAY_S = 86_400.0


def young_interval_s(stall_s: float, cluster_mtbf_s: float) -> float:
    """Young's optimum checkpoint interval √(2 δ M) in seconds of training."""
    return math.sqrt(2.0 * stall_s * cluster_mtbf_s)


def goodput(step_time_s: float, num_devices: int, state_bytes_per_device: float,
            failures: Failures | None, checkpoint: Checkpoint | None) -> dict[str, Any]:
    """The ``goodput`` section of a report: the fraction of wall time that trains, the
    checkpoint interval, the expected interruptions and the seconds lost per day by cause."""
    checkpoint = checkpoint or Checkpoint()
    write_s = state_bytes_per_device / checkpoint.write_bytes_per_s_per_device
    snapshot_s = min(state_bytes_per_device / checkpoint.snapshot_bytes_per_s, write_s)
    stall_s = snapshot_s if checkpoint.async_ else write_s
    mtbf_s = failures.mtbf_device_hours * 3600.0 / num_devices if failures is not None else math.inf
    if checkpoint.interval == "auto":
        interval_s = young_interval_s(stall_s, mtbf_s) if math.isfinite(mtbf_s) else math.inf
        if checkpoint.async_:  # no sooner than the previous write ends (below)
            interval_s = max(interval_s, write_s)
    else:
        interval_s = checkpoint.interval * step_time_s
    if checkpoint.async_ and interval_s < write_s:
        # a save first waits for the previous one's background write (torchtitan
        # components/checkpoint.py::CheckpointManager.save -> _async_wait: save_future.result())
        stall_s = snapshot_s + write_s - interval_s
    per_day = DAY_S / mtbf_s
    lag_s = write_s if checkpoint.async_ else 0.0  # the newest checkpoint completes a write later
    cycle_s = interval_s + stall_s
    saving = DAY_S * stall_s / cycle_s if math.isfinite(cycle_s) and cycle_s > 0 else 0.0
    restart = per_day * failures.restart_s if failures is not None else 0.0
    rework = per_day * (cycle_s / 2.0 + lag_s) if per_day else 0.0
    fraction = min(max(1.0 - (saving + restart + rework) / DAY_S, 0.0), 1.0)
    return {
        "fraction": fraction,
        "checkpoint_interval_s": interval_s if math.isfinite(interval_s) else None,
        "checkpoint_interval_steps": (interval_s / step_time_s) if math.isfinite(interval_s) else None,
        "checkpoint_stall_s": stall_s,
        "checkpoint_write_s": write_s,
        "checkpoint_bytes_per_device": state_bytes_per_device,
        "cluster_mtbf_s": mtbf_s if math.isfinite(mtbf_s) else None,
        "expected_interruptions_per_day": per_day,
        "lost_s_per_day": {"checkpoint": saving, "rework": rework, "restart": restart},
    }


IDLE_POWER_FRACTION = 70.55 / 700.0
"""An accelerator's idle draw over its TDP: 70.55 W of 700 W read by nvidia-smi on an idle H100
SXM before any work (2026-11-26, docs/gpu-measurements.md); one device's reading, used for every
device."""


@dataclass(frozen=True)
class Power:
    """What a cluster draws while it trains (``cluster_power``)."""

    device_w: float
    """One accelerator: idle + (its power cap - idle) x the share of the step its compute
    stream is busy (the linear utilisation model of Fan, Weber and Barroso, "Power provisioning
    for a warehouse-sized computer", ISCA 2007, applied to the accelerator)."""
    cluster_w: float
    """Every accelerator, plus every node's ``node_overhead_w``, times the PUE."""


def cluster_power(num_devices: int, num_nodes: int, tdp_w: float | None, power_cap_w: float | None,
                  compute_busy: float, node_overhead_w: float | None, pue: float | None) -> Power | None:
    """The cluster's draw while training (None when the device has no TDP in its file)."""
    if not tdp_w:
        return None
    cap = power_cap_w or tdp_w
    idle = IDLE_POWER_FRACTION * tdp_w
    device = idle + (max(cap, idle) - idle) * min(max(compute_busy, 0.0), 1.0)
    it = num_devices * device + num_nodes * (node_overhead_w or 0.0)
    return Power(device, it * (pue or 1.0))


def whole_run(tokens_per_s: float, num_devices: int, total_tokens: float | None, fraction: float,
              price_per_device_hour: float | None, power: Power | None = None) -> dict[str, Any]:
    """``time_to_train_s`` for ``total_tokens`` at ``tokens_per_s`` while training a ``fraction``
    of the wall time, its ``cost`` at ``price_per_device_hour`` and its ``energy_kwh`` at
    ``power`` (the draw while training, also over the lost time: a restarting job holds its
    nodes) (None where not asked or where the run never trains)."""
    out: dict[str, Any] = {"time_to_train_s": None, "device_hours": None, "cost": None, "energy_kwh": None,
                           "average_power_w": power.cluster_w if power else None}
    if total_tokens is None or fraction <= 0:
        return out
    seconds = total_tokens / tokens_per_s / fraction
    out["time_to_train_s"] = seconds
    out["device_hours"] = seconds / 3600.0 * num_devices
    if price_per_device_hour is not None:
        out["cost"] = out["device_hours"] * price_per_device_hour
    if power is not None:
        out["energy_kwh"] = power.cluster_w * seconds / 3.6e6
    return out
