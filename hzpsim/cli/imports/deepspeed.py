"""``hzpsim import deepspeed ds_config.json --model config.json``: a DeepSpeed JSON as a scenario.

Defaults are DeepSpeed's (microsoft/DeepSpeed@38327e07, the commit hzpsim's ``deepspeed``
implementation profile follows): ``deepspeed/runtime/zero/config.py::DeepSpeedZeroConfig``,
``deepspeed/runtime/config.py::DeepSpeedConfig._configure_train_batch_size``.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from hzpsim.cli.imports.common import Draft, fill_cluster, implementation, read_document
from hzpsim.config import ScenarioError
from hzpsim.model.hf_config import is_config_path

ZERO = "deepspeed/runtime/zero/config.py::DeepSpeedZeroConfig"
BATCH = "deepspeed/runtime/config.py::DeepSpeedConfig._configure_train_batch_size"
#: what hzpsim's deepspeed profile fixes (strategies/_implementations.py, IMPLEMENTATIONS["deepspeed"]):
#: DeepSpeed's own defaults; any other value is not modelled
FIXED = {"reduce_bucket_size": 5e8, "stage3_prefetch_bucket_size": 5e7,
         "stage3_param_persistence_threshold": 1e5, "stage3_max_live_parameters": 1e9,
         "stage3_max_reuse_distance": 1e9}


def register(sub: argparse._SubParsersAction, add_options: Callable[[argparse.ArgumentParser], None]) -> None:
    p = sub.add_parser("deepspeed", help="a DeepSpeed ds_config.json (needs --model)")
    p.add_argument("file", help="the DeepSpeed JSON config")
    p.add_argument("--model", required=True, metavar="MODEL",
                   help="a Hugging Face config.json (or its folder) or an hzpsim workload preset name")
    p.add_argument("--recompute", choices=("none", "selective", "full"),
                   help="activation recompute: the model code decides it, not the DeepSpeed JSON (default none)")
    add_options(p)
    p.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    print(convert(args).render(), end="")
    return 0


def _number(block: dict[str, Any], key: str, where: str, kinds: tuple[type, ...] = (int,)) -> Any:
    v = block[key]
    if isinstance(v, bool) or not isinstance(v, kinds):
        hint = " ('auto' is filled in by the Hugging Face integration, not DeepSpeed)" if v == "auto" else ""
        raise ScenarioError(f"{where}{key}: expected a number, got {v!r}{hint}")
    return v


def convert(args: argparse.Namespace) -> Draft:
    source = args.file
    cfg = read_document(source, json.loads, json.JSONDecodeError, "JSON")
    if not isinstance(cfg, dict):
        raise ScenarioError(f"{source}: expected a JSON object")
    draft = Draft(command=f"hzpsim import deepspeed {source} --model {args.model}")
    draft.model = str(Path(args.model).expanduser().resolve()) if is_config_path(args.model) else args.model
    world = fill_cluster(draft, args)
    zero = cfg.get("zero_optimization", {})
    if not isinstance(zero, dict):
        raise ScenarioError(f"{source}: zero_optimization: expected an object")
    for key in ("offload_optimizer", "offload_param"):
        block = zero.get(key)
        if block and (not isinstance(block, dict) or block.get("device", "none") not in ("none", None)):
            raise ScenarioError(f"{source}: zero_optimization.{key}: CPU/NVMe offload is not modelled")
    for key in ("cpu_offload", "cpu_offload_params"):
        if zero.get(key):
            raise ScenarioError(f"{source}: zero_optimization.{key}: CPU offload is not modelled")
    ac = cfg.get("activation_checkpointing") or {}
    if isinstance(ac, dict) and ac.get("cpu_checkpointing"):
        raise ScenarioError(f"{source}: activation_checkpointing.cpu_checkpointing: offload is not modelled")
    _batch(draft, cfg, world, source)
    _precision(draft, cfg, source)
    if args.recompute:
        draft.set("training.activation_recompute", args.recompute)
    else:
        draft.default("training.activation_recompute", "none", "the DeepSpeed JSON does not switch recompute on: the "
                      "model code calls deepspeed.checkpointing.checkpoint (give --recompute)", write=False)
        if ac:
            draft.notes.append("activation_checkpointing is present: it configures DeepSpeed's checkpoint function "
                               "only; give --recompute full if the model uses it")
    stage = zero.get("stage", 0)
    if isinstance(stage, bool) or stage not in (0, 1, 2, 3):
        raise ScenarioError(f"{source}: zero_optimization.stage: expected 0, 1, 2 or 3, got {stage!r}")
    if "stage" not in zero:
        draft.defaults.append(f"zero_optimization.stage: 0 — {ZERO} (stage default 0)")
    for key, default in FIXED.items():
        if key in zero:
            v = _number(zero, key, f"{source}: zero_optimization.", (int, float))
            if float(v) != default:
                message = (f"zero_optimization.{key} {v:g}: hzpsim's deepspeed profile models DeepSpeed's default "
                           f"{default:g} (strategies/_implementations.py); another value is not modelled")
                if not args.lenient:
                    raise ScenarioError(f"{source}: {message} (--lenient lists it instead)")
                draft.notes.append(message + " (--lenient)")
        else:
            draft.defaults.append(f"zero_optimization.{key}: {default:g} — {ZERO}")
    hpz = zero.get("zero_hpz_partition_size", 1)
    qw, qg = zero.get("zero_quantized_weights", False), zero.get("zero_quantized_gradients", False)
    mics = zero.get("mics_shard_size", -1)
    for key, v in (("zero_hpz_partition_size", hpz), ("mics_shard_size", mics)):
        if isinstance(v, bool) or not isinstance(v, int):
            raise ScenarioError(f"{source}: zero_optimization.{key}: expected an integer, got {v!r}")
    for key, v in (("zero_quantized_weights", qw), ("zero_quantized_gradients", qg)):
        if not isinstance(v, bool):
            raise ScenarioError(f"{source}: zero_optimization.{key}: expected true or false, got {v!r}")
    if mics > 0:
        if stage != 3:
            raise ScenarioError(f"{source}: zero_optimization.mics_shard_size needs stage 3, got stage {stage}")
        draft.set("strategy.name", "mics")
        draft.set("strategy.partition_size", mics)
        if zero.get("mics_hierarchical_params_gather"):
            draft.set("strategy.hierarchical_params_gather", True)
        draft.why.append(f"strategy: mics — zero_optimization.mics_shard_size {mics}")
    elif hpz > 1 or qw or qg:
        if stage != 3:
            raise ScenarioError(f"{source}: ZeRO++ (zero_hpz_partition_size / zero_quantized_*) needs stage 3")
        draft.set("strategy.name", "zeropp")
        draft.set("strategy.hpz_partition_size", hpz)
        draft.set("strategy.quantized_weights", qw)
        draft.set("strategy.quantized_gradients", qg)
        draft.why.append("strategy: zeropp — ZeRO++ keys in zero_optimization (DeepSpeed defaults: hpz 1, "
                         f"quantized weights/gradients false, {ZERO})")
    elif stage == 0:
        draft.set("strategy.name", "ddp")
        draft.why.append("strategy: ddp — ZeRO stage 0: plain data parallelism (gradients all-reduced)")
        implementation(draft, args, "ddp", "hzpsim has no DeepSpeed stage-0 profile; DeepSpeed's bucketed "
                       "all-reduce is closest to DDP's")
        draft.check()
        return draft
    else:
        draft.set("strategy.name", "zero")
        draft.set("strategy.stage", stage)
        draft.why.append(f"strategy: zero stage {stage} — zero_optimization.stage")
        if stage in (1, 2):
            draft.default("strategy.overlap_grad_reduce", bool(zero.get("overlap_comm", False)),
                          f"zero_optimization.overlap_comm default false for stages 1/2 ({ZERO})", write=True) \
                if "overlap_comm" not in zero else draft.set("strategy.overlap_grad_reduce", bool(zero["overlap_comm"]))
    implementation(draft, args, "deepspeed", "current DeepSpeed: coalesced per-bucket all-gather and reduce-scatter "
                   "(microsoft/DeepSpeed@38327e07: partitioned_param_coordinator.py::fetch_sub_module)")
    draft.check()
    return draft


def _batch(draft: Draft, cfg: dict[str, Any], world: int, source: str) -> None:
    """DeepSpeed's rule: train_batch_size = micro x accumulation x data-parallel size; any two give the third."""
    tbs = _number(cfg, "train_batch_size", f"{source}: ") if "train_batch_size" in cfg else None
    mbs = _number(cfg, "train_micro_batch_size_per_gpu", f"{source}: ") if "train_micro_batch_size_per_gpu" in cfg else None
    gas = _number(cfg, "gradient_accumulation_steps", f"{source}: ") if "gradient_accumulation_steps" in cfg else None
    if tbs is not None and mbs is not None and gas is not None:
        if tbs != mbs * gas * world:
            raise ScenarioError(f"{source}: train_batch_size {tbs} != train_micro_batch_size_per_gpu {mbs} x "
                                f"gradient_accumulation_steps {gas} x {world} GPUs")
    elif tbs is not None and mbs is not None:
        if tbs % (mbs * world):
            raise ScenarioError(f"{source}: train_batch_size {tbs} is not a multiple of micro batch {mbs} x {world} GPUs")
        draft.defaults.append(f"gradient_accumulation_steps: {tbs // (mbs * world)} — derived ({BATCH})")
    elif tbs is not None:
        gas = gas or 1
        if tbs % (gas * world):
            raise ScenarioError(f"{source}: train_batch_size {tbs} is not a multiple of accumulation {gas} x {world} GPUs")
        mbs = tbs // (gas * world)
        draft.defaults.append(f"train_micro_batch_size_per_gpu: {mbs} — derived ({BATCH})")
    elif mbs is not None:
        if gas is None:
            gas = 1
            draft.defaults.append(f"gradient_accumulation_steps: 1 — {BATCH}")
        tbs = mbs * gas * world
    else:
        raise ScenarioError(f"{source}: train_batch_size or train_micro_batch_size_per_gpu is required ({BATCH})")
    draft.set("training.global_batch_size", tbs)
    draft.set("training.micro_batch_size", mbs)


def _precision(draft: Draft, cfg: dict[str, Any], source: str) -> None:
    def enabled(key: str) -> bool:
        block = cfg.get(key)
        if block is None:
            return False
        if not isinstance(block, dict) or not isinstance(block.get("enabled", False), bool):
            raise ScenarioError(f"{source}: {key}.enabled: expected true or false")
        return bool(block.get("enabled", False))

    bf16 = enabled("bf16") or enabled("bfloat16")
    fp16 = enabled("fp16")
    if bf16 and fp16:
        raise ScenarioError(f"{source}: bf16 and fp16 both enabled")
    if bf16:
        draft.set("training.precision", "bf16")
    elif fp16:
        draft.set("training.precision", "fp16")
        draft.default("training.grad_dtype", "bf16", "fp16: gradients reduced in fp16 (communication_data_type "
                      "defaults to the working dtype, deepspeed/runtime/engine.py::DeepSpeedEngine."
                      "communication_data_type); hzpsim's 2-byte grad_dtype is spelt bf16")
    else:
        draft.default("training.precision", "fp32", "neither bf16 nor fp16 enabled (deepspeed/runtime/config.py)")
