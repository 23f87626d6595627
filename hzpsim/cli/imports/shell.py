"""Just enough of a bash launch script to find a Megatron launch: line continuations, comments,
simple variable assignments (``TP=8``, ``export PARAMS="--x ${TP}"``) expanded where they are
used (``$TP``, ``${TP}``, ``${TP:-8}``), ``#SBATCH`` directives, and the command that runs
``pretrain_gpt.py`` (directly, after ``torchrun`` / ``srun`` / ``python -m torch.distributed.*``,
or inside ``sh -c "..."``).

What is not resolved is not guessed: a variable assigned inside an ``if`` / ``case`` / loop
block, from a command substitution, an array, or never assigned (an environment variable) is
kept as a marker; reading a token that holds one raises ScenarioError naming the variable.
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass, field

from hzpsim.config import ScenarioError

_ASSIGN = re.compile(r"^(?:(?:export|declare|local|readonly)\s+(?:-\w+\s+)*)?([A-Za-z_][A-Za-z0-9_]*)=(.*)$", re.S)
_VAR = re.compile(r"\$(?:\{([A-Za-z_][A-Za-z0-9_]*)(?::?-([^}]*))?\}|([A-Za-z_][A-Za-z0-9_]*))")
_OPEN = ("if", "case", "for", "while", "until", "select", "function")
_CLOSE = ("fi", "esac", "done", "}")
_MARK = "\x00"
_SPACE = "\x01"  # a space inside a marker (word splitting must not cut it)
SCRIPT = re.compile(r"(^|/)pretrain_[A-Za-z0-9_]+\.py$")


@dataclass
class Launch:
    """What the script launches: the launcher's tokens, the training script, its arguments."""

    launcher: list[str] = field(default_factory=list)  # tokens before the script (+ #SBATCH ones)
    script: str = ""
    arguments: list[str] = field(default_factory=list)
    bare: bool = False  # the file is an argument list, no command


def unresolved(token: str) -> str | None:
    """The first unresolved variable a token holds, as 'NAME (why)'; None when it holds none."""
    if _MARK not in token:
        return None
    return token.split(_MARK)[1].replace(_SPACE, " ")


def check_resolved(token: str, what: str) -> str:
    bad = unresolved(token)
    if bad:
        raise ScenarioError(f"{what}: uses shell variable ${bad}, which the importer cannot resolve "
                            "(set it with a plain NAME=value line before the launch, or give the value)")
    return token


def _logical_lines(text: str) -> list[str]:
    """Physical lines joined over backslash-newlines and open quotes; comments dropped
    (``#SBATCH`` lines kept)."""
    out: list[str] = []
    buf = ""
    quote = ""
    for raw in text.splitlines():
        line = raw
        if not buf and line.lstrip().startswith("#"):
            if line.lstrip().startswith("#SBATCH"):
                out.append(line.strip())
            continue
        i, kept = 0, []
        while i < len(line):
            c = line[i]
            if quote:
                if c == quote:
                    quote = ""
                elif c == "\\" and quote == '"' and i + 1 < len(line):
                    kept.append(c)
                    i += 1
                    c = line[i]
            elif c in "'\"":
                quote = c
            elif c == "\\" and i + 1 < len(line):
                kept.append(c)
                i += 1
                c = line[i]
            elif c == "#" and (i == 0 or line[i - 1].isspace()):
                break
            kept.append(c)
            i += 1
        line = "".join(kept)
        if quote:  # a quoted word goes on; a backslash-newline inside double quotes is removed
            ends = len(line) - len(line.rstrip("\\"))
            buf += line[:-1] if quote == '"' and ends % 2 else line + "\n"
            continue
        if line.rstrip().endswith("\\") and not line.rstrip().endswith("\\\\"):
            buf += line.rstrip()[:-1] + " "
            continue
        buf += line
        if buf.strip():
            out.append(buf.strip())
        buf = ""
    if buf.strip():
        out.append(buf.strip())
    return out


