"""Published CSV row -> scenario mapping (or the reason it cannot be simulated yet).

Part of :mod:`hzpsim.validation`. Every rule is documented next to the code that applies it
and in docs/validation.md §2; per-family model architecture lives in
hzpsim/data/model_families.yaml (:mod:`hzpsim.validation.families`).

    from hzpsim.validation.mapping import case_from_row
    case = case_from_row(row, 0)     # row: {column: value} of published_calibration.csv
    case.scenario_mapping, case.skip_reason, case.assumptions
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from hzpsim import strategies
from hzpsim.config import ScenarioError, from_mapping
from hzpsim.hardware.devices import get_device
from hzpsim.hardware.topology import preset_spec
from hzpsim.model import Model
from hzpsim.model.checkpointing import RECOMPUTE_MODULES
from hzpsim.strategies import _implementations
from hzpsim.validation.cells import RowSkipped, blank, cell_text, need_whole, number, whole
from hzpsim.validation.families import family_of
from hzpsim.validation.measured import measured_values

if TYPE_CHECKING:
    from hzpsim.scenario import Scenario

STRATEGY_FAMILIES = tuple(strategies.published_families())
"""Values of the CSV's ``strategy_family`` column that :func:`map_strategy` knows: every
plugin's ``PUBLISHED_FAMILIES`` (fsdp, zero2, zero3, nd, zeropp)."""


@dataclass(frozen=True)
class Case:
    """One CSV row: the scenario it maps to, or why it cannot be simulated yet.

    ``measured`` holds ``tokens_per_s_per_gpu``, ``step_time_s``, ``tflops_per_gpu``, ``mfu``
    (as the source reports them; None when absent), ``hfu_reported`` (parsed from the notes),
    ``tflops_convention`` (how the source counts FLOPs), ``basis`` ("throughput": a
    convention-free number exists, "reported_only": only an MFU/TFLOP/s of another convention,
    "none") and ``derived`` ({metric: how it was derived} for every value not given directly).
    """

    source_id: str
    """The CSV's ``source_id`` (``S01`` ...)."""
    row_index: int
    """0-based index of the row in the CSV (``--row``)."""
    label: str
    """``S09#52 MPT-1b 8xH100-80GB``: source, row, model, devices."""
    scenario_mapping: dict[str, Any] | None
    """The scenario mapping (model, training, cluster, strategy); None when the row cannot
    be mapped."""
    skip_reason: str | None
    """Why the row is not simulated (names the column), or None."""
    measured: dict[str, Any]
    """Measured and derived values (see the class docstring)."""
    family: str = ""
    """The CSV's ``strategy_family``."""
    system: str = ""
    """The CSV's ``system`` (framework)."""
    n_gpus: int | None = None
    """Devices of the run; None when the CSV does not say."""
    assumptions: tuple[str, ...] = ()
    """Defaults and imputations applied to blank columns."""
    caveats: tuple[str, ...] = ()
    """What the simulator does not model about this run."""

    @property
    def strategy_name(self) -> str | None:
        """The mapped strategy's name; None when unmapped."""
        if self.scenario_mapping is None:
            return None
        return self.scenario_mapping["strategy"]["name"]

    @property
    def runnable(self) -> bool:
        """Mapped, and the strategy is implemented."""
        return self.scenario_mapping is not None and self.skip_reason is None


# ------------------------------------------------------------------------- mapping rules

# Device from the `gpu` column (first match wins). Rule: the catalog entry of the same chip;
# memory variants the catalog lacks map to the nearest entry and are recorded as a caveat.
_GPU_RULES: tuple[tuple[str, str], ...] = (
    ("mi250x", "mi250x"),  # "MI250X (per GCD)": one device = one GCD, as the catalog
    ("v100", "v100"),  # V100 / V100-32GB (DGX-2)
    ("gb200", "gb200"),  # GB200 (NVL72 racks; map_cluster sizes the NVLink domain)
    ("b200", "b200"),  # DGX B200
    ("h200", "h200"),
    ("h100", "h100-sxm"),  # H100-SXM-80GB, H100-80GB (LLM-Foundry, assumed SXM), H100-96GB Grand Teton
    ("40gb", "a100-40gb"),
    ("p4d", "a100-40gb"),  # AWS p4d.24xlarge = 8x A100 40GB (p4de is the 80GB one)
    ("a100", "a100-80gb"),  # A100-80GB, A100-SXM4-80GB, NDm A100 v4
)


