"""Variable-length sequences in a strategy's program: the drawn document lengths a lane's
micro-batches attend over (``model/sequences.py``), attached to the strategy's emitter and to
the graph's meta for the engine (``sim/lengths.py``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from hzpsim.model.sequences import effective_tokens
from hzpsim.model.training import Training

if TYPE_CHECKING:
    from hzpsim.strategies._sharded import Emitter


@dataclass(frozen=True)
class Lengths:
    """The drawn document lengths of a run with variable-length sequences
    (``model/sequences.py``): ``tokens[step, micro-batch, data-parallel rank]`` is the
    token-weighted mean piece length a rank's micro-batch attends over, ``data_rank`` the
    data-parallel index of each simulated lane (whose micro-batches it runs)."""

    tokens: object  # numpy array [steps, micro-batches, dp]
    seq_len: int
    data_rank: dict[int, int]

    @property
    def num_micro_batches(self) -> int:
        return int(self.tokens.shape[1])  # type: ignore[attr-defined]


def attach_lengths(emit: Emitter, training: Training, seq_len: int, data_rank: dict[int, int], dp: int,
                   data_stride: int, num_micro_batches: int) -> None:
    """With variable-length sequences (``training.varying_lengths``), draw every step's lengths,
    give them to ``emit`` (each lane's attention then runs its own rank's documents) and record
    them in the graph's meta for the engine, which makes ranks that synchronise wait for the
    slowest (``sim/engine.py``, ``sequence_lengths``): the data-parallel index of device d is
    (d // ``data_stride``) % ``dp``."""
    spec = training.varying_lengths
    if spec is None:
        return
    tokens = effective_tokens(spec, seq_len, dp, num_micro_batches, training.micro_batch_size, training.num_steps)
    emit.lengths = Lengths(tokens, seq_len, data_rank)
    emit.graph.meta["sequence_lengths"] = {
        "seq_len": seq_len, "dp": dp, "data_stride": data_stride, "num_micro_batches": num_micro_batches,
        "effective_tokens": [[float(x) for x in row] for row in tokens.reshape(-1, dp)],
    }
