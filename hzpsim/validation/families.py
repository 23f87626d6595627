"""Architecture conventions per model family, read from ``hzpsim/data/model_families.yaml``.

Part of :mod:`hzpsim.validation`: a published row names only a model (``GPT-175B``,
``MPT-7b``, ``Llama-3.1-8B``); its family supplies what the CSV does not say (MLP type,
positions, biases, tied head, ...). The rules are workload data, so they live in the YAML file;
docs/validation.md §2 explains each one.

    from hzpsim.validation.families import family_of
    family_of("MPT-7b").architecture   # {'mlp': 'gelu', 'tied_embeddings': True, ...}
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any

import yaml

from hzpsim.validation.cells import RowSkipped

FAMILIES_YAML = Path(__file__).resolve().parent.parent / "data" / "model_families.yaml"


@dataclass(frozen=True, kw_only=True)
class ModelFamily:
    """One entry of model_families.yaml."""

    name: str
    """Family key (``gpt``, ``mpt``, ``llama``, ...)."""
    name_prefixes: tuple[str, ...]
    """Lower-case prefixes of the CSV's ``model_name`` that belong to this family."""
    architecture: dict[str, Any] = field(default_factory=dict)
    """:class:`hzpsim.model.Model` fields set on every mapped model of the family."""
    preset: str | None = None
    """Shipped workload preset that describes the model exactly (the CSV's dims are unused)."""
    blank_ffn_hidden_multiple: int | None = None
    """A blank ``ffn_hidden`` becomes this multiple of ``hidden``; None: the row is skipped."""
    blank_ffn_hidden_why: str = ""
    """Why (the framework default), quoted in the row's assumptions."""
    blank_vocab_size: int | None = None
    """A blank ``vocab`` becomes this size (tokens); None: the row is skipped."""
    blank_vocab_why: str = ""
    """Why (the tokenizer and its padding), quoted in the row's assumptions."""
    untie_when_size_mismatch: bool = False
    """Untie the LM head when the tied model misses ``n_params_b`` by >10 % and the untied
    one matches."""


@lru_cache(maxsize=1)
def model_families(path: Path = FAMILIES_YAML) -> tuple[ModelFamily, ...]:
    """Every family of the YAML file, in file order (the order names are matched in)."""
    data = yaml.safe_load(path.read_text(encoding="utf-8"))
    known = {f.name for f in dataclasses.fields(ModelFamily)}
    out = []
    for entry in data["families"]:
        unknown = set(entry) - known
        if unknown:
            raise ValueError(f"{path}: family {entry.get('name')!r}: unknown keys {sorted(unknown)}")
        out.append(ModelFamily(**{**entry, "name_prefixes": tuple(entry["name_prefixes"])}))
    return tuple(out)


def family_of(model_name: str) -> ModelFamily:
    """The family whose name prefix ``model_name`` starts with (case-insensitive); a name no
    family claims skips the row."""
    n = model_name.lower()
    for fam in model_families():
        if any(n.startswith(p) for p in fam.name_prefixes):
            return fam
    raise RowSkipped(f"model_name: no architecture rule for {model_name!r}")
