"""Predicted vs measured throughput of published large training runs (DESIGN §6).

``hzpsim/data/published_calibration.csv`` lists 192 measured runs (Megatron-LM, NeMo,
LLM-Foundry, torchtitan, DeepSpeed, ...) with their model, cluster and parallel layout. This
module turns every row into a scenario mapping (or says why it cannot), simulates the ones that
run today and tabulates the signed error. It never tunes anything: a disagreement is a finding,
written up in ``docs/validation.md``.

    from hzpsim.validation import rows_to_scenarios, validate_published, format_validation
    cases = rows_to_scenarios()                       # the packaged CSV
    df = validate_published(select_cases(cases, families=["fsdp", "zero2", "zero3"]))
    print(format_validation(df))

    hzpsim validate published --family fsdp --max-devices 64      # the command (hzpsim.cli.validate)

Comparison basis. Tokens/s per GPU (equivalently the step time) is convention-free and is the
headline metric. The CSV's MFU / TFLOP/s columns use each source's own FLOP convention (SC'21
and the DeepSpeed-Azure post count full-recompute "hardware" FLOPs, LLM-Foundry counts
6·N_all-params + 12·l·h·s, NVIDIA "model flops" ...), so they are never compared directly
with hzpsim's PaLM MFU. Instead the measured tokens/s is converted to an MFU on DESIGN's PaLM
basis (``meas_mfu_palm``); where a source gives only TFLOP/s *and* its notes give the formula
(SC'21's 96·B·s·l·h²(1 + s/6h + V/16lh) per iteration), the step time is recovered exactly from
it. Rows with nothing but an MFU/TFLOP/s of another or unstated convention are compared on that
number only as a flagged, approximate side column and are left out of the headline statistics.

Every mapping rule is documented next to the code that applies it and in docs/validation.md.

Modules: ``cells`` (reading one CSV cell), ``families`` (per-family model architecture, from
hzpsim/data/model_families.yaml), ``mapping`` (row -> scenario mapping, :class:`Case`),
``measured`` (measured and derived values), ``csvfile`` (reading and selecting rows), ``run``
(simulating, statistics), ``table`` (the table ``hzpsim validate published`` prints). The
command itself (its options, their checks, the JSON) is :mod:`hzpsim.cli.validate`.
"""

from hzpsim.validation.csvfile import (
    DEFAULT_CSV,
    REQUIRED_COLUMNS,
    read_rows,
    rows_to_scenarios,
    select_cases,
)
from hzpsim.validation.families import ModelFamily, family_of, model_families
from hzpsim.validation.mapping import (
    STRATEGY_FAMILIES,
    Case,
    case_from_row,
    fam_of,
    map_cluster,
    map_device,
    map_fp8_recipe,
    map_model,
    map_precision,
    map_recompute,
    map_strategy,
    model_family,
    parse_inter_node,
)
from hzpsim.validation.measured import measured_values, sc21_flops_per_iteration
from hzpsim.validation.run import COLUMNS, skip_category, summarize, validate_published
from hzpsim.validation.table import format_validation

__all__ = [
    "COLUMNS",
    "DEFAULT_CSV",
    "REQUIRED_COLUMNS",
    "STRATEGY_FAMILIES",
    "Case",
    "ModelFamily",
    "case_from_row",
    "fam_of",
    "family_of",
    "format_validation",
    "map_cluster",
    "map_device",
    "map_model",
    "map_fp8_recipe",
    "map_precision",
    "map_recompute",
    "map_strategy",
    "measured_values",
    "model_families",
    "model_family",
    "parse_inter_node",
    "read_rows",
    "rows_to_scenarios",
    "sc21_flops_per_iteration",
    "select_cases",
    "skip_category",
    "summarize",
    "validate_published",
]
