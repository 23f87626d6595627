"""The ``hzpsim`` command.

    hzpsim run                        # the built-in default scenario, every strategy side by side
    hzpsim run scenario.yaml --json   # one JSON object (DESIGN §5) per strategy
    hzpsim run --set model=llama3-8b --set cluster.num_nodes=2
    hzpsim compare scenario.yaml      # every entry of the scenario's `strategies:` list
    hzpsim list                       # devices, cluster presets, workloads, strategies
    hzpsim search scenario.yaml       # the best layout of every family (hzpsim.search)
    hzpsim regress goldens.yaml       # predictions against expected values (hzpsim.regress)
    hzpsim validate published|executor    # predictions against measured runs
    hzpsim execute scenario.yaml      # the strategies for real, with torch.distributed
    hzpsim calibrate machine|published|measured
    hzpsim import megatron|torchtitan|deepspeed FILE   # a framework's launch/config as a scenario

One module per command, each with the same interface: ``register(subparsers)`` adds its parser
(and its targets' parsers) and sets ``handler`` on every parser that runs, a function of the
parsed arguments that returns the exit code. :data:`COMMANDS` lists them in the order
``hzpsim --help`` shows; :func:`make_parser` registers each, and :func:`main` calls the handler
inside the one error policy below. ``options`` holds the arguments and checks several commands
share.

Exit codes: 0 ok; 2 invalid input (one line naming what and where); 3 simulator fault (the
engine stopped making progress: names the stuck op); 1 other internal error, or a prediction
that moved beyond its tolerance (``regress``).
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

from hzpsim import __version__
from hzpsim.cli import calibrate, execute, imports, listing, regress, run, search, validate
from hzpsim.cli.options import profile_option
from hzpsim.config import ScenarioError
from hzpsim.model.ops import GraphError, SimulatorFault
from hzpsim.run import run_choice

__all__ = ["COMMANDS", "main", "make_parser", "run_choice"]

#: Every command module, in the order ``hzpsim --help`` lists its commands.
COMMANDS = (run, search, regress, validate, execute, calibrate, imports, listing)


def make_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hzpsim", description="Which parallelism strategy wins on your cluster, and why.")
    parser.add_argument("--version", action="version", version=f"hzpsim {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    for command in COMMANDS:
        command.register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = make_parser().parse_args(argv)
    try:
        # --profile of run, compare, search and validate published (validate executor's
        # --profile is its machine profile, a different file); active for this command only
        with profile_option(getattr(args, "calibration_profile", None)):
            return int(args.handler(args))
    except (ScenarioError, GraphError) as exc:
        print(f"hzpsim: error: {exc}", file=sys.stderr)
        return 2
    except SimulatorFault as exc:  # a valid scenario the engine could not finish: an hzpsim bug
        print(f"hzpsim: {exc}", file=sys.stderr)
        return 3
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:  # e.g. `hzpsim run | head`: the reader left, nothing is wrong
        sys.stderr.close()
        return 0
    except Exception as exc:  # an hzpsim bug, not bad input
        if os.environ.get("HZPSIM_DEBUG"):
            raise
        print(f"hzpsim: internal error: {type(exc).__name__}: {exc} (set HZPSIM_DEBUG=1 for a traceback)", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
