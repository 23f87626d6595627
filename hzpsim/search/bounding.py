"""The bounds of a candidate: its plugin's ``bound`` hook (``refine_bound`` when refined), with
the scenario's shared :class:`~hzpsim.strategies.BoundCache`.

A plugin without ``bound`` gets ``Bound()``: zero step time and memory, which prunes nothing,
so every valid candidate of it is simulated. The bounds themselves, and why they hold, live
with the strategies (``hzpsim/strategies/_bounds.py`` and the plugins' hooks).
"""

from __future__ import annotations

from hzpsim.scenario import Scenario
from hzpsim.search.space import Candidate, choice_of, plugin_of, training_of
from hzpsim.strategies import Bound, BoundCache


class Bounder:
    """Lower bounds on the step time and peak memory the simulator reports for the candidates
    of one scenario (the candidate must be valid, see :func:`~hzpsim.search.space.check`);
    what they share is cached across candidates."""

    def __init__(self, scenario: Scenario) -> None:
        self.scenario = scenario
        self.cache = BoundCache(scenario.model, scenario.topology)

    def refines(self, candidate: Candidate) -> bool:
        """Whether the candidate's plugin has a refined bound (worth it just before simulating)."""
        return hasattr(plugin_of(candidate.name), "refine_bound")

    def __call__(self, candidate: Candidate, refine: bool = False) -> Bound:
        """The bounds; ``refine`` adds what is too slow to compute for every candidate (for the
        few the search is about to simulate), when the plugin offers it."""
        plugin = plugin_of(candidate.name)
        hook = getattr(plugin, "refine_bound", None) if refine else None
        if hook is None:
            hook = getattr(plugin, "bound", None)
        if hook is None:
            return Bound()
        sc = self.scenario
        return hook(choice_of(candidate).config, sc.model, training_of(sc, candidate), sc.topology, self.cache)


def bound(scenario: Scenario, candidate: Candidate) -> Bound:
    """:class:`Bounder` for one candidate."""
    return Bounder(scenario)(candidate)
