"""Figures and DataFrames: every plot function draws from real results; ``--plot`` writes a file.

    python -m pytest tests/test_plots.py
"""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")

import pytest  # noqa: E402

from hzpsim import frames, plots  # noqa: E402
from hzpsim import search as S  # noqa: E402
from hzpsim.cli import main  # noqa: E402
from hzpsim.scenario import scenario_from_mapping  # noqa: E402

ND = {"model": "tiny-dense", "training": {"global_batch_size": 32},
      "cluster": {"preset": "dgx-h100", "num_nodes": 2},
      "strategy": {"name": "nd", "tp": 2, "pp": 2, "zero_stage": 1}}


@pytest.fixture(scope="module")
def simulated():
    return frames.simulate(scenario_from_mapping(ND))


def test_ops_frame_is_the_reported_step(simulated):
    report, trace = simulated
    ops = frames.ops_frame(trace)
    assert {"name", "category", "stream", "rank", "start_s", "end_s", "duration_s", "flops", "bytes"} <= set(ops)
    assert set(ops["rank"]) == set(trace.graph.weights)
    assert ops["end_s"].max() >= report["step_time_s"] * 0.999
    assert (ops["duration_s"] >= 0).all()
    assert ops.loc[ops["category"] == "forward", "flops"].sum() > 0


def test_memory_frame_peaks_where_the_report_says(simulated):
    report, trace = simulated
    memory = frames.memory_frame(trace)
    assert memory["total"].max() <= report["peak_memory_allocated_bytes"] * (1 + 1e-9)
    assert memory["total"].max() >= 0.5 * report["peak_memory_allocated_bytes"]
    assert memory["time_s"].is_monotonic_increasing


def test_every_figure_draws(simulated, tmp_path):
    report, trace = simulated
    scenario = scenario_from_mapping({**ND, "strategy": {"name": "zero"}})
    space = S.Space(tp=(1, 2), pp=(1, 2), vpp=(1,), micro_batch_size=(1,), activation_recompute=("none", "full"))
    result = S.search(scenario, families=["nd", "zero", "ddp"], top=3, space=space)
    reports = [r.report for r in result.ranked[:4]]
    sweep = frames.reports_frame(reports).assign(devices=[8, 16, 32, 64])
    figures = {
        "timeline": plots.timeline(trace),
        "memory": plots.memory(trace),
        "comparison": plots.comparison(reports),
        "scaling": plots.scaling(sweep, "devices"),
        "landscape": plots.search_landscape(result),
        "run": plots.run_figure([report], [trace]),
        "run-many": plots.run_figure(reports, []),
    }
    # the landscape counts simulated candidates as the search's text and JSON do
    title = figures["landscape"].axes[0].get_title()
    assert f"{result.to_json()['num_simulated']:,} simulated" in title, title
    for name, fig in figures.items():
        assert fig.axes, name
        assert any(ax.has_data() for ax in fig.axes), name
        path = tmp_path / f"{name}.png"
        plots.save(fig, str(path))
        assert path.stat().st_size > 5000, name
    frame = frames.search_frame(result)
    assert len(frame) == len(result.rows)
    # the landscape's memory is what the device holds: a simulated candidate fits exactly when
    # its reserved peak plus the memory outside PyTorch stays within the capacity (less the
    # headroom asked for), so the capacity line separates filled from hollow markers
    spec, device = scenario.topology.spec, scenario.topology.device
    sim = frame[frame["status"] == "simulated"]
    taken = (sim["peak_memory_gib"] + sim["device_overhead_gib"]) * 2**30
    room = device.memory_bytes - spec.min_memory_headroom_bytes
    assert ((taken <= room * (1 + 1e-9)) == sim["fits_in_memory"].astype(bool)).all()
    assert "NCCL communicators" in figures["landscape"].axes[0].get_xlabel()
    ring = figures["landscape"].axes[0].collections[-1].get_offsets()[0][0]  # the best, ringed last
    best = result.best.report
    assert ring == pytest.approx((best["peak_memory_bytes"] + best["device_overhead_bytes"]) / 2**30)
    assert set(frame["status"]) <= {"invalid", "pruned_memory", "pruned_bound", "simulated", "rejected", "error",
                                    "skipped"}


def test_plot_flags_write_files(tmp_path, capsys):
    out = tmp_path / "run.png"
    assert main(["run", "--set", "model=tiny-dense", "--set", "cluster.num_nodes=2", "--set",
                 "training.global_batch_size=32", "--set", "strategy.name=zero", "--plot", str(out)]) == 0
    assert out.stat().st_size > 5000
    out = tmp_path / "search.svg"
    assert main(["search", "--set", "model=tiny-dense", "--set", "cluster.num_nodes=2", "--set",
                 "training.global_batch_size=32", "--workers", "1", "--family", "zero,ddp", "--space",
                 "micro_batch_size=1", "--plot", str(out)]) == 0
    assert out.read_text().lstrip().startswith(("<?xml", "<svg"))
    capsys.readouterr()
    assert main(["run", "--set", "model=tiny-dense", "--set", "strategy.name=zero", "--plot",
                 str(tmp_path / "no" / "x.png")]) == 2
    assert "--plot" in capsys.readouterr().err