def map_device(gpu: str) -> tuple[str, list[str]]:
    g = gpu.lower()
    caveats: list[str] = []
    for key, name in _GPU_RULES:
        if key in g:
            if "96gb" in g:
                caveats.append(
                    "H100 96GB HBM2e @500W (Grand Teton) simulated as h100-sxm with 96 GB "
                    "(cluster.device_memory_bytes) and a 500 W power cap (cluster.device_power_limit_w) "
                    "but the HBM3 bandwidth of the SXM part: the HBM2e figure is not published"
                )
            return name, caveats
    raise RowSkipped(f"gpu: unknown device {gpu!r}")


def map_precision(text: str, device: str) -> tuple[str, list[str]]:
    """fp8* -> fp8, mxfp8* -> fp8, fp16* -> fp16, bf16* -> bf16. 'mixed (fp16/bf16 not stated)' and blank ->
    bf16 (fp16 on V100, which has no bf16 tensor cores): fp16 and bf16 have the same dense peak
    on every other catalog device, so the choice does not change a prediction."""
    t = text.lower()
    for p in ("fp8", "fp16", "bf16"):
        if t.startswith(p):
            return p, []
    if t.startswith("mxfp8"):  # block-scaled FP8 (OCP MX): Blackwell's tensor cores run it at the FP8 rate
        return "fp8", [f"precision {text!r} -> fp8 (MXFP8 runs at the FP8 tensor-core peak)"]
    fallback = "fp16" if device == "v100" else "bf16"
    what = f"precision {text!r}" if t else "precision blank"
    return fallback, [f"{what} -> {fallback} (same peak as the alternative on this device)"]


FP8_RECIPE_WORDS = (("current scaling", "tensorwise"), ("mxfp8", "mxfp8"), ("blockwise", "blockwise"),
                    ("delayed", "delayed"))
"""Words of a row's precision that state its fp8 recipe (Transformer Engine's), and the recipe."""


def map_fp8_recipe(text: str, system: str = "") -> tuple[str | None, list[str]]:
    """The fp8 recipe a row's precision states (:data:`FP8_RECIPE_WORDS`: 'fp8 (current scaling)'
    -> tensorwise, 'mxfp8' -> mxfp8, 'fp8 (blockwise ...)' -> blockwise); a NeMo 24.xx container
    (2024) ran Transformer Engine 1.x, whose only fp8 recipe is delayed scaling
    (``transformer_engine/common/recipe.py``@v1.8: ``DelayedScaling``; current and block scaling
    came with 2.x); else None: the implementation profile's default (``Implementation.fp8_recipe``)."""
    t = text.lower()
    for words, recipe in FP8_RECIPE_WORDS:
        if words in t:
            return recipe, [f"precision {text!r} -> fp8_recipe {recipe}"]
    if re.search(r"nemo 24\.\d\d", system.lower()):
        return "delayed", [f"system {system!r}: Transformer Engine 1.x, fp8_recipe delayed (its only fp8 recipe)"]
    return None, []


def map_recompute(text: str, system: str = "") -> tuple[str, list[str]]:
    """full* -> full, selective* -> selective, none -> none; blank -> none, the default of
    Megatron-LM, NeMo, torchtitan and DeepSpeed when no checkpointing flag is given. MFU on the
    PaLM basis does not depend on it; predicted time does. torchtitan's selective mode is
    per-op selective checkpointing (``selective_ac_option = "op"``, the default of its Llama
    configs, ``train_configs/llama3_8b.toml``) -> ``op``."""
    t = text.lower()
    for mode in ("full", "selective", "none"):
        if t.startswith(mode):
            if mode == "selective" and "torchtitan" in system.lower():
                return "op", [f"act_recompute {text!r}: torchtitan selective AC, per-op (its default "
                              "selective_ac_option 'op') -> op"]
            return mode, []
    return "none", ["act_recompute blank -> none (framework default without a checkpointing flag)"]


_MODULE_ALIASES = {"rmsnorm": "layernorm", "mla up-projection recompute": "mla_up_proj", "mla up-projection": "mla_up_proj"}
"""How a row's recompute note names a Megatron-Core ``--recompute-modules`` entry other than by
its own name."""


