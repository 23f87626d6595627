"""Frontier (MI250X): Dash et al. 2023 measured against hzpsim predicted (issue 24).

    python benchmarks/frontier.py

Source: S. Dash, I. Lyngaas, J. Yin, X. Wang, R. Egele, G. Cong, F. Wang, P. Balaprakash,
"Optimizing Distributed Training on Frontier for Large Language Models", arXiv 2312.12705 (ISC 2024).
Megatron-DeepSpeed on ROCm; one device = one MI250X GCD, 191.5 TF bf16 peak (383 TF per package / 2,
``hzpsim/data/devices/mi250x.yaml``).

What of the paper could be read here (docs/validation.md, "Frontier (MI250X)"): its abstract only
(arxiv.org/abs/2312.12705, also ornl.gov's publication page): "GPU throughputs of 38.38 %, 36.14 % and
31.96 %" of peak for 22B, 175B and 1T, "100 % weak scaling efficiency on 1024 and 3072 MI250X GPUs"
for 175B and 1T, strong-scaling efficiencies of 89 % and 87 %. The paper's tables (model shapes, TP,
PP, DP, micro-batch, global batch, sequence length, ZeRO stage, GCD count per throughput figure) could
not be retrieved, so no row below has a layout and no row is predicted: a layout is never made up.
A row whose ``layout`` is filled in (from the paper's tables, citing the table) is built into a
scenario (strategy ``nd``, the Megatron-DeepSpeed implementation profile that
``hzpsim.validation.mapping.map_implementation`` gives the published rows, the paper's ZeRO stage)
and simulated; the script then prints measured vs predicted % of peak, TFLOP/s per GCD and the error.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

PEAK_TFLOPS_PER_GCD = 383.0 / 2  # MI250X package 383 TF bf16 dense (AMD datasheet) / 2 GCDs
SYSTEM = "Megatron-DeepSpeed (ROCm)"  # the paper's framework, as the published CSV's S18 rows name it
ABSTRACT = "arXiv 2312.12705 abstract"


@dataclass(frozen=True)
class Layout:
    """A configuration as the paper's tables would state it (none could be retrieved)."""

    num_layers: int
    hidden_size: int
    num_heads: int
    seq_len: int
    global_batch_size: int
    micro_batch_size: int
    tp: int
    pp: int
    zero_stage: int
    flash_attention: bool
    activation_recompute: str = "full"
    precision: str = "bf16"
    vocab_size: int = 51200  # Megatron's GPT vocabulary (padded), used only when a table gives no other


@dataclass(frozen=True)
class Row:
    """One measured figure of the paper and where it is stated."""

    model: str
    measured_fraction_of_peak: float
    n_gcds: int | None
    """GCDs of the run, when the text ties the figure to a count (None: not stated)."""
    source: str
    note: str
    layout: Layout | None = None
    """The configuration from the paper's tables; None: not retrieved, not predicted."""


ROWS: tuple[Row, ...] = (
    Row("GPT-22B", 0.3838, None, ABSTRACT, "GCD count of this figure not stated in the abstract"),
    Row("GPT-175B", 0.3614, None, ABSTRACT,
        "abstract: 100 % weak scaling up to 1,024 GCDs; which GCD count gave 36.14 % is not stated"),
    Row("GPT-1T", 0.3196, None, ABSTRACT,
        "abstract: 100 % weak scaling up to 3,072 GCDs; which GCD count gave 31.96 % is not stated"),
)


def scenario_mapping(row: Row, n_gcds: int) -> dict:
    """The hzpsim scenario of a row with a layout: nd on the ``frontier`` preset."""
    from hzpsim.validation.mapping import map_implementation

    lay = row.layout
    if lay is None:
        raise ValueError(f"{row.model}: no layout (the paper's tables were not retrieved)")
    if n_gcds % 8 or n_gcds % (lay.tp * lay.pp):
        raise ValueError(f"{row.model}: {n_gcds} GCDs do not fill 8-GCD nodes or divide by tp*pp")
    implementation, _ = map_implementation({"system": SYSTEM, "source_ref": ABSTRACT}, "nd")
    return {
        "model": {"name": row.model, "num_layers": lay.num_layers, "hidden_size": lay.hidden_size,
                  "num_heads": lay.num_heads, "ffn_hidden_size": 4 * lay.hidden_size,
                  "vocab_size": lay.vocab_size, "seq_len": lay.seq_len},
        "training": {"global_batch_size": lay.global_batch_size, "micro_batch_size": lay.micro_batch_size,
                     "precision": lay.precision, "activation_recompute": lay.activation_recompute,
                     "flash_attention": lay.flash_attention, "fused_kernels": True},
        "cluster": {"preset": "frontier", "num_nodes": n_gcds // 8},
        "strategy": {"name": "nd", "tp": lay.tp, "pp": lay.pp, "zero_stage": lay.zero_stage,
                     "implementation": implementation},
    }


def predict(row: Row) -> dict | None:
    """hzpsim's report for a row with a layout and a GCD count; None otherwise."""
    if row.layout is None or row.n_gcds is None:
        return None
    from hzpsim.cli import run_choice
    from hzpsim.scenario import scenario_from_mapping

    scenario = scenario_from_mapping(scenario_mapping(row, row.n_gcds), source=f"frontier {row.model}")
    return run_choice(scenario, scenario.strategies[0])


def table(rows: tuple[Row, ...] = ROWS) -> list[str]:
    lines = [f"{'model':<9} {'GCDs':>5} {'measured %':>10} {'TF/GCD':>7} {'predicted %':>11} {'TF/GCD':>7} "
             f"{'error':>7}  source; note"]
    for row in rows:
        measured_tf = row.measured_fraction_of_peak * PEAK_TFLOPS_PER_GCD
        gcds = f"{row.n_gcds:,}" if row.n_gcds else "?"
        report = predict(row)
        if report is None:
            why = "not predicted: no layout" if row.layout is None else "not predicted: GCD count not stated"
            lines.append(f"{row.model:<9} {gcds:>5} {row.measured_fraction_of_peak:>10.2%} {measured_tf:>7.1f} "
                         f"{'-':>11} {'-':>7} {'-':>7}  {row.source}; {row.note}; {why}")
            continue
        mfu = report["mfu"]
        lines.append(f"{row.model:<9} {gcds:>5} {row.measured_fraction_of_peak:>10.2%} {measured_tf:>7.1f} "
                     f"{mfu:>11.2%} {mfu * PEAK_TFLOPS_PER_GCD:>7.1f} "
                     f"{mfu / row.measured_fraction_of_peak - 1:>+7.1%}  {row.source}; {row.note}")
    return lines


def main() -> int:
    print("Dash et al. 2023 (arXiv 2312.12705), Frontier, Megatron-DeepSpeed; % of 191.5 TF bf16 per GCD")
    for line in table():
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
