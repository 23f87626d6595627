"""Which regime a published run belongs to, and the runs as calibration measurements.

Regimes (a row can be in a family regime and in ``MoE`` / ``long context`` as well):

* ``Megatron ND`` — ``nd`` rows (Megatron-LM, Megatron-Core/NeMo, torchtitan's ND);
* ``FSDP/ZeRO-3`` — ``zero`` rows run by PyTorch FSDP (LLM-Foundry, torchtitan FSDP2);
* ``DeepSpeed ZeRO`` — ``zero``/``zeropp`` rows run by DeepSpeed;
* ``HSDP`` — ``hsdp`` rows;
* ``MoE`` — models with routed experts;
* ``long context`` — context parallelism or sequences of 16k tokens and more.

A strategy's family regime is what its plugin declares (``VALIDATION_REGIMES``, by
implementation profile).
"""

from __future__ import annotations

from collections.abc import Iterable

from hzpsim import strategies
from hzpsim.model import Model
from hzpsim.validation.mapping import Case
from hzpsim.validation.measured import Measurement

REGIMES = ("Megatron ND", "FSDP/ZeRO-3", "DeepSpeed ZeRO", "HSDP", "MoE", "long context")
LONG_CONTEXT_TOKENS = strategies.LONG_CONTEXT_TOKENS


def regimes_of(mapping: dict, model: Model | None = None) -> tuple[str, ...]:
    """The regimes of a scenario mapping (``model``: its already-loaded model, if at hand;
    ``strategies.regimes``)."""
    from hzpsim.scenario import scenario_from_mapping

    strategy = mapping["strategy"]
    model = model or scenario_from_mapping(mapping).model
    return strategies.regimes(strategy["name"], str(strategy.get("implementation", "")), model.moe is not None,
                              int(strategy.get("cp", 1)), model.seq_len)


def measurements(cases: Iterable[Case]) -> list[Measurement]:
    """The runnable cases with a measured tokens/s per GPU, as calibration measurements."""
    out = []
    from hzpsim.config import ScenarioError

    for case in cases:
        tps = case.measured.get("tokens_per_s_per_gpu")
        if not case.runnable or tps is None or case.scenario_mapping is None:
            continue
        try:
            regimes = regimes_of(case.scenario_mapping)
        except ScenarioError:  # an invalid row (validate published lists it)
            continue
        out.append(Measurement(case.label, case.source_id, case.scenario_mapping, float(tps), regimes))
    return out
