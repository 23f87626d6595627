"""Implementation profiles: how a real framework executes a strategy, as data.

A strategy (ZeRO-3, HSDP, Megatron ND, ...) says *what* is sharded where; an implementation
says *how the code people run issues it*: how many collective calls a unit's parameters and
gradients take, whether the recompute forward gathers again, whether collectives are list-form
(host work and device copies per rank of the group), where the CPU waits for the GPU, and what
the host thread pays to launch each kernel and collective. Every strategy of the ZeRO family
and ``nd`` has an ``implementation`` field naming one of :data:`IMPLEMENTATIONS`.

Each profile cites the code it follows (read at the tag or commit given; the full reading notes
are in ``docs/implementations.md``). ``ideal`` is the idealised model hzpsim used before
profiles existed: one flat collective per unit, no host thread, kept for comparison.

Host costs are priors with sources (``docs/hardware-constants.md`` §7); the calibration fits
them. They are charged on a ``host`` stream per simulated rank (``hzpsim.model.ops``): a device op
cannot start before the host op that launches it, and a synchronisation is a host op that
waits for device ops.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:
    from hzpsim.hardware.devices import Device
    from hzpsim.model.training import Training

Granularity = Literal["unit", "tensor", "bucket"]

# -- host-cost priors (docs/hardware-constants.md §7) -------------------------------------------
#: Host time to dispatch one eager PyTorch kernel (Python + ATen dispatch + cudaLaunchKernel):
#: eager PyTorch tops out near 280,000 ops/s on tiny tensors, ~3.5 us per op (H. He, "Making
#: Deep Learning Go Brrrr", 2022). Plausible range 2-10 us. Not fitted: no published row's
#: step moves with its host thread (``hzpsim calibrate`` reports each row's host elasticity).
KERNEL_LAUNCH_S = 3.5e-6
#: Host time of one flat collective call through c10d (Python, ProcessGroupNCCL, NCCL enqueue):
#: ~10 us on the fast path, ~45 us on the old coalescing path (pytorch PR #98793).
COLLECTIVE_CALL_S = 10e-6
COLLECTIVE_CALL_2021_S = 45e-6
#: Host time of one view op dispatched from Python (``Tensor.narrow``: binding, ATen dispatch, a
#: new TensorImpl, no kernel), measured: 2.1 us (``benchmarks/bench_host_ops.py``, torch 2.13,
#: Python 3.11, the 2-core development VM; least of 5 x 200,000 calls, three runs 2.08-2.22 us).
PYTHON_VIEW_S = 2.1e-6
#: Host time of one ``select`` called from C++, at most what the same op costs called from
#: Python (``v[j]``), measured the same way: 1.2 us (three runs 1.21-1.24 us).
CPP_VIEW_S = 1.2e-6
#: Host time per rank of the group for a list-form collective, derived from the code that runs
#: per rank: DeepSpeed v0.3.16-v0.5.4 build the output list with one Python ``narrow`` per rank
#: (``partition_parameters.py::Init._allgather_param``); ProcessGroupNCCL flattens the list
#: into one buffer and, per chunk, indexes it from C++ (``outputFlattened[i][j]``), records the
#: stream and launches one ``copy_`` back (``ProcessGroupNCCL::allgather``'s post hook in the
#: versions read, 1.6-era and 2.x; ``reduce_scatter`` copies the chunks in before the call).
#: So one Python view, one C++ view and one launched copy per rank: 2.1 + 1.2 + 3.5
#: (``KERNEL_LAUNCH_S``) = 6.8 us. Not counted: ``recordStream`` (a lock and a set insert in
#: the caching allocator). With the launch measured on the H200 machine's host (6.4 us,
#: docs/hardware-constants.md §7) it would be 9.7 us. DeepSpeed #1069's ~380 us per
#: per-parameter gather at N = 8 is then mostly fixed cost (``_allgather_param`` calls
#: ``torch.cuda.synchronize()`` before every gather: ``sync_before_gather``). Not fitted;
#: DeepSpeed-2021's predictions move strongly with it (docs/validation.md §9 and §17).
LIST_FORM_PER_RANK_S = PYTHON_VIEW_S + CPP_VIEW_S + KERNEL_LAUNCH_S
FP32_BYTES = 4.0


@dataclass(frozen=True, kw_only=True)
class Implementation:
    """How one framework issues a sharded data-parallel strategy."""

    name: str
    source: str
    """The framework code this profile follows (repo@tag:path::function)."""
    gather: Granularity = "unit"
    """Parameter all-gather calls: one per unit (FlatParameter / FSDP2 param group), one per
    parameter tensor at least ``persistence_elements`` large, or one per bucket of at least
    ``gather_bucket_elements``."""
    gather_bucket_elements: float = 0.0
    persistence_elements: float = 0.0
    """Tensors smaller than this stay gathered for the whole step (DeepSpeed
    ``stage3_param_persistence_threshold``); 0 = none."""
    regather_for_recompute: bool = False
    """The recompute forward fires the gather hooks again (DeepSpeed) instead of the
    pre-backward gather serving it (FSDP1/FSDP2)."""
    max_reuse_elements: float = math.inf
    """With ``regather_for_recompute``: the backward re-gathers a tensor only if more than
    this many parameter elements are visited between its recompute and its backward
    (DeepSpeed ``stage3_max_reuse_distance``); inf = always re-gather."""
    reduce: Granularity = "unit"
    """Gradient reduce-scatter calls: per unit, per tensor, or per bucket of at least
    ``reduce_bucket_elements``."""
    reduce_bucket_elements: float = 0.0
    list_form: bool = False
    """Collectives take/return a list of N tensors: host work and a device copy per rank."""
    sync_before_gather: bool = False
    """The host waits for the device (``torch.cuda.synchronize()``) before each gather, so a
    gather never overlaps compute that came before it."""
    sync_after_reduce: bool = False
    """The host waits for each gradient reduction before launching more work."""
    sync_after_p2p: bool = False
    """Each pipeline send and receive is one host call followed by ``torch.cuda.synchronize()``
    (Megatron 2021's ``_communicate``): the host launches nothing more until it completed."""
    copy_bytes_per_gathered_byte: float = 0.0
    """Device copies around a gather (FSDP2 copy-in of the shard and copy-out of the unit)."""
    gather_copy_out: bool = False
    """Where a gathered unit lives (with per-use gather buffers). True (FSDP2): the all-gather
    writes one flat output, allocated on the all-gather stream
    (``torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py::foreach_all_gather``); the
    compute stream then copies it out into the per-parameter unsharded tensors
    (``_fsdp_param_group.py::FSDPParamGroup.wait_for_unshard`` ->
    ``_fsdp_collectives.py::foreach_all_gather_copy_out``, whose storage
    ``_fsdp_param.py::FSDPParam.init_all_gather_outputs`` / ``alloc_storage`` allocates on the
    current stream) and the flat output is freed. So the unsharded parameters (category
    ``params``) sit in the compute stream's pool until the reshard, and the flat buffer in the
    gather stream's pool only from the gather to the copy-out, both alive during the copy.
    False (DeepSpeed ZeRO-3, FSDP1, ...): the all-gather writes straight into the parameters'
    storage (``partition_parameters.py::_allgather_params_coalesced``; FSDP1's FlatParameter),
    one block on the gather stream until the compute that used it ends."""
    reduce_output_on_reduce_stream: bool = False
    """Each per-micro-batch gradient reduce-scatter allocates its output (the sharded gradient
    of the micro-batch, ``grad_element_bytes`` per sharded parameter) on the reduce-scatter
    stream and frees it once it is accumulated (FSDP2 ``_fsdp_collectives.py::foreach_reduce``:
    ``reduce_output`` allocated under the reduce-scatter stream, its input on the compute
    stream). Modelled as a transient held while the reduce-scatter runs: the first micro-batch's
    output, which FSDP2 keeps as ``.grad`` until ``zero_grad``, is not moved off the resident
    gradients (kept on the compute stream here)."""
    max_prefetch_depth: int = 8
    """Gathers the framework keeps in flight ahead of use, at most (caps ``prefetch_depth``)."""
    grad_reduce_overlap: bool | None = None
    """Gradient reduction overlaps the backward (None: the strategy's own flag)."""
    whole_buffer_step_reduce: bool = False
    """The step-end data-parallel reduction is one all-reduce of the whole gradient buffer
    (Megatron 2021's ``allreduce_gradients``), not one per unit or bucket."""
    collective_call_s: float = COLLECTIVE_CALL_S
    kernel_launch_s: float = KERNEL_LAUNCH_S
    host: bool = True
    """Model the host thread at all (False: ``ideal``)."""
    master_weights: bool = True
    """Model states per parameter. True: the optimizer keeps fp32 master weights beside the
    working copy (DeepSpeed, Megatron's distributed optimizer): the working parameter and the
    gradient in their training dtypes, 12 B of optimizer state (master + Adam's two moments).
    False (FSDP1, FSDP2, DTensor): the resident parameter keeps its original fp32 dtype and IS the
    optimizer's master, mixed precision only casts what is gathered, and the reduced gradient
    is cast back to that dtype; so 4 B of parameter, 4 B of gradient and 8 B of Adam moments
    (:meth:`state_bytes_per_param`)."""
    calls_from_comm_threads: bool = False
    """Collectives are issued by background communication threads (one per stream), so the
    host cost of a call is paid on that stream, not on the thread that launches the kernels
    (hzpsim's AsyncHZP executor); False: the training thread issues them (FSDP2, DDP, ...)."""
    synchronous: bool = False
    """Kernels run on the thread that launches them (a CPU device): a launch waits for the
    previous kernel, so host time and kernel time add up (set by :meth:`on_device`)."""
    blocking_calls: bool = False
    """The training thread issues its collectives with ``async_op=False`` and leaves the overlap
    to device streams (FSDP2: ``_fsdp_param_group.py::FSDPParamGroup.unshard(self.unshard_async_op)``
    with ``unshard_async_op = False`` by default, also for the backward prefetch;
    ``_fsdp_collectives.py::foreach_reduce``'s reduce-scatter and HSDP all-reduce without
    ``async_op``). On a GPU that returns at once; on a synchronous device (gloo on a CPU)
    ``distributed_c10d.py`` waits on the call's ``Work`` in the calling thread, so each call
    holds the thread until it completed (:attr:`waits_in_calls`). FSDP1 does the same
    (``_flat_param.py::FlatParamHandle._all_gather_flat_param``, ``_runtime_utils.py::_reduce_grad``);
    The other profiles are not marked: their calls on a CPU were not read or measured here."""
    framework_host: str = ""
    """Which measured framework host cost applies (``hzpsim calibrate machine`` measures them on
    the device and its device file keeps them under ``host.frameworks.<this key>``: ``call_s`` is
    added to every collective call, ``op_s`` replaces ``kernel_launch_s``; an uncalibrated device
    has none, so nothing changes): ``"fsdp2"`` adds the device's measured ``call_s`` to every collective call (FSDP2's Python around each unit's
    all-gather and reduce-scatter: ``_fsdp_state.py::FSDPState._pre_forward`` /
    ``_post_forward``, ``_fsdp_param_group.py::FSDPParamGroup.pre_backward`` /
    ``post_backward``, ``_fsdp_collectives.py::foreach_all_gather`` /
    ``foreach_all_gather_copy_out`` / ``foreach_reduce``); ``"dtensor"`` charges every
    dispatched op the device's measured ``op_s`` instead of ``kernel_launch_s``
    (``torch/distributed/tensor/_dispatch.py::OpDispatcher.dispatch``: sharding propagation
    and redistribution in Python before each local op, and ``parallel/style.py``'s module
    hooks; the executor's ND runs DTensor TP); ``"hzpsim-executor"`` charges every op the device's
    measured ``op_s`` (hzpsim's own AsyncHZP executor: ``executor/asynchzp.py``'s
    saved-tensor hooks, buffer-ring copies and the Python of its ag / rs / dp threads, which
    share the GIL and the core with the training thread)."""
    framework_call_s: float = 0.0
    """Host time of the framework's Python per collective call (set by :meth:`on_device`)."""
    loss: Literal["eager-fp32", "vocab-parallel", "fused", "loss-parallel"] = "eager-fp32"
    """How the cross-entropy loss runs, which sets the eager temporaries around the logits
    (:func:`loss_bytes_per_logit`). ``eager-fp32``: ``F.cross_entropy(logits.float(), labels)``
    (torchtitan ``components/loss.py::cross_entropy_loss``, Hugging Face
    ``loss/loss_utils.py::ForCausalLMLoss``, hzpsim's executor ``executor/common.py::cross_entropy``):
    an fp32 copy of the logits, the fp32 log-softmax saved for the backward, and in the backward
    ``nll_loss_backward``'s dense fp32 gradient beside ``_log_softmax_backward_data``'s.
    ``vocab-parallel``: Megatron's ``tensor_parallel/cross_entropy.py::_VocabParallelCrossEntropy``
    (``VocabParallelCrossEntropy.calculate_logits_max`` casts to fp32, then subtract, exp and
    divide in place, so the fp32 copy becomes the saved softmax; the backward turns that saved
    softmax into the gradient in place). ``fused``: flash-attn's Triton cross-entropy
    (``flash_attn/losses/cross_entropy.py::CrossEntropyLoss``, LLM Foundry's default loss), which
    reads the logits in their own dtype, saves them (and an fp32 log-sum-exp per row) and writes
    the gradient into a new tensor of the logits' dtype. ``loss-parallel``: DTensor's
    ``loss_parallel()`` over vocabulary-sharded logits (see :attr:`tp_loss`)."""
    tp_loss: Literal["", "eager-fp32", "vocab-parallel", "fused", "loss-parallel"] = ""
    """The loss under tensor parallelism (tp > 1), when it differs from :attr:`loss`.
    ``loss-parallel``: torchtitan keeps the logits sharded over the vocabulary and runs
    ``F.cross_entropy`` inside ``torch.distributed.tensor.parallel.loss_parallel()`` (its
    default with TP: ``parallelize.py::apply_tp``, ``use_local_output=not loss_parallel``), whose
    ``tensor/parallel/loss.py::_log_softmax`` and ``_nll_loss_and_log_softmax_backward`` compose
    the softmax from eager ops (:func:`loss_bytes_per_logit`)."""
    gather_after_loss: bool = False
    """The backward's first gather is issued by its unit's pre-backward hook, which runs only
    after autograd went through the loss (FSDP1 ``_runtime_utils.py::_pre_backward_hook``,
    FSDP2 ``_fsdp_state.py::FSDPState._pre_backward``: hooks on the unit's outputs); False: a
    prefetch may issue it while the loss still runs (DeepSpeed's trace-based prefetch, a fixed
    ring)."""
    tp_replicated_embedding_grad: bool = False
    """Tensor parallelism: the vocabulary-sharded embedding's backward returns a gradient of the
    whole table on every TP rank (DTensor ``RowwiseParallel`` on ``nn.Embedding``:
    ``torch/distributed/tensor/_ops/_embedding_ops.py``'s backward strategy leaves
    ``embedding_dense_backward`` replicated; hzpsim's executor keeps its rows only at the step
    end, ``executor/nd.py::NDTrainer._reduce_partial_tensor_parallel``), instead of Megatron's
    ``VocabParallelEmbedding`` gradient of its own rows."""
    rope_form: str = "rotate_half"
    """How the model code rotates Q and K where no fused RoPE kernel runs
    (``activations.rope_bytes_per_element``): ``rotate_half`` (Hugging Face's
    ``apply_rotary_pos_emb``, Megatron-LM's unfused path, hzpsim's executor) or ``complex``
    (torchtitan's ``apply_rotary_emb``: a complex product in fp32)."""
    sp_saves_gathered_inputs: bool = False
    """Sequence parallelism with DTensor (``parallel/style.py``: ``PrepareModuleInput`` gathers
    the sequence shards, ``ColwiseParallel``'s linears save that gathered input for their weight
    gradient): the QKV and MLP inputs are kept whole on every TP rank; Megatron keeps the shard
    and gathers it again in the backward (Korthikanti et al. §4.2.2)."""
    logits_held_through_backward: bool = False
    """The training loop keeps a reference to the logits until the backward is done (hzpsim's
    AsyncHZP executor: ``executor/asynchzp.py::_StepRun.micro_batch`` holds them in ``h``), so
    they are not a forward temporary of the loss but live through the head's backward."""
    optimizer_temp_bytes_per_param: float = 0.0
    """Bytes per parameter of the optimizer shard that the optimizer step allocates for itself
    while it runs. 0: a fused Adam (DeepSpeed's and Megatron's ``FusedAdam``, torchtitan's
    default ``implementation = "fused"``, ``config/job_config.py::Optimizer``): one kernel over
    the parameters, no tensor per parameter. 4: ``torch.optim.Adam(W)`` with ``foreach`` (its
    default on GPUs, ``torch/optim/optimizer.py::_default_to_fused_or_foreach``; the executor
    sets it): ``adam.py::_multi_tensor_adam``'s ``torch._foreach_sqrt(exp_avg_sqs)`` makes one
    fp32 denominator per parameter (measured by ``executor/memtrack.py``: exactly one shard's
    worth)."""
    eager_model_code: bool = True
    """The model code is eager PyTorch (torchtitan's and Hugging Face's Llama, hzpsim's
    executor): autograd keeps what each eager op saves (``model/activations.py``, ``eager``)
    unless ``training.compile`` or ``training.fused_kernels`` fuses the pointwise kernels. False:
    Megatron's fused modules (Transformer Engine's norm + linear, fused bias-SwiGLU, flash
    attention with native GQA), which keep Korthikanti et al.'s set."""
    attention_kernel_on: tuple[tuple[str, str], ...] = ()
    """The fused attention kernel the framework picks on a device family (the device file's
    ``efficiency.gemm_constant``, else its ``name``) when ``training.attention_kernel`` is
    ``auto``: Megatron-Core through Transformer Engine runs cuDNN's fused attention on Hopper
    and Blackwell (TE >= 1.7,
    ``transformer_engine/pytorch/attention/dot_product_attention/utils.py::get_attention_backend``:
    FusedAttention preferred over FlashAttention when ``device_compute_capability >= (9, 0)``,
    "on Hopper+ for performance reasons"; B200 and GB200 are sm100)."""
    pp_keeps_unsharded: bool = False
    """Pipeline parallelism (pp > 1) over sharded parameters: each unit is gathered once per step
    and kept gathered, and its gradient accumulates unsharded, in the reduce dtype, over the
    micro-batches; one reduce-scatter per unit after the stage's last backward (torchtitan's
    ``models/llama3/infra/parallelize.py::apply_fsdp``: ``reshard_after_forward = not pp_enabled``
    by default; ``torch/distributed/pipelining/stage.py::_PipelineStageBase.backward_maybe_with_nosync``
    sets ``set_requires_gradient_sync(False)`` and ``set_reshard_after_backward(False)`` for every
    micro-batch, ``perform_reduce_grad`` runs every group's ``post_backward`` after the last;
    FSDP2's ``_fsdp_param.py::FSDPParam.to_accumulated_grad_if_needed`` /
    ``accumulate_unsharded_grad_if_needed`` keep the accumulated gradient in ``reduce_dtype``).
    False: every micro-batch gathers again and reduce-scatters its own gradient."""
    wgrad_accumulation_fusion: bool = False
    """Each weight-gradient GEMM adds into the fp32 ``main_grad`` in its epilogue, reading and
    writing it at 4 bytes per element every micro-batch (``kernels.Gemm.accumulate``):
    Megatron-LM's ``gradient_accumulation_fusion``, on unless ``--no-gradient-accumulation-fusion``
    (``megatron/training/arguments.py``@d98e8a64; since 2022-02, commit 83b1e42f), passed to TE's
    ``Linear`` / ``GroupedLinear`` as ``fuse_wgrad_accumulation``
    (``megatron/core/extensions/transformer_engine.py``, ``TEGroupedLinear``); Megatron-Bridge
    turns it on wherever Transformer Engine imports (``utils/fusions.py::
    can_enable_gradient_accumulation_fusion``@067f987d). Where K (the tokens) is small against
    the weight, the experts of a fine-grained MoE, that traffic sets the GEMM's time. False: the
    weight gradient is written at the operands' width (the frameworks that accumulate
    elsewhere, or reduce every micro-batch)."""
    fp8_recipe: Literal["fused", "delayed", "tensorwise", "mxfp8", "blockwise"] = "fused"
    """How an fp8 run (``training.precision: fp8``) scales and casts its GEMM operands unless
    ``training.fp8_recipe`` says (``_layers.FP8_QUANTIZE_BYTES``: the standalone quantisation
    kernels each recipe runs). Megatron-Core defaults to Transformer Engine's delayed scaling
    (``megatron/core/transformer/transformer_config.py::TransformerConfig.fp8_recipe``@d98e8a64:
    ``"delayed"``), Megatron-Bridge to per-tensor current scaling
    (``src/megatron/bridge/training/mixed_precision.py::MixedPrecisionConfig.fp8_recipe``@v0.4.2:
    ``"tensorwise"``). ``fused``: the casts ride in their producing kernels, as torch.compile
    fuses torchao's float8 casts (torchtitan) — the frameworks without Transformer Engine."""
    tp_gathers_logits: bool = False
    """Tensor parallelism: the head's vocabulary-sharded logits are all-gathered to every TP
    rank before the loss (DTensor's ``ColwiseParallel(output_layouts=Replicate())``, torchtitan
    without loss parallelism), instead of a vocabulary-parallel cross-entropy."""
    moe_dispatcher: Literal["alltoall", "allgather", "deepep"] = "alltoall"
    """How an MoE layer moves tokens to their experts unless ``strategy.moe_dispatcher`` says
    (``_model_parallel``: the dispatchers): Megatron-Core's own default is ``allgather``
    (``megatron/core/transformer/transformer_config.py``: ``moe_token_dispatcher_type =
    "allgather"``); torchtitan, DeepSpeed-MoE and the NeMo recipes exchange with all-to-all."""
    distributed_optimizer: bool = False
    """An ND run whose ``zero_stage`` is not given shards its optimizer states over the
    data-parallel group (``zero_stage`` 1). Megatron-LM needs the flag: ``--use-distributed-optimizer``
    is ``action='store_true'`` (megatron/training/arguments.py@d98e8a64) and
    ``DistributedDataParallelConfig.use_distributed_optimizer`` defaults to False
    (megatron/core/distributed/distributed_data_parallel_config.py); NeMo's Megatron-Bridge
    recipes turn it on (src/megatron/bridge/recipes/common.py@067f987d::_pretrain_common:
    ``DistributedDataParallelConfig(..., use_distributed_optimizer=True)``)."""
    expert_tp_is_tp: bool = False
    """An ND run whose ``etp`` is not given shards each expert over the tensor-parallel size
    (``etp`` = ``tp``): Megatron-Core's own default (``megatron/core/model_parallel_config.py::
    ModelParallelConfig.__post_init__``@d98e8a64: ``if self.expert_tensor_parallel_size is None:
    self.expert_tensor_parallel_size = self.tensor_model_parallel_size``; Megatron-LM's
    ``--expert-tensor-parallel-size`` has no default of its own). False: ``etp`` 1, what the
    NeMo / Megatron-Bridge MoE recipes set (``src/megatron/bridge/recipes/{deepseek,qwen,gpt_oss,
    kimi,glm,...}/h100/*.py``@067f987d: ``cfg.model.expert_tensor_parallel_size = 1``) and what
    frameworks without expert tensor parallelism run (torchtitan, DeepSpeed-MoE)."""
    moe_grouped_gemm: bool = True
    """An MoE layer's local experts run as one grouped GEMM per linear (Megatron-Core
    ``experts.py::TEGroupedMLP`` / ``GroupedMLP``, torchtitan ``torch._grouped_mm``). False: one
    GEMM per local expert (Megatron-Core's ``SequentialMLP``, its default:
    ``moe_grouped_gemm = False``), whose tiles do not share the waves and whose launches add up."""
    moe_permute_fusion: bool = True
    """An MoE layer's token permutation and un-permutation run as fused kernels that move each
    byte once (Transformer Engine's ``moe_permute`` / ``moe_unpermute``, Megatron-Core
    ``--moe-permute-fusion``). False: the eager sequences, Megatron-Core's default
    (``transformer_config.py``: ``moe_permute_fusion: bool = False``; ``moe_utils.py::permute``:
    argsort + ``index_select``; ``unpermute``: probability product, ``torch.zeros`` and an atomic
    ``scatter_add_``) and torchtitan's (``torchtitan/models/moe/moe.py``: ``torch.gather``,
    ``zeros_like`` + ``scatter_add``), timed on an H200 (``_moe.UNFUSED_PERMUTE``)."""

    def expert_tp(self, tp: int) -> int:
        """The experts' tensor-parallel size of an ND run of ``tp`` that does not give one
        (:attr:`expert_tp_is_tp`)."""
        return tp if self.expert_tp_is_tp else 1

    # -- counts -------------------------------------------------------------------------------

    def gathered(self, tensors: Sequence[float]) -> list[float]:
        """The tensors a pass gathers (persistent ones stay resident)."""
        return [t for t in tensors if t >= self.persistence_elements and t > 0]

    def gather_calls(self, tensors: Sequence[float]) -> int:
        """Collective calls to gather one pass of a unit holding ``tensors`` (elements each)."""
        gathered = self.gathered(tensors)
        if not gathered:
            return 0
        if self.gather == "tensor":
            return len(gathered)
        if self.gather == "bucket":
            return buckets(gathered, self.gather_bucket_elements)
        return 1

    def backward_gathered(self, tensors: Sequence[float], recompute: bool) -> list[float]:
        """Tensors gathered again for the backward after the recompute forward gathered them:
        those visited more than ``max_reuse_elements`` elements before their backward (the
        recompute runs the unit forward, then the backward walks it in reverse, so tensor j's
        distance is twice the elements of the tensors after it)."""
        gathered = self.gathered(tensors)
        if not (recompute and self.regather_for_recompute):
            return gathered
        return [t for j, t in enumerate(gathered) if 2 * sum(gathered[j + 1:]) >= self.max_reuse_elements]

    def reduce_calls(self, tensors: Sequence[float]) -> int:
        """Collective calls to reduce one unit's gradients."""
        present = [t for t in tensors if t > 0]
        if not present:
            return 0
        if self.reduce == "tensor":
            return len(present)
        if self.reduce == "bucket":
            return buckets(present[::-1], self.reduce_bucket_elements)  # gradients arrive in reverse
        return 1

    @property
    def waits_in_calls(self) -> bool:
        """The thread that issues a collective waits in it until it completed (see
        :attr:`blocking_calls`; never for calls made by communication threads)."""
        return self.host and self.synchronous and self.blocking_calls and not self.calls_from_comm_threads

    def call_host_s(self, calls: int, group_size: int) -> float:
        """Host time to issue ``calls`` collective calls over ``group_size`` ranks."""
        if not self.host or calls == 0:
            return 0.0
        per_call = self.collective_call_s + self.framework_call_s + (
            LIST_FORM_PER_RANK_S * group_size if self.list_form else 0.0)
        return calls * per_call

    def state_bytes_per_param(self, param_element_bytes: float, grad_element_bytes: float) -> dict[str, float]:
        """Resident bytes per parameter of the working copy, the gradient and the optimizer
        (before sharding) for a run whose working and gradient dtypes have these sizes."""
        if self.master_weights:
            return {"params": param_element_bytes, "grads": grad_element_bytes, "optimizer": 12.0}
        # torch/distributed/fsdp/_fully_shard/_fsdp_param.py::FSDPParam.init_dtype_attrs
        # (orig_dtype = the sharded parameter's dtype; param_dtype only for the all-gather),
        # _fsdp_collectives.py::foreach_reduce (reduce_output cast back to orig_dtype before it
        # becomes the sharded .grad); torch.optim.Adam: exp_avg and exp_avg_sq in that dtype
        return {"params": FP32_BYTES, "grads": FP32_BYTES, "optimizer": 2 * FP32_BYTES}

    def training_for(self, training: Training, device: Device) -> Training:
        """``training`` as this framework runs it on ``device``: hand-fused model code
        (``eager_model_code`` False: Megatron's fused bias-GeLU/SwiGLU and bias-dropout-add, on
        by default in Megatron-LM's ``arguments.py`` (``--no-bias-gelu-fusion`` etc. turn them
        off), Transformer Engine's fused norms) fuses the pointwise kernels, and an ``auto``
        attention kernel is the one the framework picks on this device
        (:attr:`attention_kernel_on`), and an fp8 run's ``auto`` recipe is :attr:`fp8_recipe`. The same object when nothing changes."""
        changes: dict[str, Any] = {}
        if not self.eager_model_code and not training.fused_kernels:
            changes["fused_kernels"] = True
        if training.fp8_recipe == "auto" and training.precision == "fp8":
            changes["fp8_recipe"] = self.fp8_recipe_for(training)
        if training.attention_kernel == "auto" and training.fused_attention:
            on = dict(self.attention_kernel_on)
            kernel = on.get(device.efficiency.gemm_constant or "") or on.get(device.name)
            if kernel and kernel in device.attention_kernels:
                changes["attention_kernel"] = kernel
        return replace(training, **changes) if changes else training

    def fp8_recipe_for(self, training: Training) -> str:
        """The recipe an fp8 run of ``training`` quantises its GEMM operands with: the
        scenario's, or :attr:`fp8_recipe` for ``auto`` ("fused", no kernels, for a run not in fp8)."""
        if training.precision != "fp8":
            return "fused"
        return self.fp8_recipe if training.fp8_recipe == "auto" else training.fp8_recipe

    def on_device(self, device: Device) -> Implementation:
        """This profile with the host costs measured on ``device`` (``hzpsim calibrate
        machine``): per-kernel and per-call host time and whether kernels run synchronously."""
        if not self.host:
            return self
        kernel_launch_s = device.kernel_launch_s if device.kernel_launch_s is not None else self.kernel_launch_s
        framework_call_s = self.framework_call_s
        if self.framework_host:  # the device file's host.frameworks.<framework_host>
            op_s = device.framework_cost_s(self.framework_host, "op_s")
            call_s = device.framework_cost_s(self.framework_host, "call_s")
            kernel_launch_s = op_s if op_s is not None else kernel_launch_s
            framework_call_s = call_s if call_s is not None else framework_call_s
        return replace(self, kernel_launch_s=kernel_launch_s, framework_call_s=framework_call_s,
                       collective_call_s=device.collective_call_s if device.collective_call_s is not None
                       else self.collective_call_s,
                       synchronous=device.synchronous_host)

    def launch_s(self, kernels: float) -> float:
        """Host time to launch ``kernels`` eager kernels."""
        return kernels * self.kernel_launch_s if self.host else 0.0


def loss_bytes_per_logit(loss: str, act_bytes: float) -> tuple[float, tuple[float, ...], tuple[float, ...]]:
    """(saved, forward temporaries, backward temporaries) in bytes per logit element for a loss
    of kind ``loss`` (:attr:`Implementation.loss`) over logits of ``act_bytes`` bytes; the
    temporaries one entry per tensor (the caching allocator places each on its own). The
    loss's backward then hands the head's GEMM a gradient of ``act_bytes`` per logit.

    - ``eager-fp32``: the forward holds the logits (``act_bytes``, the caller's until the loss
      returns), their fp32 copy (4, none when they are fp32 already: ``.float()`` returns the
      tensor itself) and the log-softmax output (4, saved); the backward holds the saved output,
      ``nll_loss_backward``'s dense fp32 gradient (4) and ``_log_softmax_backward_data``'s
      output (4) at once; the cast back to ``act_bytes`` comes after the first two are freed.
    - ``vocab-parallel``: the forward holds the logits and the fp32 copy that becomes the saved
      softmax; the backward writes the gradient into the saved softmax and autograd casts it to
      the logits' dtype (``act_bytes`` more when that is not fp32).
    - ``fused``: the kernel keeps the logits (``act_bytes``) and writes their gradient into a new
      tensor of that dtype; nothing in fp32 per logit.
    - ``loss-parallel`` (``torch/distributed/tensor/parallel/loss.py``): the forward's
      ``_log_softmax`` holds the logits, their fp32 copy ``x``, ``shifted = x - x_max`` and
      ``torch.exp(shifted)`` at once (then the saved ``result = shifted - logsumexp`` in the
      exponential's place: two fp32 temporaries beside the saved output); the backward's ``_nll_loss_and_log_softmax_backward`` holds the saved
      log-softmax, ``grad_input = zeros_like(x)``, ``torch.exp(x)`` and their sum (then the
      product with ``grad_output`` in the exponential's place): three fp32 tensors beside the
      saved one, where ``eager-fp32``'s native kernels need two.
    """
    fp32 = 4.0
    cast = (act_bytes,) if act_bytes < fp32 else ()
    if loss == "vocab-parallel":
        return fp32, cast, cast
    if loss == "fused":  # the logits themselves are what the kernel keeps; its gradient is new
        return act_bytes, (), (act_bytes,)
    if loss == "loss-parallel":
        return fp32, (act_bytes, *((fp32,) if act_bytes < fp32 else ()), fp32), (fp32, fp32, fp32)
    assert loss == "eager-fp32", loss
    return fp32, (act_bytes, *((fp32,) if act_bytes < fp32 else ())), (fp32, fp32)


def buckets(tensors: Sequence[float], bucket_elements: float) -> int:
    """Buckets that whole tensors fill in order, each closed once it holds ``bucket_elements``
    (DeepSpeed's prefetch batches, Megatron's ``_ParamAndGradBuffer`` bucket layout). A
    trailing partial bucket is not counted on its own: in a real run it fills up with the
    next unit's tensors. At least one."""
    count, filled = 0, 0.0
    for t in tensors:
        filled += t
        if filled >= bucket_elements:
            count, filled = count + 1, 0.0
    return max(count, 1)


_DS = "microsoft/DeepSpeed"
_PT = "pytorch/pytorch"
_MEG = "NVIDIA/Megatron-LM"

#: Transformer Engine's attention backend on Hopper (h100 family: H100, H200) and Blackwell (B200,
#: GB200): cuDNN's fused attention (Implementation.attention_kernel_on)
_TE_FUSED_ATTENTION = (("h100", "cudnn"), ("b200", "cudnn"), ("gb200", "cudnn"))

IMPLEMENTATIONS: dict[str, Implementation] = {
    "ideal": Implementation(
        name="ideal", host=False,
        source="hzpsim's idealised model: one flat collective per unit, no host thread",
    ),
    "deepspeed-2021": Implementation(
        name="deepspeed-2021", gather="tensor", persistence_elements=1e5, regather_for_recompute=True,
        max_reuse_elements=1e9, reduce="tensor", list_form=True, sync_before_gather=True, sync_after_reduce=True,
        max_prefetch_depth=0, copy_bytes_per_gathered_byte=1.0, collective_call_s=COLLECTIVE_CALL_2021_S,
        source=f"{_DS}@v0.5.0:deepspeed/runtime/zero/partition_parameters.py::Init._allgather_param "
               "(per-tensor list-form all_gather after torch.cuda.synchronize()), "
               "stage3.py::PartitionedParameterCoordinator.fetch_sub_module, "
               "partition_parameters.py::Init._reduce_scatter_gradients (per-tensor list-form reduce_scatter), "
               "stage3.py::reduce_ipg_grads (reduction_stream.synchronize())",
    ),
    "deepspeed": Implementation(
        name="deepspeed", gather="bucket", gather_bucket_elements=5e7, persistence_elements=1e5,
        regather_for_recompute=True, max_reuse_elements=1e9, reduce="bucket", reduce_bucket_elements=5e8,
        max_prefetch_depth=2, source=f"{_DS}@38327e07:deepspeed/runtime/zero/partitioned_param_coordinator.py::fetch_sub_module "
               "(coalesced all_gather_into_tensor per prefetch batch of >= stage3_prefetch_bucket_size 5e7), "
               "stage3.py::__reduce_and_partition_ipg_grads (reduce_scatter_tensor per 5e8-element bucket)",
    ),
    "fsdp1": Implementation(
        # the FlatParameter keeps its original (fp32) dtype and is the optimizer's parameter; mixed
        # precision casts a transient shard for the all-gather (_flat_param.py::FlatParamHandle.
        # init_flat_param_attributes: _local_shard, _mp_shard freed by
        # _free_low_precision_sharded_param) and the reduced gradient is cast back to it
        # (_runtime_utils.py::_cast_grad_to_param_dtype): 4 + 4 + 8 B per parameter, as FSDP2
        name="fsdp1", optimizer_temp_bytes_per_param=4.0, max_prefetch_depth=1, blocking_calls=True, gather_after_loss=True, master_weights=False,
        source=f"{_PT}:torch/distributed/fsdp/_runtime_utils.py::_unshard "
               "(one all_gather_into_tensor per FlatParameter; pre-backward unshard serves the "
               "recompute), _post_backward_hook (one reduce_scatter_tensor per FlatParameter); "
               "_flat_param.py::FlatParamHandle._all_gather_flat_param and _runtime_utils.py::_reduce_grad call "
               "all_gather_single / reduce_scatter_single without async_op (streams give the overlap)",
    ),
    "llm-foundry": Implementation(
        name="llm-foundry", optimizer_temp_bytes_per_param=4.0, max_prefetch_depth=1, blocking_calls=True, gather_after_loss=True, loss="fused",
        master_weights=False,
        source="mosaicml/llm-foundry:llmfoundry/models/mpt/modeling_mpt.py::ComposerMPTCausalLM "
               "(loss_fn default 'fused_crossentropy': flash_attn.losses.cross_entropy.CrossEntropyLoss) on "
               "Composer's PyTorch FSDP1 (the fsdp1 profile's collectives and host behaviour)",
    ),
    "fsdp2": Implementation(
        name="fsdp2", rope_form="complex", optimizer_temp_bytes_per_param=4.0, copy_bytes_per_gathered_byte=1.0, max_prefetch_depth=1, master_weights=False, gather_after_loss=True,
        framework_host="fsdp2", blocking_calls=True, gather_copy_out=True, reduce_output_on_reduce_stream=True,
        source=f"{_PT}:torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py::foreach_all_gather, "
               "foreach_all_gather_copy_out (split_with_sizes_copy of the whole unit), foreach_reduce; "
               "_fsdp_state.py::FSDPState._pre_forward (no unshard during the recompute)",
    ),
    "reference": Implementation(
        name="reference", optimizer_temp_bytes_per_param=4.0, calls_from_comm_threads=True, framework_host="hzpsim-executor",
        logits_held_through_backward=True,
        source="hzpsim's own AsyncHZP executor (hzpsim/executor): one flat all_gather_into_tensor and "
               "reduce_scatter_tensor per unit from background threads into pre-allocated buffers",
    ),
    "megatron-2021": Implementation(
        name="megatron-2021", loss="vocab-parallel", eager_model_code=False, collective_call_s=COLLECTIVE_CALL_2021_S, grad_reduce_overlap=False,
        whole_buffer_step_reduce=True, sync_after_p2p=True,
        source=f"{_MEG}@v2.5:megatron/model/distributed.py::DistributedDataParallel.allreduce_gradients "
               "(one all-reduce of the whole fp32 gradient buffer after the backward), "
               "megatron/p2p_communication.py::_communicate (batch_isend_irecv, req.wait(), then "
               "torch.cuda.synchronize() after every pipeline send/receive), "
               "megatron/mpu/mappings.py (TP all-reduces, repeated by the recompute)",
    ),
    "megatron-2021-torch-ddp": Implementation(
        name="megatron-2021-torch-ddp", loss="vocab-parallel", eager_model_code=False,
        collective_call_s=COLLECTIVE_CALL_2021_S, sync_after_p2p=True, reduce="bucket",
        reduce_bucket_elements=25 * 2**20 / 4,
        source=f"{_MEG}@v2.5:megatron/training.py::get_model (--DDP-impl torch: each model chunk "
               "wrapped in torch.nn.parallel.DistributedDataParallel over the data-parallel group), "
               "megatron/schedules.py::forward_backward_no_pipelining (no_sync for all but the last "
               "micro-batch); DDP's 25 MiB buckets all-reduced as the last backward produces them "
               "(torch/csrc/distributed/c10d/reducer.hpp); the rest as megatron-2021",
    ),
    "megatron-core": Implementation(
        name="megatron-core", loss="vocab-parallel", eager_model_code=False, reduce="bucket", reduce_bucket_elements=4e7,
        moe_dispatcher="allgather", moe_grouped_gemm=False, moe_permute_fusion=False, expert_tp_is_tp=True,
        attention_kernel_on=_TE_FUSED_ATTENTION, wgrad_accumulation_fusion=True, fp8_recipe="delayed",
        source=f"{_MEG}@d98e8a64:megatron/core/distributed/param_and_grad_buffer.py::"
               "_ParamAndGradBucketGroup.start_grad_sync (reduce_scatter per bucket, overlapped with the "
               "last backward), start_param_sync (all_gather per bucket, one-ahead before each forward); "
               "MoE as TransformerConfig's defaults: moe_token_dispatcher_type 'allgather', "
               "moe_grouped_gemm False (SequentialMLP), moe_permute_fusion False (eager permute / scatter_add_ "
               "un-permute, moe/moe_utils.py); expert_tensor_parallel_size = tensor_model_parallel_size "
               "(model_parallel_config.py::ModelParallelConfig.__post_init__)",
    ),
    "megatron-bridge": Implementation(
        name="megatron-bridge", loss="vocab-parallel", eager_model_code=False, reduce="bucket", reduce_bucket_elements=4e7,
        attention_kernel_on=_TE_FUSED_ATTENTION, distributed_optimizer=True, wgrad_accumulation_fusion=True,
        fp8_recipe="tensorwise",
        source=f"{_MEG}@d98e8a64 (megatron-core's collectives) as NVIDIA-NeMo/Megatron-Bridge@067f987d "
               "recipes configure them: src/megatron/bridge/recipes/common.py::_pretrain_common "
               "(use_distributed_optimizer=True); MoE models: src/megatron/bridge/recipes/{{deepseek,qwen,...}}: "
               "moe_token_dispatcher_type 'alltoall', moe_grouped_gemm True, moe_permute_fusion True, "
               "expert_tensor_parallel_size 1",
    ),
    "torchtitan": Implementation(
        name="torchtitan", rope_form="complex", copy_bytes_per_gathered_byte=1.0, max_prefetch_depth=1, master_weights=False,
        gather_after_loss=True, sp_saves_gathered_inputs=True, pp_keeps_unsharded=True, tp_loss="loss-parallel",
        blocking_calls=True, gather_copy_out=True, reduce_output_on_reduce_stream=True,  # FSDP2's (see fsdp2)
        moe_permute_fusion=False,  # torchtitan/models/moe/moe.py: torch.gather in, zeros_like + scatter_add out
        source="pytorch/torchtitan@v0.2.2:torchtitan/models/llama3/infra/parallelize.py::apply_fsdp, "
               "apply_tp (FSDP2 per block + DTensor TP/SP), infra/pipeline.py (torch.distributed.pipelining "
               "schedules, FSDP kept unsharded across micro-batches); MoE: models/moe/moe.py (torch._grouped_mm experts, "
               "eager gather / scatter_add permutation)",
    ),
    "dtensor": Implementation(
        name="dtensor", optimizer_temp_bytes_per_param=4.0, grad_reduce_overlap=False, master_weights=False, tp_gathers_logits=True,
        tp_replicated_embedding_grad=True, sp_saves_gathered_inputs=True,
        framework_host="dtensor",
        source=f"{_PT}:torch/distributed/tensor/parallel/style.py::ColwiseParallel, RowwiseParallel, "
               "SequenceParallel, PrepareModuleInput (torchtitan's TP plan with sequence parallelism and "
               "the logits gathered: output_layouts=Replicate()), torch/distributed/pipelining/schedules.py::"
               "Schedule1F1B, ScheduleInterleaved1F1B; the data-parallel reduction and the sequence-parallel "
               "norm-gradient all-reduce as hzpsim/executor/nd.py issues them (one all_reduce per unit "
               "after the backward, one coalesced all_reduce over the TP group per step)",
    ),
    "ddp": Implementation(
        name="ddp", optimizer_temp_bytes_per_param=4.0, reduce="bucket", reduce_bucket_elements=25 * 2**20 / 4,
        source=f"{_PT}:torch/csrc/distributed/c10d/reducer.hpp (25 MiB buckets, all_reduce per bucket, "
               "overlapped with the backward)",
    ),
}

#: What each strategy runs as unless its ``implementation`` says otherwise.
DEFAULTS = {"zero": "deepspeed", "mics": "deepspeed", "zeropp": "deepspeed", "hsdp": "fsdp2",
            "nd": "megatron-core", "megatron_fsdp": "megatron-core", "asynchzp": "reference", "ddp": "ddp"}


IDEAL = IMPLEMENTATIONS["ideal"]


def get(name: str) -> Implementation:
    """The profile called ``name``; ValueError naming the known ones otherwise."""
    if name not in IMPLEMENTATIONS:
        raise ValueError(f"implementation: unknown '{name}' (known: {', '.join(sorted(IMPLEMENTATIONS))})")
    return IMPLEMENTATIONS[name]
