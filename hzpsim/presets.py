"""Find the YAML presets shipped in ``workloads/`` and ``topologies/``.

In a checkout they sit at the top of the repository; in an installed wheel they are copied into
``hzpsim/_presets/`` (see ``pyproject.toml``). A user folder (``$HZPSIM_CONFIG_DIR`` or
``~/.config/hzpsim``) is searched first, so that ``hzpsim calibrate`` can write ``local-cpu``
there and never into the installed package.

The folders are looked at afresh for every scenario load (a preset the user adds between two
loads is found by the second); inside one load (:func:`listing_once`) each kind is located and
listed once, so every check of that load sees the same set of presets.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from pathlib import Path
from typing import Any, Literal, TypeVar

import yaml

from hzpsim.config import ScenarioError

Kind = Literal["workloads", "topologies"]
T = TypeVar("T")

_PACKAGE_DIR = Path(__file__).resolve().parent

#: Folders and names found so far inside the innermost :func:`listing_once` (None outside).
_memo: ContextVar[dict[tuple[str, Kind], Any] | None] = ContextVar("hzpsim_preset_listing", default=None)


@contextmanager
def listing_once() -> Iterator[None]:
    """Inside the block, each kind's folders are located and listed (globbed) once.

    Wraps one scenario load; nesting reuses the outer block's listing. Outside any block every
    call looks at the folders again.
    """
    if _memo.get() is not None:
        yield
        return
    token = _memo.set({})
    try:
        yield
    finally:
        _memo.reset(token)


def _once(what: str, kind: Kind, compute: Callable[[], T]) -> T:
    memo = _memo.get()
    if memo is None:
        return compute()
    if (what, kind) not in memo:
        memo[what, kind] = compute()
    out: T = memo[what, kind]
    return out


def user_config_dir() -> Path:
    """Where files written by ``hzpsim calibrate`` go unless the user names a path."""
    env = os.environ.get("HZPSIM_CONFIG_DIR")
    if env:
        return Path(env)
    base = os.environ.get("XDG_CONFIG_HOME") or str(Path.home() / ".config")
    return Path(base) / "hzpsim"


def preset_dirs(kind: Kind) -> list[Path]:
    """Folders searched for presets of ``kind``, highest priority first."""
    return list(_once("dirs", kind, lambda: _existing_dirs(kind)))


def _existing_dirs(kind: Kind) -> tuple[Path, ...]:
    candidates = [
        user_config_dir() / kind,
        _PACKAGE_DIR / "_presets" / kind,  # installed wheel
        _PACKAGE_DIR.parent / kind,  # source checkout
    ]
    return tuple(d for d in candidates if d.is_dir())


def list_presets(kind: Kind) -> list[str]:
    """Names (file stems) of the presets of ``kind``, sorted."""
    return list(_once("names", kind, lambda: _glob_names(kind)))


def _glob_names(kind: Kind) -> tuple[str, ...]:
    names: set[str] = set()
    for folder in preset_dirs(kind):
        names.update(p.stem for p in folder.glob("*.yaml"))
    return tuple(sorted(names))


def read_yaml(path: Path) -> Any:
    try:
        with open(path, encoding="utf-8") as handle:
            return yaml.safe_load(handle)
    except OSError as exc:
        raise ScenarioError(f"{path}: cannot read ({exc.strerror})") from None
    except yaml.YAMLError as exc:
        raise ScenarioError(f"{path}: not valid YAML ({str(exc).splitlines()[0]})") from None
    except UnicodeDecodeError as exc:
        raise ScenarioError(f"{path}: not UTF-8 text ({exc.reason} at byte {exc.start})") from None
    except (ValueError, RecursionError) as exc:
        # PyYAML builds some implicit types eagerly (a date "2020-13-45" -> ValueError) and
        # composes nested collections recursively
        raise ScenarioError(f"{path}: not valid YAML ({type(exc).__name__}: {exc})") from None


def load_preset(kind: Kind, name: str, path: str) -> dict[str, Any]:
    """The mapping stored in preset ``name``; ``path`` names the scenario key for errors."""
    for folder in preset_dirs(kind):
        candidate = folder / f"{name}.yaml"
        if candidate.is_file():
            data = read_yaml(candidate)
            if not isinstance(data, dict):
                raise ScenarioError(f"{candidate}: a preset must be a mapping")
            return dict(data)
    known = ", ".join(list_presets(kind)) or "none"
    raise ScenarioError(f"{path}: unknown preset '{name}' (known: {known})")
