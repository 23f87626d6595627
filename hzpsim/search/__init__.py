"""Search a scenario's whole strategy space for the fastest layouts that fit (``hzpsim search``).

    hzpsim search examples/gpt3-175b-megatron.yaml                 # best per family, top 10
    hzpsim search SCENARIO --family nd --top 5 --json
    hzpsim search SCENARIO --dask tcp://scheduler:8786              # simulations on a Dask cluster
    python -c "from hzpsim.search import search; ..."               # the same from Python

The search knows no strategy by name: it searches every plugin ``strategies.available()``
lists, in the order of their ``SEARCH_RANK``, and asks each for its part (the hooks of
``hzpsim/strategies/__init__.py``; a plugin without them gets the defaults: one layout, no
bound). The space (:class:`Space`) is every plugin's layouts of the layout knobs (``layouts``:
tensor, pipeline, context and expert parallelism, ZeRO stages, sharding group sizes, ...) times
the training knobs (micro-batch size, activation recompute). It is searched by branch and
bound, exactly:

1. every candidate is checked by its plugin (``check``, and ``search_check``: layouts that
   cannot run or are not searched are *invalid*);
2. two cheap analytic bounds, no graph built: a lower bound on peak memory (resident model
   states plus the activations a schedule must hold before its first backward) and a lower
   bound on step time (the step's dependency chain replayed at the least durations the engine
   can give its ops, stragglers' expected waits included, and the time the rank must spend
   talking). Every candidate gets its plugin's cheapest bound hook (``quick_bound`` where it
   has one, else ``bound``). A candidate whose memory bound exceeds the device is *pruned
   (memory)*;
3. the rest are taken best bound first, in fixed batches, and a candidate whose bound exceeds
   both the N-th best fitting step time found so far and its family's best is *pruned
   (bound)*: it can enter neither the top N nor its family's best. A candidate whose bound
   passes gets its plugin's next, tighter hook first (``quick_bound`` → ``bound`` →
   ``refine_bound``: the ND pipeline replayed, every stage's schedule micro-batch by
   micro-batch against the others') and goes back in its place by the tighter bound; it is
   simulated when it comes up with its tightest. So the candidates are simulated in the order
   of their tightest bounds, and most of the space is pruned on the cheapest one.

Both bounds are tested against simulated values (``tests/test_search.py``), and the search's
answers against an exhaustive simulation of the same space. Batches are fixed, so the same
scenario gives the same answer and the same counts on one process, many, or a Dask cluster.

Modules: :mod:`.space` (the knobs, the candidates, the plugins' checks), :mod:`.bounding` (the
plugins' bounds), :mod:`.runners` (where candidates are simulated), :mod:`.core` (the branch
and bound), :mod:`.text` (the text output).
"""

from __future__ import annotations

from hzpsim.search.bounding import Bounder, bound
from hzpsim.search.core import BATCH, Row, SearchResult, search
from hzpsim.search.runners import DaskRunner, ProcessRunner, Runner, evaluate, make_runner
from hzpsim.search.space import (
    RECOMPUTE,
    Candidate,
    Space,
    check,
    choice_of,
    default_space,
    enumerate_candidates,
    families,
    layouts_of,
    plugin_of,
    training_of,
    variant,
)
from hzpsim.search.text import format_search, loss_reason, parse_families
from hzpsim.strategies import Bound

#: Strategy names searched by default, in the order they are reported (one ``best_per_family``
#: key each): every plugin, by its ``SEARCH_RANK`` (:func:`families`).
FAMILIES = families()

__all__ = [
    "BATCH", "FAMILIES", "RECOMPUTE", "Bound", "Bounder", "Candidate", "DaskRunner", "ProcessRunner", "Row",
    "Runner", "SearchResult", "Space", "bound", "check", "choice_of", "default_space", "enumerate_candidates",
    "evaluate", "families", "format_search", "layouts_of", "loss_reason", "make_runner", "parse_families",
    "plugin_of", "search", "training_of", "variant",
]
