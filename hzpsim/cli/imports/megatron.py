"""``hzpsim import megatron FILE``: a ``pretrain_gpt.py`` launch (or argument list) as a scenario.

Arguments are read as Megatron-LM defines them (``megatron/training/arguments.py``; the 2021
names of ``megatron/arguments.py`` at 6985e589 too). Each argument is one of: read (typed,
mapped to a scenario field), ignored (does not change a step's time or memory: data, logging,
learning rate, checkpoint paths, ...), or unknown (refused, exit 2, unless ``--lenient``).
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

from hzpsim.cli.imports import shell
from hzpsim.cli.imports.common import Draft, fill_cluster, implementation, read_text
from hzpsim.config import ScenarioError
from hzpsim.model.training import FP8_RECIPES

ARGS = "megatron/training/arguments.py"
VALIDATE = f"{ARGS}::validate_args"
ARGS_2021 = "megatron/arguments.py@6985e589"

# argument -> type: int, float, str, or bool for a flag (store_true)
READ: dict[str, Callable[[str], Any] | type] = {
    "num-layers": int, "hidden-size": int, "num-attention-heads": int, "group-query-attention": bool,
    "num-query-groups": int, "ffn-hidden-size": int, "kv-channels": int, "seq-length": int,
    "max-position-embeddings": int, "vocab-size": int, "make-vocab-size-divisible-by": int, "swiglu": bool,
    "normalization": str, "position-embedding-type": str, "use-rotary-position-embeddings": bool,
    "no-position-embedding": bool, "untie-embeddings-and-output-weights": bool, "disable-bias-linear": bool,
    "add-qkv-bias": bool, "qk-layernorm": bool, "hidden-dropout": float, "attention-dropout": float,
    "num-experts": int, "moe-router-topk": int, "moe-ffn-hidden-size": int, "moe-layer-freq": int,
    "moe-shared-expert-intermediate-size": int, "micro-batch-size": int, "global-batch-size": int,
    "bf16": bool, "fp16": bool, "fp8-format": str, "fp8-recipe": str, "accumulate-allreduce-grads-in-fp32": bool,
    "recompute-granularity": str, "recompute-method": str, "recompute-num-layers": int,
    "recompute-modules": str, "recompute-activations": bool, "checkpoint-activations": bool, "activations-checkpoint-method": str,
    "activations-checkpoint-num-layers": int, "tensor-model-parallel-size": int,
    "pipeline-model-parallel-size": int, "context-parallel-size": int, "expert-model-parallel-size": int,
    "expert-tensor-parallel-size": int, "num-layers-per-virtual-pipeline-stage": int,
    "virtual-pipeline-model-parallel-size": int, "decoder-first-pipeline-num-layers": int,
    "decoder-last-pipeline-num-layers": int, "sequence-parallel": bool, "use-distributed-optimizer": bool,
    "overlap-grad-reduce": bool, "overlap-param-gather": bool, "tp-comm-overlap": bool, "use-flash-attn": bool,
    "transformer-impl": str, "ddp-impl": str, "no-bias-gelu-fusion": bool, "no-bias-dropout-fusion": bool,
    "no-bias-swiglu-fusion": bool, "use-mcore-models": bool, "use-legacy-models": bool,
    "moe-token-dispatcher-type": str, "moe-enable-deepep": bool, "moe-flex-dispatcher-backend": str,
    "overlap-moe-expert-parallel-comm": bool, "moe-grouped-gemm": bool, "moe-permute-fusion": bool, "moe-expert-capacity-factor": float,
    "moe-pad-expert-input-to-capacity": bool,
}
#: Arguments that do not change one step's time or memory as hzpsim models it.
IGNORED = frozenset("""
data-path train-data-path valid-data-path test-data-path vocab-file merge-file tokenizer-type tokenizer-model
split data-cache-path dataloader-type num-workers mock-data data-impl log-interval log-throughput
log-timers-to-tensorboard log-validation-ppl-to-tensorboard log-params-norm log-num-zeros-in-grad
tensorboard-dir tensorboard-log-interval tensorboard-queue-size wandb-project wandb-exp-name wandb-save-dir
timing-log-level timing-log-option eval-iters eval-interval save load save-interval no-save-optim no-save-rng
no-load-optim no-load-rng ckpt-format async-save exit-interval exit-duration-in-mins exit-signal-handler
train-iters train-samples lr min-lr lr-decay-style lr-decay-iters lr-decay-samples lr-warmup-fraction
lr-warmup-iters lr-warmup-samples lr-warmup-init weight-decay start-weight-decay end-weight-decay clip-grad
adam-beta1 adam-beta2 adam-eps init-method-std seed loss-scale initial-loss-scale min-loss-scale
loss-scale-window hysteresis distributed-backend distributed-timeout-minutes norm-epsilon layernorm-epsilon
rotary-base rotary-percent rope-scaling-factor use-rope-scaling attention-softmax-in-fp32
apply-query-key-layer-scaling no-masked-softmax-fusion no-gradient-accumulation-fusion
no-async-tensor-model-parallel-allreduce no-scatter-gather-tensors-in-pipeline use-cpu-initialization
no-persist-layer-norm bias-gelu-fusion bias-dropout-fusion masked-softmax-fusion untie-embeddings init-method-xavier-uniform
manual-gc manual-gc-interval log-memory-to-tensorboard log-world-size-to-tensorboard
use-contiguous-buffers-in-local-ddp log-loss-scale-to-tensorboard tokenizer-prompt-format
""".split())
ERA_2021 = ("ddp-impl", "activations-checkpoint-method", "activations-checkpoint-num-layers", "checkpoint-activations")


def register(sub: argparse._SubParsersAction, add_options: Callable[[argparse.ArgumentParser], None]) -> None:
    p = sub.add_parser("megatron", help="a pretrain_gpt.py launch script or argument list")
    p.add_argument("file", help="launch script (bash) or a file of pretrain_gpt.py arguments")
    add_options(p)
    p.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    print(convert(args).render(), end="")
    return 0


LISTS = frozenset({"recompute-modules"})
"""Arguments that take several words (argparse ``nargs='*'`` in ``megatron/training/arguments.py``)."""


def parse_arguments(words: list[str], source: str) -> dict[str, str | None]:
    """``--name value`` / ``--name=value`` / ``--flag`` -> {name: value or None}, names lower-case."""
    out: dict[str, str | None] = {}
    i = 0
    while i < len(words):
        word = shell.check_resolved(words[i], f"{source}: argument {i + 1}")
        if not word.startswith("--"):
            raise ScenarioError(f"{source}: {word!r}: expected a --argument (pretrain_gpt.py takes no positional ones)")
        name, eq, value = word[2:].partition("=")
        name = name.lower().replace("_", "-")
        if not eq and name in LISTS:  # nargs='*': every word up to the next --argument
            items = []
            while i + 1 < len(words) and not words[i + 1].startswith("--"):
                items.append(shell.check_resolved(words[i + 1], f"{source}: --{name}"))
                i += 1
            out[name] = " ".join(items) if items else None
            i += 1
            continue
        if not eq:
            nxt = words[i + 1] if i + 1 < len(words) else None
            if nxt is not None and (not nxt.startswith("-") or _number(nxt)):
                value, i = nxt, i + 1
            else:
                value = None  # type: ignore[assignment]
        out[name] = value
        i += 1
    return out


def _number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


class _Args:
    """Typed access to the parsed arguments, every error naming the argument."""

    def __init__(self, raw: dict[str, str | None], source: str):
        self.raw, self.source = raw, source

    def has(self, name: str) -> bool:
        return name in self.raw

    def get(self, name: str, default: Any = None) -> Any:
        if name not in self.raw:
            return default
        kind = READ[name]
        value = self.raw[name]
        where = f"{self.source}: --{name}"
        if kind is bool:
            if value is not None:
                raise ScenarioError(f"{where}: a flag, takes no value (got {value!r})")
            return True
        if value is None:
            raise ScenarioError(f"{where}: needs a value")
        shell.check_resolved(value, where)
        try:
            return kind(value)
        except ValueError:
            raise ScenarioError(f"{where}: expected {getattr(kind, '__name__', kind)}, got {value!r}") from None

    def need(self, name: str) -> Any:
        if name not in self.raw:
            raise ScenarioError(f"{self.source}: --{name} is required by pretrain_gpt.py ({VALIDATE})")
        return self.get(name)


def _launcher(words: list[str]) -> tuple[int | None, int | None, str]:
    """(nodes, devices per node, where) from torchrun / torch.distributed / srun / sbatch tokens."""
    nodes = per_node = None
    where = []
    keys = {"--nnodes": "nodes", "--nodes": "nodes", "-N": "nodes", "--num_nodes": "nodes", "--num-nodes": "nodes",
            "--nproc_per_node": "per", "--nproc-per-node": "per", "--ntasks-per-node": "per",
            "--gpus-per-node": "per", "--num_gpus": "per", "--num-gpus": "per"}
    i = 0
    while i < len(words):
        word = words[i]
        key, eq, value = word.partition("=")
        if key in keys:
            if not eq:
                value = words[i + 1] if i + 1 < len(words) else ""
                i += 1
            value = shell.check_resolved(value, f"launcher option {key}")
            if not value.isdigit():
                raise ScenarioError(f"launcher option {key}: expected a whole number, got {value!r} "
                                    "(elastic ranges and 'auto'/'gpu' cannot be resolved: give --nodes / --gpus-per-node)")
            if keys[key] == "nodes":
                nodes = int(value)
            else:
                per_node = int(value.split(":")[-1])
            where.append(f"{key} {value}")
        i += 1
    return nodes, per_node, ", ".join(where)


def convert(args: argparse.Namespace) -> Draft:
    source = args.file
    launch = shell.parse(read_text(source), source)
    if launch.script and not launch.script.endswith("pretrain_gpt.py"):
        raise ScenarioError(f"{source}: launches {launch.script}: only pretrain_gpt.py (a GPT decoder) is imported")
    raw = parse_arguments(launch.arguments, source)
    draft = Draft(command=f"hzpsim import megatron {source}")
    unknown = sorted(k for k in raw if k not in READ and k not in IGNORED)
    if unknown and not args.lenient:
        raise ScenarioError(f"{source}: --{unknown[0]}: an argument the importer does not know, so it cannot tell "
                            "what it changes (pass --lenient to list it in the header instead)")
    for name in unknown:
        draft.notes.append(f"--{name}: unknown to the importer, not modelled (--lenient)")
    ignored = sorted(k for k in raw if k in IGNORED)
    if ignored:
        draft.notes.append("ignored (no effect on a step as hzpsim models it): " + " ".join(f"--{k}" for k in ignored))
    a = _Args(raw, source)
    old = [k for k in ERA_2021 if a.has(k)]
    if old:
        chosen = "megatron-2021"
        why = (f"2021 Megatron-LM (arguments {', '.join('--' + k for k in old)} exist only in {ARGS_2021}, "
               "the SC'21 code): the whole gradient buffer all-reduced after the backward, a host sync after "
               "every pipeline send")
    else:
        chosen = "megatron-core"
        why = ("Megatron-Core (no 2021-only argument such as --DDP-impl or --activations-checkpoint-method): "
               "bucketed gradient reduce-scatter / all-reduce (megatron/core/distributed/param_and_grad_buffer.py)")
    draft.set("strategy.name", "nd")
    implementation(draft, args, chosen, why)
    era = ARGS_2021 if old else ARGS

    tp = a.get("tensor-model-parallel-size", 1)
    pp = a.get("pipeline-model-parallel-size", 1)
    cp = a.get("context-parallel-size", 1)
    ep = a.get("expert-model-parallel-size", 1)
    nodes, per_node, where = _launcher(launch.launcher)
    world = fill_cluster(draft, args, nodes, per_node, f"the launcher ({where})" if where else "")
    for name, value in (("tensor-model-parallel-size", tp), ("pipeline-model-parallel-size", pp),
                        ("context-parallel-size", cp), ("expert-model-parallel-size", ep)):
        if value < 1:
            raise ScenarioError(f"{source}: --{name}: must be >= 1, got {value}")
    if world % (tp * pp * cp):
        raise ScenarioError(f"{source}: --tensor-model-parallel-size {tp} x --pipeline-model-parallel-size {pp} x "
                            f"--context-parallel-size {cp} = {tp * pp * cp} does not divide the {world} GPUs")
    dp = world // (tp * pp * cp)
    _model(draft, a, tp, Path(source).stem, era, old)
    _training(draft, a, dp, era, old)
    _strategy(draft, a, tp, pp, cp, ep, era)
    draft.check()
    return draft


def _model(draft: Draft, a: _Args, tp: int, name: str, era: str, old: list[str]) -> None:
    draft.set("model.name", name)
    layers, hidden, heads = a.need("num-layers"), a.need("hidden-size"), a.need("num-attention-heads")
    draft.set("model.num_layers", layers)
    draft.set("model.hidden_size", hidden)
    draft.set("model.num_heads", heads)
    if a.has("group-query-attention"):
        draft.set("model.num_kv_heads", a.get("num-query-groups", 1))
    if a.has("kv-channels"):
        draft.set("model.head_dim", a.get("kv-channels"))
    swiglu = a.has("swiglu")
    draft.set("model.mlp", "swiglu") if swiglu else draft.default("model.mlp", "gelu", f"no --swiglu: GeLU MLP ({era})")
    if a.has("ffn-hidden-size"):
        ffn = a.get("ffn-hidden-size")
        draft.set("model.ffn_hidden_size", ffn)
    elif swiglu:
        ffn = int((4 * hidden * 2 / 3) / 64) * 64
        draft.default("model.ffn_hidden_size", ffn, f"--swiglu: int(4h x 2/3 / 64) x 64 ({VALIDATE})")
    else:
        ffn = 4 * hidden
        draft.default("model.ffn_hidden_size", ffn, f"4 x hidden_size ({era}::validate_args)")
    if a.has("vocab-size"):
        vocab = a.get("vocab-size")
        why = "--vocab-size"
    else:
        vocab = 50257
        why = "the tokenizer's vocabulary is not in the launch: GPT-2 BPE's 50257"
    multiple = a.get("make-vocab-size-divisible-by", 128) * tp
    padded = int(math.ceil(vocab / multiple) * multiple)
    fn = ("megatron/tokenizer/tokenizer.py::_vocab_size_with_padding" if old
          else "megatron/core/tokenizers/utils/build_tokenizer.py::vocab_size_with_padding")
    draft.default("model.vocab_size", padded, f"{why}, padded to a multiple of make-vocab-size-divisible-by "
                  f"{multiple // tp} x TP {tp} ({fn})")
    seq = a.need("seq-length")
    draft.set("model.seq_len", seq)
    norm = a.get("normalization", None)
    if norm is None:
        draft.default("model.norm", "layernorm", f"--normalization default LayerNorm ({era})")
        draft.default("model.norm_bias", True, "LayerNorm has a bias")
    elif norm in ("LayerNorm", "RMSNorm"):
        draft.set("model.norm", norm.lower())
        draft.set("model.norm_bias", norm == "LayerNorm")
    else:
        raise ScenarioError(f"--normalization: {norm!r} is not modelled (LayerNorm or RMSNorm)")
    pos = a.get("position-embedding-type", None)
    if a.has("use-rotary-position-embeddings"):
        pos = "rope"
    if a.has("no-position-embedding"):
        pos = "none"
    mapping = {"learned_absolute": "learned", "rope": "rope", "none": "none"}
    if pos is None:
        draft.default("model.position_embedding", "learned", f"--position-embedding-type default learned_absolute ({era})")
    elif pos in mapping:
        draft.set("model.position_embedding", mapping[pos])
    else:
        raise ScenarioError(f"--position-embedding-type: {pos!r} is not modelled (learned_absolute, rope or none)")
    if a.has("max-position-embeddings") and (pos is None or pos == "learned_absolute"):
        draft.set("model.max_position_embeddings", a.get("max-position-embeddings"))
    tied = not a.has("untie-embeddings-and-output-weights")
    draft.set("model.tied_embeddings", False) if not tied else draft.default(
        "model.tied_embeddings", True, f"no --untie-embeddings-and-output-weights: output layer shares the embedding ({era})")
    bias = not a.has("disable-bias-linear")
    draft.set("model.linear_bias", False) if not bias else draft.default(
        "model.linear_bias", True, f"no --disable-bias-linear: add_bias_linear True ({era})")
    if a.has("add-qkv-bias"):
        draft.set("model.qkv_bias", True)
    if a.has("qk-layernorm"):
        draft.set("model.qk_norm", True)
    hd, ad = a.get("hidden-dropout", 0.1), a.get("attention-dropout", 0.1)
    dropout = hd > 0 or ad > 0
    if a.has("hidden-dropout") or a.has("attention-dropout"):
        draft.set("model.dropout", dropout)
    else:
        draft.default("model.dropout", True, f"--hidden-dropout and --attention-dropout default 0.1 ({era})")
    if a.has("num-experts"):
        moe = {"num_experts": a.get("num-experts"), "top_k": a.get("moe-router-topk", 2),
               "expert_ffn_hidden_size": a.get("moe-ffn-hidden-size", ffn)}
        if not a.has("moe-router-topk"):
            draft.defaults.append(f"model.moe.top_k: 2 — --moe-router-topk default ({ARGS})")
        if not a.has("moe-ffn-hidden-size"):
            draft.defaults.append(f"model.moe.expert_ffn_hidden_size: {ffn} — --moe-ffn-hidden-size defaults to "
                                  f"ffn_hidden_size ({VALIDATE})")
        if a.has("moe-layer-freq"):
            moe["moe_layer_interval"] = a.get("moe-layer-freq")
        if a.has("moe-shared-expert-intermediate-size"):
            moe["num_shared_experts"] = 1
            moe["shared_expert_ffn_hidden_size"] = a.get("moe-shared-expert-intermediate-size")
        draft.set("model.moe", moe)


def _training(draft: Draft, a: _Args, dp: int, era: str, old: list[str]) -> None:
    mbs = a.get("micro-batch-size", None)
    if mbs is None:
        raise ScenarioError(f"{a.source}: --micro-batch-size is required (no default in {era})")
    if a.has("global-batch-size"):
        draft.set("training.global_batch_size", a.get("global-batch-size"))
    else:
        draft.default("training.global_batch_size", mbs * dp, f"micro-batch-size x data-parallel size {dp} ({VALIDATE})")
    draft.set("training.micro_batch_size", mbs)
    if a.has("fp8-format"):
        fmt = a.get("fp8-format")
        if fmt not in ("e4m3", "hybrid"):
            raise ScenarioError(f"--fp8-format: {fmt!r} is not modelled (e4m3 or hybrid)")
        draft.set("training.precision", "fp8")
        if a.has("fp8-recipe"):  # tensorwise | delayed | mxfp8 | blockwise (megatron/training/arguments.py)
            recipe, known = a.get("fp8-recipe"), [r for r in FP8_RECIPES if r != "fused"]  # fused: no TE recipe
            if recipe not in known:
                raise ScenarioError(f"--fp8-recipe: {recipe!r} is not modelled ({', '.join(known)})")
            draft.set("training.fp8_recipe", recipe)
    elif a.has("fp8-recipe"):
        raise ScenarioError("--fp8-recipe: given without --fp8-format (the run is not fp8)")
    elif a.has("bf16"):
        draft.set("training.precision", "bf16")
    elif a.has("fp16"):
        draft.set("training.precision", "fp16")
    else:
        draft.default("training.precision", "fp32", f"neither --bf16 nor --fp16: params_dtype float ({VALIDATE})")
    if a.has("fp16") and not a.has("accumulate-allreduce-grads-in-fp32"):
        draft.default("training.grad_dtype", "bf16", "--fp16 without --accumulate-allreduce-grads-in-fp32: gradients "
                      f"accumulated and all-reduced in fp16 ({era}::validate_args); hzpsim's 2-byte grad_dtype is spelt bf16")
    _recompute(draft, a, era)
    flash = a.has("use-flash-attn") or (not old and a.get("transformer-impl", "transformer_engine") == "transformer_engine")
    if a.has("use-flash-attn"):
        draft.set("training.flash_attention", True)
    elif old:
        draft.default("training.flash_attention", False, "2021 Megatron-LM has no flash attention: fused softmax over "
                      "the materialised scores (megatron/model/fused_softmax.py)")
    elif flash:
        draft.default("training.flash_attention", True, f"--transformer-impl default transformer_engine: TE's fused "
                      f"attention ({ARGS})", write=False)
    else:
        draft.default("training.flash_attention", False, "--transformer-impl local without --use-flash-attn: "
                      "unfused core attention (megatron/core/transformer/dot_product_attention.py)")
    unfused = [k for k in ("no-bias-gelu-fusion", "no-bias-dropout-fusion", "no-bias-swiglu-fusion") if a.has(k)]
    if unfused:
        draft.notes.append(f"{', '.join('--' + k for k in unfused)}: fused_kernels left false")
    else:
        draft.default("training.fused_kernels", True, "bias-GeLU/SwiGLU and bias-dropout-add fusions on by default "
                      f"({era}: --no-bias-gelu-fusion / --no-bias-dropout-fusion turn them off)")


def _recompute(draft: Draft, a: _Args, era: str) -> None:
    method = a.get("recompute-method", None) or a.get("activations-checkpoint-method", None)
    granularity = a.get("recompute-granularity", None)
    if a.has("activations-checkpoint-method") or a.has("checkpoint-activations"):
        granularity = "full"  # 2021: the method alone switches full-layer checkpointing on
        method = method or "uniform"
    if a.has("recompute-activations"):
        granularity = "selective"
    if granularity is None:
        draft.default("training.activation_recompute", "none", f"no --recompute-granularity ({era})", write=False)
        return
    if granularity == "selective":
        draft.set("training.activation_recompute", "selective")
        modules = a.get("recompute-modules", None)
        if modules:  # TransformerConfig.recompute_modules (its default ["core_attn"] is hzpsim's)
            draft.set("training.recompute_modules", modules.replace(",", " ").split())
        return
    if granularity != "full":
        raise ScenarioError(f"--recompute-granularity: {granularity!r} (full or selective)")
    layers = a.get("recompute-num-layers", None) or a.get("activations-checkpoint-num-layers", 1)
    if method == "block":
        raise ScenarioError(f"--recompute-method block (recompute only the first {layers} layers of each stage): "
                            "partial recompute is not modelled")
    if method not in (None, "uniform"):
        raise ScenarioError(f"--recompute-method: {method!r} (uniform or block)")
    draft.set("training.activation_recompute", "full")
    if layers != 1:
        draft.notes.append(f"recompute-num-layers {layers}: checkpoints every {layers} layers; modelled as full "
                           "recompute of every layer (the same recompute work, fewer stored inputs)")


def _moe_strategy(draft: Draft, a: _Args) -> None:
    """The MoE layer's settings (docs/moe.md): the token dispatcher (``flex`` with DeepEP or
    HybridEP is ``deepep``; unset, Megatron-Core's default ``allgather`` comes with the profile),
    the EP overlap, the grouped GEMM, a capacity factor."""
    if a.has("moe-token-dispatcher-type"):
        kind = a.get("moe-token-dispatcher-type")
        dispatchers = {"alltoall": "alltoall", "allgather": "allgather", "flex": "deepep"}
        if kind not in dispatchers:
            raise ScenarioError(f"--moe-token-dispatcher-type {kind}: not one of {', '.join(dispatchers)}")
        draft.set("strategy.moe_dispatcher", dispatchers[kind])
    elif a.has("moe-enable-deepep"):
        draft.set("strategy.moe_dispatcher", "deepep")
    if a.has("overlap-moe-expert-parallel-comm"):
        draft.set("strategy.moe_ep_overlap", True)
    if a.has("moe-grouped-gemm"):
        draft.set("strategy.moe_grouped_gemm", True)
    if a.has("moe-permute-fusion"):
        draft.set("strategy.moe_permute_fusion", True)
    if a.has("moe-expert-capacity-factor"):
        draft.set("strategy.moe_capacity_factor", a.get("moe-expert-capacity-factor"))
    if a.has("moe-pad-expert-input-to-capacity"):
        draft.set("strategy.moe_pad_to_capacity", True)


def _strategy(draft: Draft, a: _Args, tp: int, pp: int, cp: int, ep: int, era: str) -> None:
    draft.set("strategy.tp", tp)
    draft.set("strategy.pp", pp)
    if cp != 1:
        draft.set("strategy.cp", cp)
    if ep != 1:
        draft.set("strategy.ep", ep)
    if a.has("expert-tensor-parallel-size"):
        draft.set("strategy.etp", a.get("expert-tensor-parallel-size"))
    layers = a.get("num-layers")
    if a.has("num-layers-per-virtual-pipeline-stage"):
        per = a.get("num-layers-per-virtual-pipeline-stage")
        if per < 1 or layers % pp or (layers // pp) % per:
            raise ScenarioError(f"--num-layers-per-virtual-pipeline-stage {per}: does not divide the {layers // pp} "
                                f"layers of each of the {pp} pipeline stages")
        draft.set("strategy.vpp", layers // pp // per)
    elif a.has("virtual-pipeline-model-parallel-size"):
        draft.set("strategy.vpp", a.get("virtual-pipeline-model-parallel-size"))
    for arg, key in (("decoder-first-pipeline-num-layers", "first_stage_layers"),
                     ("decoder-last-pipeline-num-layers", "last_stage_layers")):
        if a.has(arg):
            draft.set(f"strategy.{key}", a.get(arg))
    _moe_strategy(draft, a)
    if a.has("sequence-parallel"):
        draft.set("strategy.sequence_parallel", True)
    if a.has("use-distributed-optimizer"):
        draft.set("strategy.zero_stage", 1)
    else:
        draft.default("strategy.zero_stage", 0, f"no --use-distributed-optimizer: replicated optimizer ({era})", write=False)
    for arg, key in (("overlap-grad-reduce", "overlap_grad_reduce"), ("overlap-param-gather", "overlap_param_gather")):
        if a.has(arg):
            draft.set(f"strategy.{key}", True)
        elif era == ARGS:
            draft.default(f"strategy.{key}", False, f"--{arg} is off unless given ({ARGS})")
        else:
            draft.default(f"strategy.{key}", False, "2021 Megatron-LM has no such option: gradients are all-reduced "
                          "after the backward (megatron/model/distributed.py::DistributedDataParallel.allreduce_gradients)")
    if a.has("tp-comm-overlap") and tp > 1:
        draft.set("strategy.tp_comm_overlap", round((tp - 1) / tp, 6))
        draft.notes.append(f"--tp-comm-overlap: {tp - 1} of {tp} TP chunks' transfers hidden behind the GEMMs "
                           "(Transformer Engine userbuffers)")
    else:
        draft.default("strategy.tp_comm_overlap", 0.0, f"no --tp-comm-overlap ({ARGS})", write=False)
    if a.has("ddp-impl") and a.get("ddp-impl") != "local":
        draft.notes.append(f"--DDP-impl {a.get('ddp-impl')}: PyTorch DDP is not distinguished from the local DDP "
                           "by the megatron-2021 profile")
