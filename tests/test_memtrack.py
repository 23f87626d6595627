"""hzpsim.executor.memtrack: fake-tensor and real-tensor measurements agree, and the peak holds
the optimizer states."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from hzpsim.executor import memtrack  # noqa: E402

STRATEGIES = tuple(memtrack.MEMORY_STRATEGIES)


def tiny():
    return memtrack.small(seq_len=64, layers=2, hidden=128, vocab=2048)


@pytest.mark.parametrize("name", STRATEGIES)
def test_fake_matches_real_tensors_within_one_percent(name):
    spec = memtrack.spec_for(name, tiny(), micro_batches=2)
    assert memtrack.crosscheck(spec) < 0.01


@pytest.mark.slow
@pytest.mark.parametrize("name", STRATEGIES)
def test_fake_matches_real_tensors_at_the_reduced_shape(name):
    spec = memtrack.spec_for(name, memtrack.small(seq_len=256, layers=4, hidden=256, vocab=8192), micro_batches=4)
    assert memtrack.crosscheck(spec) < 0.01


@pytest.mark.parametrize("name", STRATEGIES)
def test_peak_holds_the_optimizer_states(name):
    """Adam's two moments of this rank's shard are live during the whole measured step (it
    follows a warm-up step), so they are in the peak's breakdown and the peak exceeds them
    plus the parameters."""
    spec = memtrack.spec_for(name, tiny(), micro_batches=2)
    result = memtrack.measure(spec, "fake")
    states = result["model_state_bytes"]
    moments = memtrack_moments(states, name)
    assert result["by_category"]["optimizer"] >= moments > 0
    assert result["resident_bytes"] >= states["params"] + states["optimizer"]
    assert result["peak_allocated_bytes"] > states["params"] + states["optimizer"]
    assert result["phase_peaks"]["optimizer_step"] >= states["params"] + states["optimizer"]


def memtrack_moments(states, name):
    """Bytes of Adam's exp_avg + exp_avg_sq (AsyncHZP counts its fp32 master shard as
    optimizer state too: two thirds of it are the moments)."""
    return states["optimizer"] * 2 // 3 if name == "asynchzp" else states["optimizer"]


def test_result_shape():
    spec = memtrack.spec_for("zero", tiny(), micro_batches=2)
    result = memtrack.measure(spec, "fake")
    assert result["method"] == "fake" and result["measured_step"] == 1
    assert set(result["by_category"]) == set(memtrack.CATEGORIES)
    assert sum(result["by_category"].values()) == result["peak_allocated_bytes"]
    assert any(key.endswith("layers.0") for key in result["by_module"])
    assert "warm-up" in result["notes"]
    with pytest.raises(ValueError):
        memtrack.measure(spec, "gpu")


def test_8b_shape_is_llama3():
    model = memtrack.llama3_8b()
    assert (model.num_layers, model.hidden_size, model.num_heads, model.num_kv_heads, model.ffn_hidden_size,
            model.vocab_size) == (32, 4096, 32, 8, 14336, 128256)


@pytest.mark.slow
def test_8b_zero_fake_runs_without_the_memory():
    spec = memtrack.spec_for("zero", memtrack.llama3_8b(2048), micro_batches=2)
    result = memtrack.measure(spec, "fake")
    params = 8_030_261_248 * 4 // 8  # fp32, 1/8 shard
    assert result["by_category"]["optimizer"] >= 2 * params
    assert result["peak_allocated_bytes"] > 3 * params


@pytest.mark.parametrize("loss", ["eager-fp32", "loss-parallel"])
def test_loss_peak_per_logit_matches_pytorch(loss):
    """The loss's peak bytes per logit (:func:`loss_bytes_per_logit`: the saved log-softmax plus
    the backward's temporaries, the larger of its two phases) is what PyTorch's MemTracker sees
    for ``F.cross_entropy(logits.float(), labels)`` on bf16 logits, eagerly and under DTensor's
    ``loss_parallel()`` over vocabulary-sharded logits (torchtitan's loss with TP)."""
    import torch.nn.functional as F
    from torch.distributed._tools.mem_tracker import MemTracker
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard
    from torch.distributed.tensor.parallel import loss_parallel

    from hzpsim.strategies._implementations import loss_bytes_per_logit

    memtrack._fake_process_group(2)
    mesh = init_device_mesh("cpu", (2,))
    tokens, local_vocab = 1024, 4096
    torch.manual_seed(0)
    hidden = torch.randn(tokens, 64, dtype=torch.bfloat16)
    weight = torch.randn(64, local_vocab, dtype=torch.bfloat16, requires_grad=True)
    labels = torch.randint(0, local_vocab, (tokens,))
    tracker = MemTracker()
    with tracker:
        logits = hidden @ weight
        if loss == "loss-parallel":
            with loss_parallel():
                out = F.cross_entropy(DTensor.from_local(logits, mesh, [Shard(1)]).float(), labels)
                del logits
                out.backward()
        else:
            out = F.cross_entropy(logits.float(), labels)
            del logits
            out.backward()
    # the tracker counts what is allocated inside it: the logits, the loss's tensors, and the
    # weight's gradient, which comes after the loss's temporaries are gone
    peak = max(d["Total"] for d in tracker.get_tracker_snapshot("peak").values())
    saved, forward, backward = loss_bytes_per_logit(loss, 2)
    predicted = max(saved + sum(forward), saved + sum(backward))
    assert peak / (tokens * local_vocab) == pytest.approx(predicted, abs=0.05)