def map_recompute_modules(text: str) -> tuple[list[str] | None, list[str]]:
    """The ``recompute_modules`` list a ``selective (...)`` cell states, Megatron-Core's
    ``--recompute-modules`` (``checkpointing.RECOMPUTE_MODULES``; the aliases of
    :data:`_MODULE_ALIASES`): None when the parentheses name no module (a plain selective
    recompute, the attention core). Entries it cannot read are named in the notes."""
    t = text.strip().lower()
    found = re.match(r"selective\s*\(([^)]*)\)(.*)", t)
    if found is None:
        return None, []
    inside, rest = found.group(1), found.group(2).strip()
    modules: list[str] = []
    unread: list[str] = []
    for token in (x.strip() for x in inside.split(",")):
        name = _MODULE_ALIASES.get(token, token)
        if name in RECOMPUTE_MODULES:
            if name not in modules:
                modules.append(name)
        elif token:
            unread.append(token)
    if not modules:
        return None, []
    notes = [f"act_recompute {text!r} -> recompute_modules {modules} (Megatron-Core --recompute-modules)"]
    if unread:
        notes.append(f"act_recompute {text!r}: not a recompute module, ignored: {', '.join(unread)}")
    if rest:
        notes.append(f"act_recompute {text!r}: not modelled, ignored: {rest}")
    return modules, notes


def model_family(name: str) -> str:
    """The family key of a ``model_name`` (rules in hzpsim/data/model_families.yaml)."""
    return family_of(name).name


def fam_of(row: dict[str, Any]) -> str:
    """The family key of a row's ``model_name``."""
    return model_family(cell_text(row, "model_name"))


def _given_or_default(row: dict[str, Any], col: str, default: int | None, why: str, notes: list[str]) -> int:
    """The column as an int; when blank, the family's ``default`` (noted as ``"<col> blank ->
    <why>"``), or a skip when the family has none."""
    v = whole(row, col)
    if v is not None:
        return v
    if default is None:
        raise RowSkipped(f"{col}: not given")
    notes.append(f"{col} blank -> {why}")
    return default