def _expand(text: str, variables: dict[str, str | None], why: dict[str, str]) -> str:
    """``$X`` / ``${X}`` / ``${X:-d}`` replaced outside single quotes; command substitutions and
    unknown variables become markers."""
    parts, i, quote = [], 0, ""
    while i < len(text):
        c = text[i]
        if c == "'" and quote != '"':
            quote = "" if quote == "'" else "'"
            parts.append(c)
            i += 1
            continue
        if c == '"' and quote != "'":
            quote = "" if quote == '"' else '"'
        if quote != "'" and (text.startswith("$(", i) or c == "`"):
            end = text.find(")", i) if c == "$" else text.find("`", i + 1)
            end = len(text) - 1 if end < 0 else end
            parts.append(_marker(f"({text[i:end + 1]}) (a command substitution)"))
            i = end + 1
            continue
        if quote != "'" and c == "$":
            m = _VAR.match(text, i)
            if m:
                name = m.group(1) or m.group(3)
                value = variables.get(name)
                if value is None and m.group(2) is not None and name not in variables:
                    value = m.group(2)
                if value is None:
                    reason = why.get(name, "never assigned in the script (an environment variable?)")
                    value = _marker(f"{{{name}}} ({reason})")
                parts.append(value)
                i = m.end()
                continue
        parts.append(c)
        i += 1
    return "".join(parts)


def _marker(text: str) -> str:
    return _MARK + re.sub(r"\s", _SPACE, text) + _MARK


def _split(text: str, where: str) -> list[str]:
    try:
        return shlex.split(text, posix=True)
    except ValueError as exc:
        raise ScenarioError(f"{where}: cannot split into words: {exc}") from None


def parse(text: str, source: str) -> Launch:
    """The launch of a script (or of a bare argument list)."""
    variables: dict[str, str | None] = {}
    why: dict[str, str] = {}
    depth = 0
    sbatch: list[str] = []
    found: Launch | None = None
    lines = _logical_lines(text)
    for line in lines:
        if line.startswith("#SBATCH"):
            sbatch += _split(_expand(line[len("#SBATCH"):], variables, why), f"{source}: {line}")
            continue
        first = line.split(None, 1)[0].rstrip(";")
        if first in _OPEN or line.endswith("()") or line.endswith("() {"):
            depth += 1
        if first in _CLOSE:
            depth = max(0, depth - 1)
            continue
        if first in ("then", "else", "elif", "do", "if", "case", "for", "while", "until", "function", "select"):
            if first in ("elif",) or first in _OPEN:
                continue
            rest = line.split(None, 1)
            if len(rest) < 2:
                continue
            line = rest[1]
        m = _ASSIGN.match(line)
        if m and not any(ch.isspace() for ch in _strip_quoted(m.group(2))):
            name, raw = m.group(1), m.group(2)
            if depth:
                variables[name] = None
                why[name] = "assigned inside an if/case/loop block"
                continue
            if raw.startswith("("):
                variables[name], why[name] = None, "an array"
                continue
            words = _split(_expand(raw, variables, why), f"{source}: {line}")
            value = words[0] if len(words) == 1 else "" if not words else None
            if value is not None and _MARK in value and value.count(_MARK) >= 2:
                variables[name], why[name] = None, f"it is set from ${unresolved(value)}"
                continue
            variables[name] = value
            if value is None:
                why[name] = "not a single word"
            continue
        if found is not None or not any(k in line for k in ("pretrain_", "$", "`")):
            continue
        words = _split(_expand(line, variables, why), f"{source}: {line}")
        launch = _find_script(words)
        if launch is not None:
            found = launch
    if found is not None:
        found.launcher = sbatch + found.launcher
        return found
    words = [w for line in lines if not line.startswith("#SBATCH")
             for w in _split(_expand(line, variables, why), f"{source}: {line}")]
    if words and words[0].startswith("--"):
        return Launch(launcher=sbatch, arguments=words, bare=True)
    raise ScenarioError(f"{source}: no command that runs pretrain_gpt.py, and not an argument list "
                        "(the first word is not an --option)")


def _strip_quoted(text: str) -> str:
    """``text`` with its quoted parts removed (whitespace inside quotes is one word)."""
    return re.sub(r"\"(?:\\.|[^\"\\])*\"|'[^']*'", "", text)


def _find_script(words: list[str]) -> Launch | None:
    for i, word in enumerate(words):
        if SCRIPT.search(word):
            return Launch(launcher=words[:i], script=word, arguments=words[i + 1:])
        if "pretrain_" in word and any(ch.isspace() for ch in word):  # sh -c "python pretrain_gpt.py ..."
            inner = _find_script(_split(word, word[:60]))
            if inner is not None:
                inner.launcher = words[:i] + inner.launcher
                return inner
    return None
