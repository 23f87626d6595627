"""``hzpsim import torchtitan FILE.toml``: a torchtitan job TOML (v0.2.x layout) as a scenario.

Defaults are those of ``torchtitan/config/job_config.py`` (pytorch/torchtitan@v0.2.2 = 73a0e697);
model flavors those of ``torchtitan/models/<name>/__init__.py`` at the same tag.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path
from typing import Any

import tomllib

from hzpsim.cli.imports.common import (
    Draft,
    fill_cluster,
    implementation,
    positive_int,
    read_document,
)
from hzpsim.config import ScenarioError

JOB = "torchtitan/config/job_config.py"
TT = "pytorch/torchtitan@v0.2.2"


def _llama3_ffn(dim: int, multiplier: float, multiple_of: int) -> int:
    """torchtitan/models/llama3/model/model.py::FeedForward: 4 dim, x 2/3, x multiplier, rounded up."""
    hidden = int(2 * (4 * dim) / 3)
    hidden = int(multiplier * hidden)
    return multiple_of * ((hidden + multiple_of - 1) // multiple_of)


# torchtitan/models/llama3/__init__.py::llama3_args (vocab_size 128256: model/args.py::TransformerModelArgs)
LLAMA3 = {
    "8B": dict(num_layers=32, hidden_size=4096, num_heads=32, num_kv_heads=8, ffn_hidden_size=_llama3_ffn(4096, 1.3, 1024)),
    "70B": dict(num_layers=80, hidden_size=8192, num_heads=64, num_kv_heads=8, ffn_hidden_size=_llama3_ffn(8192, 1.3, 4096)),
    "405B": dict(num_layers=126, hidden_size=16384, num_heads=128, num_kv_heads=8,
                 ffn_hidden_size=_llama3_ffn(16384, 1.2, 4096)),
}
#: flavors whose hzpsim workload preset has the same dimensions
PRESETS = {("deepseek_v3", "671B"): "deepseek-v3"}


def register(sub: argparse._SubParsersAction, add_options: Callable[[argparse.ArgumentParser], None]) -> None:
    p = sub.add_parser("torchtitan", help="a torchtitan job TOML")
    p.add_argument("file", help="the job's .toml")
    p.add_argument("--model", metavar="CONFIG", help="a Hugging Face config.json (or its folder) instead of the flavor")
    add_options(p)
    p.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    print(convert(args).render(), end="")
    return 0


class _Toml:
    def __init__(self, data: dict[str, Any], source: str):
        self.data, self.source = data, source

    def get(self, path: str, default: Any, kind: type | tuple[type, ...]) -> tuple[Any, bool]:
        node: Any = self.data
        for part in path.split("."):
            if not isinstance(node, dict) or part not in node:
                return default, False
            node = node[part]
        if kind is int and (isinstance(node, bool) or not isinstance(node, int)) or not isinstance(node, kind):
            raise ScenarioError(f"{self.source}: [{path.rpartition('.')[0]}] {path.rpartition('.')[2]}: expected "
                                f"{getattr(kind, '__name__', kind)}, got {node!r}")
        return node, True


def convert(args: argparse.Namespace) -> Draft:
    source = args.file
    data = read_document(source, tomllib.loads, tomllib.TOMLDecodeError, "TOML")
    t = _Toml(data, source)
    draft = Draft(command=f"hzpsim import torchtitan {source}" + (f" --model {args.model}" if args.model else ""))

    def value(path: str, default: Any, kind: type | tuple[type, ...], why: str) -> Any:
        got, stated = t.get(path, default, kind)
        if not stated:
            draft.defaults.append(f"[{path.rpartition('.')[0]}] {path.rpartition('.')[2]}: {default!r} — {why}")
        return got

    world = fill_cluster(draft, args)
    seq = value("training.seq_len", 2048, int, f"{JOB}::Training")
    _model(draft, t, args, seq)
    shard = value("parallelism.data_parallel_shard_degree", -1, int, f"{JOB}::Parallelism (-1: the devices left)")
    rep = value("parallelism.data_parallel_replicate_degree", 1, int, f"{JOB}::Parallelism")
    tp = value("parallelism.tensor_parallel_degree", 1, int, f"{JOB}::Parallelism")
    pp = value("parallelism.pipeline_parallel_degree", 1, int, f"{JOB}::Parallelism")
    cp = value("parallelism.context_parallel_degree", 1, int, f"{JOB}::Parallelism")
    ep = value("parallelism.expert_parallel_degree", 1, int, f"{JOB}::Parallelism")
    for name, v in (("tensor_parallel_degree", tp), ("pipeline_parallel_degree", pp), ("context_parallel_degree", cp),
                    ("expert_parallel_degree", ep), ("data_parallel_replicate_degree", rep)):
        if v < 1:
            raise ScenarioError(f"{source}: [parallelism] {name}: must be >= 1, got {v}")
    fixed = rep * tp * pp * cp
    if world % fixed:
        raise ScenarioError(f"{source}: [parallelism] replicate {rep} x tensor {tp} x pipeline {pp} x context {cp} = "
                            f"{fixed} does not divide the {world} GPUs")
    if shard == -1:
        shard = world // fixed
    elif shard < 1 or shard * fixed != world:
        raise ScenarioError(f"{source}: [parallelism] data_parallel_shard_degree {shard}: shard x replicate x tensor x "
                            f"pipeline x context = {shard * fixed}, not the {world} GPUs")
    dp = shard * rep
    local = value("training.local_batch_size", 8, int, f"{JOB}::Training")
    gbs = value("training.global_batch_size", -1, int, f"{JOB}::Training (-1: local_batch_size x data-parallel degree)")
    gbs = local * dp if gbs == -1 else positive_int(gbs, "[training] global_batch_size")
    draft.set("training.global_batch_size", gbs)
    if pp > 1:
        mbs = value("parallelism.pipeline_parallel_microbatch_size", 1, int, f"{JOB}::Parallelism")
    else:
        mbs = local
    draft.set("training.micro_batch_size", mbs)
    mp = value("training.mixed_precision_param", "bfloat16", str, f"{JOB}::Training")
    if mp not in ("bfloat16", "float32"):
        raise ScenarioError(f"{source}: [training] mixed_precision_param: {mp!r} (bfloat16 or float32)")
    converters = value("model.converters", [], list, f"{JOB}::Model")
    if any("float8" in str(c) for c in converters):
        draft.set("training.precision", "fp8")
    elif any(str(c) for c in converters):
        raise ScenarioError(f"{source}: [model] converters {converters!r}: only float8 is modelled")
    else:
        draft.set("training.precision", "bf16" if mp == "bfloat16" else "fp32")
    compiled = t.get("compile.enable", False, bool)[0] or t.get("training.compile", False, bool)[0]
    if compiled:
        draft.set("training.compile", True)
    else:
        draft.defaults.append(f"[compile] enable: false — {JOB}::Compile")
    _checkpointing(draft, t, args, value)
    _strategy(draft, t, args, value, shard, rep, tp, pp, cp, ep)
    draft.check()
    return draft


def _model(draft: Draft, t: _Toml, args: argparse.Namespace, seq: int) -> None:
    name = t.get("model.name", None, str)[0]
    flavor = t.get("model.flavor", None, str)[0]
    if args.model:
        path = Path(args.model).expanduser().resolve()
        draft.model = {"preset": str(path), "seq_len": seq}
        draft.why.append(f"model: {args.model} (--model), seq_len from [training] seq_len")
        return
    if name is None or flavor is None:
        raise ScenarioError(f"{t.source}: [model] name and flavor are required (or give --model config.json)")
    if name == "llama3" and flavor in LLAMA3:
        draft.model = {"name": f"torchtitan-llama3-{flavor.lower()}", **LLAMA3[flavor], "vocab_size": 128256,
                       "seq_len": seq, "mlp": "swiglu", "tied_embeddings": False, "norm": "rmsnorm",
                       "position_embedding": "rope", "dropout": False}
        draft.why.append(f"model: torchtitan llama3 flavor {flavor} ({TT}:torchtitan/models/llama3/__init__.py::llama3_args; "
                         "vocab 128256 from model/args.py::TransformerModelArgs; FFN from model/model.py::FeedForward)")
        return
    if (name, flavor) in PRESETS:
        draft.model = {"preset": PRESETS[(name, flavor)], "seq_len": seq}
        draft.why.append(f"model: {name} flavor {flavor} = hzpsim's workload preset {PRESETS[(name, flavor)]} "
                         f"({TT}:torchtitan/models/{name}/__init__.py)")
        return
    raise ScenarioError(f"{t.source}: [model] {name} flavor {flavor!r}: not known to the importer "
                        "(llama3 8B/70B/405B, deepseek_v3 671B); give --model path/to/config.json")


def _checkpointing(draft: Draft, t: _Toml, args: argparse.Namespace, value: Callable[..., Any]) -> None:
    mode = value("activation_checkpoint.mode", "selective", str, f"{JOB}::ActivationCheckpoint")
    if mode == "none":
        return
    if mode == "full":
        draft.set("training.activation_recompute", "full")
        return
    if mode != "selective":
        raise ScenarioError(f"{t.source}: [activation_checkpoint] mode {mode!r}: not modelled (none, selective, full)")
    option = value("activation_checkpoint.selective_ac_option", "2", str, f"{JOB}::ActivationCheckpoint")
    if option == "op":
        draft.set("training.activation_recompute", "op")
    elif option == "1":
        draft.set("training.activation_recompute", "full")
        draft.notes.append("selective_ac_option 1: every layer checkpointed = full recompute")
    elif not args.lenient:
        raise ScenarioError(f"{t.source}: [activation_checkpoint] selective_ac_option {option!r}: checkpointing every "
                            f"{option}-th layer is not modelled (op, 1, or mode full / none; --lenient maps it to full)")
    else:
        draft.set("training.activation_recompute", "full")
        draft.notes.append(f"selective_ac_option {option!r} (every {option}-th layer): modelled as full (--lenient)")


def _strategy(draft: Draft, t: _Toml, args: argparse.Namespace, value: Callable[..., Any],
              shard: int, rep: int, tp: int, pp: int, cp: int, ep: int) -> None:
    why_tt = ("torchtitan: FSDP2 per transformer block plus DTensor TP/SP and torch.distributed.pipelining "
              f"({TT}:torchtitan/models/llama3/infra/parallelize.py::parallelize_llama)")
    if tp == pp == cp == ep == 1:
        if rep == 1:
            draft.set("strategy.name", "zero")
            draft.set("strategy.stage", 3)
            draft.why.append("strategy: zero stage 3 — an FSDP-only layout (data_parallel_shard_degree = all devices)")
            implementation(draft, args, "torchtitan", why_tt + "; the fsdp2 profile would add torch.optim's foreach "
                           "temporaries, but torchtitan's default optimizer is fused (job_config.py::Optimizer)")
        elif shard > 1:
            draft.set("strategy.name", "hsdp")
            draft.set("strategy.shard_group_size", shard)
            draft.why.append(f"strategy: hsdp — {rep} replicas of {shard}-way FSDP (data_parallel_replicate_degree)")
            implementation(draft, args, "torchtitan", why_tt)
        else:
            draft.set("strategy.name", "ddp")
            draft.why.append("strategy: ddp — replicate only (torchtitan's replicate() = PyTorch DDP)")
            implementation(draft, args, "ddp", "torch/csrc/distributed/c10d/reducer.hpp (25 MiB buckets)")
        return
    if rep > 1:
        raise ScenarioError(f"{t.source}: [parallelism] data_parallel_replicate_degree {rep} with tensor/pipeline/"
                            "context/expert parallelism: HSDP inside an ND layout is not modelled")
    draft.set("strategy.name", "nd")
    draft.why.append("strategy: nd — torchtitan's N-D layout (FSDP over data_parallel_shard_degree = nd zero_stage 3)")
    implementation(draft, args, "torchtitan", why_tt)
    draft.set("strategy.tp", tp)
    draft.set("strategy.pp", pp)
    if cp > 1:
        draft.set("strategy.cp", cp)
    if ep > 1:
        draft.set("strategy.ep", ep)
    if tp > 1:
        draft.set("strategy.sequence_parallel", True)
        draft.notes.append("tensor_parallel_degree > 1: torchtitan always applies sequence parallelism with TP "
                           "(parallelize.py::apply_tp)")
    draft.set("strategy.zero_stage", 3 if shard > 1 else 0)
    if pp > 1:
        sched = value("parallelism.pipeline_parallel_schedule", "1F1B", str, f"{JOB}::Parallelism")
        if t.get("parallelism.pipeline_parallel_layers_per_stage", None, int)[1]:
            raise ScenarioError(f"{t.source}: [parallelism] pipeline_parallel_layers_per_stage: uneven torchtitan "
                                "stage splits are not imported")
        if sched == "Interleaved1F1B":
            draft.set("strategy.vpp", 2)
            draft.notes.append("Interleaved1F1B: 2 stages per rank, torchtitan's default for multi-stage schedules "
                               f"({TT}:torchtitan/distributed/pipeline_parallel.py::pipeline_llm)")
        elif sched != "1F1B":
            raise ScenarioError(f"{t.source}: [parallelism] pipeline_parallel_schedule {sched!r}: only 1F1B and "
                                "Interleaved1F1B are modelled")