def map_model(row: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """The ``model:`` mapping of a row: its dimensions plus its family's architecture."""
    name = cell_text(row, "model_name")
    fam = family_of(name)
    seq = need_whole(row, "seq_len")
    notes: list[str] = []
    if fam.preset is not None:
        return {"preset": fam.preset, "name": name, "seq_len": seq}, [
            f"architecture from workload preset {fam.preset!r} (CSV dims blank)"
        ]
    layers = need_whole(row, "n_layers")
    hidden = need_whole(row, "hidden")
    heads = need_whole(row, "n_heads")
    k = fam.blank_ffn_hidden_multiple
    ffn = _given_or_default(row, "ffn_hidden", None if k is None else k * hidden,
                            f"{k}*hidden ({fam.blank_ffn_hidden_why})", notes)
    vocab = _given_or_default(row, "vocab", fam.blank_vocab_size,
                              f"{fam.blank_vocab_size} ({fam.blank_vocab_why})", notes)
    m: dict[str, Any] = {
        "name": name,
        "num_layers": layers,
        "hidden_size": hidden,
        "num_heads": heads,
        "ffn_hidden_size": ffn,
        "vocab_size": vocab,
        "seq_len": seq,
    }
    kv = whole(row, "n_kv_heads")
    if kv is not None and kv != heads:
        m["num_kv_heads"] = kv
    m.update(fam.architecture)
    experts, topk = whole(row, "moe_experts"), whole(row, "moe_topk")
    if experts:
        if not topk:
            raise RowSkipped("moe_topk: not given for an MoE row")
        # the CSV's ffn_hidden is the per-expert size for MoE rows (notes of S11/S12)
        m["moe"] = {"num_experts": experts, "top_k": topk, "expert_ffn_hidden_size": ffn}
    return m, notes


# Inter-node bandwidth per device from the `inter_node` text (bytes/s, one direction).
def parse_inter_node(text: str, gpus_per_node: int) -> float | None:
    t = text.lower().replace("gbps", "gb/s")
    if not t:
        return None
    if "omni-path" in t or "opa" in t:
        m = re.search(r"(\d+)\s*links", t)
        links = int(m.group(1)) if m else 1
        return links * 100e9 / 8 / gpus_per_node  # Omni-Path 100 Gb/s per link
    m = re.search(r"(\d+)\s*x\s*(?:slingshot[-\w]*\s*)?(\d+)\s*gb/s", t)
    if m:
        count, rate = int(m.group(1)), float(m.group(2))
        if "per gpu" in t or "1 per gpu" in t:
            return rate * 1e9 / 8
        return count * rate * 1e9 / 8 / gpus_per_node  # per node (or per VM = node)
    m = re.search(r"(\d+)\s*gb/s", t)
    if m:
        rate = float(m.group(1))
        if "per gpu" in t:
            return rate * 1e9 / 8
        if "node-to-node" in t or "per node" in t:
            return rate * 1e9 / 8 / gpus_per_node
        return rate * 1e9 / 8
    return None


def map_cluster(row: dict[str, Any], device: str, n_gpus: int) -> tuple[dict[str, Any], list[str]]:
    """Device's usual fabric (its default preset); gpus_per_node and NIC bandwidth overridden
    only where the row states a different value; num_nodes = n_gpus / gpus_per_node."""
    preset = get_device(device).default_cluster_preset
    base = preset_spec(preset)
    gpn = whole(row, "gpus_per_node") or int(base.gpus_per_node)  # type: ignore[arg-type]
    notes: list[str] = []
    if "nvl72" in cell_text(row, "intra_node_link").lower() and n_gpus > gpn:
        # hzpsim's node is the NVLink domain: the row's 4-GPU compute trays sit in NVL72 racks.
        # A job rarely fills whole 72-GPU racks; the largest tray-aligned share of a rack that
        # divides the job is assumed per rack (64 for 128 to 512 GPUs)
        domain = max(g for g in range(gpn, 73, gpn) if n_gpus % g == 0)
        notes.append(f"NVL72: {domain} GPUs per NVLink domain (rack) assumed, {n_gpus // domain} racks")
        gpn = domain
    if n_gpus % gpn:
        raise RowSkipped(f"n_gpus: {n_gpus} is not a multiple of gpus_per_node {gpn}")
    cluster: dict[str, Any] = {"device": device, "num_nodes": n_gpus // gpn}
    memory_gb = re.search(r"(\d+)\s*gb", cell_text(row, "gpu").lower())
    catalog = get_device(device)
    if memory_gb and float(memory_gb.group(1)) != catalog.memory_label_gb:
        # a variant of the device (e.g. the 96 GB H100): the same share of its label's capacity
        cluster["device_memory_bytes"] = float(memory_gb.group(1)) / catalog.memory_label_gb * catalog.memory_bytes
    power = re.search(r"(\d+)\s*w\b", cell_text(row, "gpu").lower())
    if power and catalog.tdp_w and float(power.group(1)) < catalog.tdp_w:
        # a power-capped variant (the 500 W H100s of Meta's Grand Teton): the sustained clock drops
        cluster["device_power_limit_w"] = float(power.group(1))
    if gpn != base.gpus_per_node:
        cluster["gpus_per_node"] = gpn
    text = cell_text(row, "inter_node")
    nic = parse_inter_node(text, gpn)
    base_nic = float(base.inter_node_bytes_per_s_per_device)  # type: ignore[arg-type]
    if nic is not None and abs(nic - base_nic) > 1e-6 * base_nic:
        cluster["inter_node_bytes_per_s_per_device"] = nic
    if not text and n_gpus > gpn:
        notes.append(f"inter_node blank -> {preset} preset NIC ({base_nic / 1e9:g} GB/s per device)")
    return cluster, notes


def _sequence_parallel(row: dict[str, Any], tp: int) -> bool:
    """True when the notes say SP is on ('selective+SP', 'sequence parallel on'), false when
    they say it is off; otherwise true for TP > 1 under Megatron-Core / NeMo / Megatron-Bridge
    (their recipes and --tp-comm-overlap require it) and torchtitan (its TP plan shards norms
    over the sequence), false for older Megatron-LM / DeepSpeed / metaseq."""
    notes = cell_text(row, "notes").lower()
    if "no sequence parallel" in notes:
        return False
    if "+sp" in notes or "sequence parallel on" in notes:
        return True
    system = cell_text(row, "system").lower()
    modern = any(k in system for k in ("megatron-core", "nemo", "megatron-bridge", "torchtitan"))
    return tp > 1 and modern


def _pre_flash_attention(row: dict[str, Any]) -> bool:
    """Runs that predate FlashAttention in their framework materialise the s x s scores (fused
    softmax + dropout): Megatron-LM 2021-22 (SC'21, Korthikanti), Megatron-DeepSpeed (BLOOM,
    DeepSpeed-Azure), metaseq (OPT), DeepSpeed ZeRO-3(-Offload)/ZeRO++ blog runs and the
    PyTorch 1.11 FSDP prototype. Everything later (Megatron-Core, NeMo, torchtitan,
    LLM-Foundry 'flash attn') uses flash attention, the schema default."""
    system = cell_text(row, "system").lower()
    return system == "megatron-lm" or any(
        k in system for k in ("megatron-deepspeed", "deepspeed zero", "metaseq", "1.11 prototype"))


def _grad_dtype(row: dict[str, Any]) -> str | None:
    """Dtype gradients are reduced in: LLM-Foundry 'PURE' mixed precision reduces in bf16;
    DeepSpeed fp16 reduces in fp16 (its communication_data_type defaults to the working dtype;
    the bf16 optimizer accumulates in fp32); everyone else here keeps fp32 (FSDP
    'DEFAULT' reduce_dtype fp32, Megatron fp32 main grads, torchtitan reduce_dtype fp32)."""
    prec, system = cell_text(row, "precision").lower(), cell_text(row, "system").lower()
    if "pure" in prec or ("deepspeed" in system and prec.startswith("fp16")):
        return "bf16"
    return None  # schema default fp32


# Framework keywords of the ``system`` column, first match wins, and the implementation profile
# each runs any strategy as; a plugin's FRAMEWORK_IMPLEMENTATIONS overrides (DeepSpeed and FSDP
# run only the sharded strategies that declare them; torchtitan runs FSDP2 for ZeRO/HSDP;
# plain Megatron-LM is megatron-2021 for ND).
_FRAMEWORKS = ("deepspeed", "torchtitan", "llm-foundry", "fsdp", "fairscale", "nemo", "megatron-bridge", "megatron-core", "megatron")
_FRAMEWORK_DEFAULTS = {
    "torchtitan": "torchtitan",
    # NeMo and Megatron-Bridge run Megatron-Core as their recipes configure it (megatron-bridge:
    # the same collectives, the recipes' MoE settings)
    "megatron-core": "megatron-core", "nemo": "megatron-bridge", "megatron-bridge": "megatron-bridge",
    # the Megatron-DeepSpeed fork (and Megatron-LM before the overlapped distributed optimizer,
    # 2021-2022 papers): gradients all-reduced after the backward
    "megatron": "deepspeed",
}


def _map_moe(row: dict[str, Any], strategy: dict[str, Any], assumptions: list[str]) -> None:
    """The MoE settings a row states: its token dispatcher (``moe_dispatcher``: Megatron's flex
    dispatcher with a DeepEP or HybridEP backend is ``deepep``) and whether the EP exchanges
    overlap compute (``moe_ep_overlap``: ``--overlap-moe-expert-parallel-comm``, DualPipe), and
    whether the experts run as grouped GEMMs (``moe_grouped_gemm``: ``--moe-grouped-gemm``) and
    the permutation fused (``moe_permute_fusion``: ``--moe-permute-fusion``), each ``true`` or
    ``false``, and the experts' tensor-parallel size (``etp``: ``--expert-tensor-parallel-size``).
    Blank cells leave the implementation profile's defaults."""
    dispatcher = cell_text(row, "moe_dispatcher").lower()
    if dispatcher and strategy.get("ep", 1) > 1:
        if dispatcher not in ("alltoall", "allgather", "deepep"):
            raise RowSkipped(f"moe_dispatcher: unknown dispatcher {dispatcher!r}")
        strategy["moe_dispatcher"] = dispatcher
    if cell_text(row, "moe_ep_overlap").lower() == "true" and strategy.get("ep", 1) > 1:
        strategy["moe_ep_overlap"] = True
    if cell_text(row, "etp") and whole(row, "moe_experts"):
        etp = whole(row, "etp")
        if etp is None or etp < 1:
            raise RowSkipped(f"etp: {cell_text(row, 'etp')!r} is not a positive whole number")
        strategy["etp"] = etp  # 1 too: Megatron-Core's own default is the TP size
    stated_keys = [k for k in ("moe_grouped_gemm", "moe_permute_fusion") if cell_text(row, k)]
    if not stated_keys or not whole(row, "moe_experts"):
        return
    settings = {f.name for f in dataclasses.fields(strategies.get(strategy["name"]).Config)}
    for key in stated_keys:
        stated = cell_text(row, key).lower()
        if key in settings:  # strategies with MoE layers
            if stated not in ("true", "false"):
                raise RowSkipped(f"{key}: {stated!r} is not true or false")
            strategy[key] = stated == "true"


def map_implementation(row: dict[str, Any], strategy: str) -> tuple[str, list[str]]:
    """The implementation profile (``hzpsim.strategies._implementations``) the row's framework
    ran, from its ``system`` (and the strategy's ``FRAMEWORK_IMPLEMENTATIONS``) and, for
    DeepSpeed, the date of its source."""
    system = cell_text(row, "system").lower()
    ref = cell_text(row, "source_ref")
    own = strategies.declared(strategy, "FRAMEWORK_IMPLEMENTATIONS", {})
    for framework in _FRAMEWORKS:
        impl = own.get(framework, _FRAMEWORK_DEFAULTS.get(framework)) if framework in system else None
        if impl is None:
            continue
        if framework == "deepspeed" and impl == "deepspeed":
            # the coalesced ZeRO-3 arrived in DeepSpeed v0.6.0 (2022-01); the 2021 offload post predates it
            old = "2021" in ref or any(f"0.{v}." in system for v in range(6))
            impl = "deepspeed-2021" if old else "deepspeed"
        if impl == "megatron-2021" and "ddp-impl=torch" in cell_text(row, "notes").lower():
            # --DDP-impl torch: PyTorch DDP's bucketed all-reduce during the backward, where the
            # default (local) reduces the whole buffer after it
            return "megatron-2021-torch-ddp", []  # stated by the row (its notes), not assumed
        return impl, []  # read off the system column (docs/validation.md §2), not assumed
    impl = _implementations.DEFAULTS[strategy]
    return impl, [f"implementation: {impl} (the strategy's default; system {system!r} not recognised)"]


def map_strategy(row: dict[str, Any], n_gpus: int, gpus_per_node: int) -> tuple[dict[str, Any], list[str]]:
    """The ``strategy:`` mapping of a row: the layout columns read here, the strategy chosen by
    the plugin that maps the row's ``strategy_family`` (its ``from_published``)."""
    family = cell_text(row, "strategy_family")
    notes: list[str] = []
    system = cell_text(row, "system").lower()
    tp, pp, cp, ep = (whole(row, c, 1) or 1 for c in ("tp", "pp", "cp", "ep"))
    owner = strategies.published_owner(family)
    for column in owner[1] if owner else ():
        if blank(row.get(column)):
            raise RowSkipped(f"{column}: not given (parallel layout unknown)")
    dp = whole(row, "dp")
    if dp is None:
        if n_gpus % (tp * pp * cp):
            raise RowSkipped(f"dp: not given and n_gpus {n_gpus} not divisible by tp*pp*cp")
        dp = n_gpus // (tp * pp * cp)
        notes.append("dp blank -> n_gpus/(tp*pp*cp)")
    if tp * pp * cp * dp != n_gpus:
        raise RowSkipped(f"dp: tp*pp*cp*dp = {tp * pp * cp * dp} != n_gpus {n_gpus}")
    zs = whole(row, "zero_stage")
    if owner is None:
        raise RowSkipped(f"strategy_family: unknown family {family!r}")
    sg_text = cell_text(row, "sharding_group")
    run = strategies.PublishedRun(
        family=family, system=system, gpus_per_node=gpus_per_node, tp=tp, pp=pp, cp=cp, ep=ep, dp=dp, zero_stage=zs,
        sharding_group=int(sg_text) if sg_text.isdigit() else None, sequence_parallel=_sequence_parallel(row, tp),
        column=lambda column: whole(row, column))
    try:
        strategy, more = owner[0].from_published(run)
    except ValueError as exc:  # the plugin cannot map the row: its message names the column
        raise RowSkipped(str(exc)) from None
    return strategy, notes + more


# --------------------------------------------------------------------------- rows -> cases


def _label(row: dict[str, Any], i: int) -> str:
    n = whole(row, "n_gpus")
    gpu = cell_text(row, "gpu").split(" ")[0]
    return f"{cell_text(row, 'source_id')}#{i} {cell_text(row, 'model_name')} {n if n else '?'}x{gpu}"


def _param_check(model_map: dict[str, Any], row: dict[str, Any]) -> str | None:
    """Compare the mapped model's parameter count with the CSV's n_params_b (>10 % off -> caveat)."""
    published = number(row, "n_params_b")
    if not published:
        return None
    if "preset" in model_map:
        return None  # shipped presets carry their own checked parameter counts
    try:
        model = from_mapping(Model, model_map, "model")
    except (ScenarioError, ValueError) as exc:
        raise RowSkipped(f"model: {exc}") from None
    ours = model.num_params() / 1e9
    if abs(ours - published) > 0.10 * published:
        return f"mapped model has {ours:.1f}B parameters, CSV n_params_b says {published:g}B"
    return None


def case_from_row(row: dict[str, Any], index: int, need_measurement: bool = True) -> Case:
    """Map one CSV row (a dict of column -> value) to a Case (``need_measurement``: skip a row
    without a measured throughput; the memory rows have none)."""
    source = cell_text(row, "source_id")
    family = cell_text(row, "strategy_family")
    measured = measured_values(row)
    n_gpus = whole(row, "n_gpus") if not blank(row.get("n_gpus")) else None
    common = dict(family=family, system=cell_text(row, "system"), n_gpus=n_gpus)
    assumptions: list[str] = []
    caveats: list[str] = []
    try:
        if n_gpus is None:
            raise RowSkipped("n_gpus: not given")
        if measured["basis"] == "none" and need_measurement:
            raise RowSkipped("measured_*: no measurement in the row")
        device, c = map_device(cell_text(row, "gpu"))
        caveats += c
        model, a = map_model(row)
        assumptions += a
        gbs = need_whole(row, "global_batch_seqs")
        cluster, a = map_cluster(row, device, n_gpus)
        assumptions += a
        gpn = int(cluster.get("gpus_per_node") or preset_spec(get_device(device).default_cluster_preset).gpus_per_node)  # type: ignore[arg-type]
        strategy, a = map_strategy(row, n_gpus, gpn)
        assumptions += a
        strategy["implementation"], a = map_implementation(row, strategy["name"])
        assumptions += a
        precision, a = map_precision(cell_text(row, "precision"), device)
        assumptions += a
        recompute, a = map_recompute(cell_text(row, "act_recompute"), cell_text(row, "system"))
        assumptions += a
        modules, a = map_recompute_modules(cell_text(row, "act_recompute")) if recompute == "selective" else (None, [])
        assumptions += a
        mbs = whole(row, "micro_batch")
        if mbs is None:
            dp = strategy.get("dp", n_gpus)
            if strategy.get("pp", 1) > 1 or gbs % dp:
                mbs = 1
                assumptions.append("micro_batch blank -> 1")
            else:
                mbs = gbs // dp
                assumptions.append("micro_batch blank -> GBS/dp (no gradient accumulation)")
        training: dict[str, Any] = {
            "global_batch_size": gbs,
            "micro_batch_size": mbs,
            "precision": precision,
            "activation_recompute": recompute,
        }
        if modules is not None:
            training["recompute_modules"] = modules
        grad = _grad_dtype(row)
        if grad:
            training["grad_dtype"] = grad
        if _pre_flash_attention(row):
            training["flash_attention"] = False
        if "compile" in cell_text(row, "system").lower():
            training["compile"] = True
        system = cell_text(row, "system").lower()
        if any(k in system for k in ("megatron", "nemo")):
            # Megatron-LM, Megatron-Core / NeMo / Megatron-Bridge and Megatron-DeepSpeed model
            # code: hand-fused pointwise kernels (bias-dropout-add, bias-GeLU/SwiGLU, TE's fused norms)
            training["fused_kernels"] = True
        if (any(k in system for k in ("megatron-core", "megatron core", "nemo", "megatron-bridge"))
                and training.get("flash_attention", True) and get_device(device).efficiency.gemm_constant == "h100"):
            # Transformer Engine's DotProductAttention picks cuDNN's fused attention over
            # FlashAttention on Hopper "for performance reasons" (TE >= 1.7, attention.py;
            # now dot_product_attention/utils.py::get_attention_backend)
            training["attention_kernel"] = "cudnn"
            assumptions.append("Transformer Engine on Hopper: cuDNN fused attention (attention_kernel cudnn)")
        recipe, a = map_fp8_recipe(cell_text(row, "precision"), cell_text(row, "system")) if precision == "fp8" else (None, [])
        if recipe:
            training["fp8_recipe"] = recipe
            assumptions += a
        if "amp" in cell_text(row, "precision").lower():
            training["autocast"] = True
            assumptions.append("precision 'amp': torch.autocast (fp32 residual stream, casts before GEMMs)")
        mapping = {"model": model, "training": training, "cluster": cluster, "strategy": strategy}
        measured = measured_values(row, model)
        note = _param_check(model, row)
        if note and model.get("tied_embeddings") and family_of(cell_text(row, "model_name")).untie_when_size_mismatch:
            # Megatron-Core GPT runs use --untie-embeddings-and-output-weights: keep the
            # untied variant when it matches the published size and the tied one does not
            untied = {**model, "tied_embeddings": False}
            if _param_check(untied, row) is None:
                model = mapping["model"] = untied
                note = None
                assumptions.append("untied LM head: the tied GPT variant misses CSV n_params_b by >10 %, the untied one matches")
        if note:
            caveats.append(note)
        text = (cell_text(row, "notes") + " " + cell_text(row, "system")).lower()
        if "offload" in text:
            caveats.append("CPU offload of optimizer states / activations is not modelled")
        tp = strategy.get("tp", 1)
        stated_overlap = cell_text(row, "tp_comm_overlap").lower()
        if stated_overlap not in ("", "true", "false"):
            raise RowSkipped(f"tp_comm_overlap: {stated_overlap!r} is not true or false")
        if stated_overlap == "true" and not (tp > 1 and strategy.get("sequence_parallel")):
            # Megatron-Bridge / NeMo turn the userbuffer overlap off below TP 2 or without
            # sequence parallelism (training/comm_overlap.py::CommOverlapConfig._get_model_comm_overlap_cfgs)
            raise RowSkipped("tp_comm_overlap: true needs tp > 1 with sequence parallelism")
        if stated_overlap == "true" or (stated_overlap == "" and tp > 1 and (
                "async tp" in text or "asynctp" in text or "tp-comm-overlap" in text)):
            # async TP (torch/distributed/_symmetric_memory/__init__.py:
            # _fused_all_gather_matmul_impl / _fused_matmul_reduce_scatter_impl) and TE's
            # tp-comm-overlap split each TP all-gather / reduce-scatter into t shards and run the
            # matmul of one shard while the next moves: all but one shard's transfer is hidden
            strategy["tp_comm_overlap"] = (tp - 1) / tp
            assumptions.append(f"async TP / tp-comm-overlap: {tp - 1} of {tp} TP shards' transfers hidden behind "
                               f"the matmul (tp_comm_overlap {(tp - 1) / tp:.3f})")
            if "torchtitan" in cell_text(row, "system").lower():
                # PyTorch's async TP: the forward's collective matmuls (forward +29 %, whole step +8 %
                # in PyTorch's announcement: what the forward alone accounts for)
                strategy["tp_comm_overlap_backward"] = False
                assumptions.append("async TP (PyTorch): the forward's TP transfers only")
        _map_moe(row, strategy, assumptions)
        if "peak" in cell_text(row, "notes").lower() and "not average" in cell_text(row, "notes").lower():
            caveats.append("measured value is a peak, not an average")
    except RowSkipped as exc:
        return Case(source, index, _label(row, index), None, str(exc), measured, **common,  # type: ignore[arg-type]
                    assumptions=tuple(assumptions), caveats=tuple(caveats))
    skip = None
    if strategy["name"] not in strategies.available():
        skip = f"strategy {strategy['name']} not implemented yet"
    return Case(source, index, _label(row, index), mapping, skip, measured, **common,  # type: ignore[arg-type]
                assumptions=tuple(assumptions), caveats=tuple(caveats))


def case_scenario(case: Case, progress: Callable[[str], None] | None = None) -> tuple[Scenario | None, dict[str, Any]]:
    """The Scenario of a runnable case, or None with the record fields that say why not:
    ``status`` skip (the case's ``skip_reason``), invalid (the scenario was rejected: its
    ScenarioError) or error (a strategy plugin's bug in ``check``, recorded so the loop goes on).
    ``progress`` is told the label of each case about to be simulated."""
    from hzpsim.scenario import scenario_from_mapping

    if not case.runnable:
        return None, {"status": "skip", "reason": case.skip_reason}
    if progress:
        progress(case.label)
    try:
        return scenario_from_mapping(case.scenario_mapping, source=case.label), {}
    except ScenarioError as exc:
        return None, {"status": "invalid", "reason": str(exc)}
    except Exception as exc:  # a strategy plugin's bug in check(): record, keep going
        return None, {"status": "error", "reason": f"{type(exc).__name__}: {exc}"}
