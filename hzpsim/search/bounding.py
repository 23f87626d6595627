"""The bounds of a candidate: its plugin's bound hooks, cheapest first (``quick_bound``,
``bound``, ``refine_bound``: :data:`LEVELS`), with the scenario's shared
:class:`~hzpsim.strategies.BoundCache`.

A plugin without any gets ``Bound()``: zero step time and memory, which prunes nothing, so
every valid candidate of it is simulated. The bounds themselves, and why they hold, live with
the strategies (``hzpsim/strategies/_bounds.py`` and the plugins' hooks).
"""

from __future__ import annotations

from hzpsim.scenario import Scenario
from hzpsim.search.space import Candidate, choice_of, plugin_of, training_of
from hzpsim.strategies import Bound, BoundCache

#: A plugin's bound hooks, loosest and cheapest first. Each holds below the simulation, and each
#: is at least the one before it: the search bounds every candidate with the first its plugin
#: has and computes the next only for a candidate it is about to simulate.
LEVELS = ("quick_bound", "bound", "refine_bound")


class Bounder:
    """Lower bounds on the step time and peak memory the simulator reports for the candidates
    of one scenario (the candidate must be valid, see :func:`~hzpsim.search.space.check`);
    what they share is cached across candidates."""

    def __init__(self, scenario: Scenario) -> None:
        self.scenario = scenario
        self.cache = BoundCache(scenario.model, scenario.topology)
        self._hooks: dict[str, tuple[str, ...]] = {}

    def hooks(self, candidate: Candidate) -> tuple[str, ...]:
        """The bound hooks the candidate's plugin has, in :data:`LEVELS` order."""
        name = candidate.name
        if name not in self._hooks:
            plugin = plugin_of(name)
            self._hooks[name] = tuple(h for h in LEVELS if hasattr(plugin, h))
        return self._hooks[name]

    def at(self, candidate: Candidate, level: int) -> Bound:
        """The bounds of the candidate's ``level``-th hook (:meth:`hooks`); ``Bound()`` without hooks."""
        hooks = self.hooks(candidate)
        if not hooks:
            return Bound()
        sc = self.scenario
        hook = getattr(plugin_of(candidate.name), hooks[level])
        return hook(choice_of(candidate).config, sc.model, training_of(sc, candidate), sc.topology, self.cache)

    def __call__(self, candidate: Candidate, refine: bool = False) -> Bound:
        """The plugin's ``bound`` (``quick_bound`` where it has no other); ``refine`` its
        ``refine_bound``, where it has one: what is too slow to compute for every candidate."""
        hooks = self.hooks(candidate)
        for name in (("refine_bound", "bound") if refine else ("bound",)) + ("quick_bound",):
            if name in hooks:
                return self.at(candidate, hooks.index(name))
        return Bound()


def bound(scenario: Scenario, candidate: Candidate) -> Bound:
    """:class:`Bounder` for one candidate."""
    return Bounder(scenario)(candidate)
