"""Arguments and checks that several commands share (not a command: no ``register``).

Each check raises :class:`~hzpsim.config.ScenarioError` naming the option, before anything is
simulated, so that a bad value costs nothing and ``hzpsim`` exits 2 with one line.
"""

from __future__ import annotations

import argparse
import contextlib
import os
from typing import Any

from hzpsim.calibration import profile as calibration
from hzpsim.config import ScenarioError


def add_scenario(parser: argparse.ArgumentParser) -> None:
    """The optional scenario file and its ``--set`` overrides (run, compare, search)."""
    parser.add_argument("scenario", nargs="?", help="scenario YAML file (omit for the built-in default)")
    parser.add_argument("--set", action="append", metavar="KEY.PATH=VALUE",
                        help="override a field, e.g. cluster.num_nodes=16")


PROFILE_HELP = ("calibration profile, JSON or YAML (default: the shipped fit): its fitted constants, and "
                "the machine `hzpsim calibrate machine` measured (device file and fabric) where it has one")


def add_profile(parser: argparse.ArgumentParser, help_text: str = PROFILE_HELP) -> None:
    """``--profile FILE``, the one profile option: its constants are active while the command
    runs (``hzpsim.cli.main`` reads ``args.calibration_profile``), and a profile that carries a
    machine also sets the scenario's device and fabric (:func:`scenario_overrides`)."""
    parser.add_argument("--profile", dest="calibration_profile", metavar="FILE", help=help_text)


def profile_option(path: str | None) -> contextlib.AbstractContextManager[Any]:
    """``--profile FILE``: a context in which that profile is active (the active profile is
    restored after the command); ScenarioError if the file is unreadable."""
    if path is None:
        return contextlib.nullcontext()
    try:
        return calibration.using(calibration.load(path))
    except ValueError as exc:
        raise ScenarioError(f"--profile: {exc}") from None


def scenario_overrides(args: argparse.Namespace) -> list[str]:
    """The command's ``--set`` overrides, after those the ``--profile``'s machine implies
    (``cluster.device`` = its device file, its fabric's fields), so that the user's own win."""
    path = getattr(args, "calibration_profile", None)
    machine = {}
    if path is not None:
        try:
            machine = calibration.load(path).machine()
        except ValueError as exc:
            raise ScenarioError(f"--profile: {exc}") from None
    out: list[str] = []
    if machine:
        if not isinstance(machine["device"], str):
            raise ScenarioError(f"--profile {path}: its device is inline (written before device files); "
                                "run `hzpsim calibrate machine` again to get a device file")
        out.append(f"cluster.device={machine['device']}")
        out += [f"cluster.{key}={value!r}" for key, value in sorted(machine["cluster"].items())]
    return out + list(getattr(args, "set", None) or ())


def positive_int(value: str | None, flag: str, default: int | None = None) -> int | None:
    """``--top 3`` -> 3; one-line ScenarioError for anything but a positive integer."""
    if value is None:
        return default
    try:
        number = int(value)
    except ValueError:
        raise ScenarioError(f"{flag}: expected a positive integer, got {value!r}") from None
    if number < 1 or number > 10**9:
        raise ScenarioError(f"{flag}: expected a positive integer, got {value!r}")
    return number


def check_writable(path: str, option: str) -> None:
    """ScenarioError naming ``option`` unless a file can be written at ``path``."""
    parent = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path):
        raise ScenarioError(f"{option} {path}: is a directory, expected a file name")
    if not os.path.isdir(parent):
        raise ScenarioError(f"{option} {path}: folder {parent} does not exist")
    if not os.access(path if os.path.exists(path) else parent, os.W_OK):
        raise ScenarioError(f"{option} {path}: not writable")


def check_plot_path(path: str) -> None:
    """``--plot FILE``: a .png, .svg or .pdf name in a folder that exists."""
    suffix = os.path.splitext(path)[1].lower()
    if suffix not in (".png", ".svg", ".pdf"):
        raise ScenarioError(f"--plot {path}: expected a .png, .svg or .pdf file name")
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        raise ScenarioError(f"--plot {path}: no such directory {folder}")


def check_run_options(args: argparse.Namespace) -> None:
    """``--world``, ``--steps`` and ``--comm-delay`` of ``execute`` and ``validate executor``."""
    if not 1 <= args.world <= 64:
        raise ScenarioError(f"--world: {args.world} is not between 1 and 64")
    if args.steps < 3:
        raise ScenarioError("--steps: at least 3 (warm-up, counted step, last step)")
    if args.comm_delay < 0:
        raise ScenarioError("--comm-delay: must be >= 0")
