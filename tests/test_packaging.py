"""The wheel works on its own: presets and workloads load from the installed package (DESIGN §5).

Builds a wheel from this checkout, installs it (``--no-deps``) into a fresh virtual environment
in ``tmp_path`` and runs the installed ``hzpsim`` from a folder outside the checkout.

Dependencies: installing them from the registry takes ~35 s; instead the fresh venv gets a
``.pth`` line naming the test interpreter's site-packages folder (~1 s in all). A folder added
by a ``.pth`` line is put on ``sys.path`` but its own ``.pth`` files are not processed, so the
editable install of the checkout stays invisible; the test asserts that too.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.slow


def _run(
    argv: list[str], cwd: Path, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess:
    result = subprocess.run(
        argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=300, check=False
    )
    assert result.returncode == 0, f"{argv} failed:\n{result.stdout}\n{result.stderr}"
    return result


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> tuple[Path, Path, dict[str, str]]:
    """(venv folder, a work folder outside the checkout, environment for running hzpsim)."""
    root = tmp_path_factory.mktemp("packaging")
    wheels = root / "wheels"
    build = [sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(wheels), "."]
    if importlib.util.find_spec("hatchling") is not None:
        build.insert(4, "--no-build-isolation")  # offline: use the hatchling already installed
    _run(build, cwd=REPO)
    (wheel,) = wheels.glob("hzpsim-*.whl")

    venv = root / "venv"
    _run([sys.executable, "-m", "venv", "--without-pip", str(venv)], cwd=root)
    python = venv / "bin" / "python"
    purelib = Path(
        _run(
            [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
            cwd=root,
        ).stdout.strip()
    )
    deps = {sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]}
    (purelib / "_hzpsim_test_deps.pth").write_text("\n".join(sorted(deps)) + "\n")
    _run(
        [
            sys.executable,
            "-m",
            "pip",
            "--python",
            str(python),
            "install",
            "--no-deps",
            "-q",
            str(wheel),
        ],
        cwd=root,
    )

    work = root / "elsewhere"
    work.mkdir()
    env = {
        k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME")
    }
    env["HZPSIM_CONFIG_DIR"] = str(root / "empty-config")  # no user presets either
    env["PATH"] = f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}"
    return venv, work, env


def test_installed_package_is_the_wheel_not_the_checkout(installed):
    venv, work, env = installed
    probe = (
        "import json, sys, hzpsim, hzpsim.presets as p; "
        "print(json.dumps({'file': hzpsim.__file__, 'path': sys.path, "
        "'dirs': [str(d) for k in ('workloads', 'topologies') for d in p.preset_dirs(k)]}))"
    )
    info = json.loads(_run([str(venv / "bin" / "python"), "-c", probe], cwd=work, env=env).stdout)
    assert Path(info["file"]).resolve().is_relative_to(venv.resolve())
    assert str(REPO) not in info["path"]
    assert info["dirs"], "no preset folder found in the installed package"
    for folder in info["dirs"]:
        assert Path(folder).resolve().is_relative_to(venv.resolve()), folder
        assert "_presets" in folder


def test_installed_hzpsim_list(installed):
    venv, work, env = installed
    out = _run([str(venv / "bin" / "hzpsim"), "list"], cwd=work, env=env).stdout
    for name in ("dgx-h100", "hzp-npu", "frontier", "tiny-dense", "llama2-70b", "zero", "npu-910b"):
        assert name in out


def test_installed_hzpsim_run_json(installed):
    venv, work, env = installed
    argv = [
        str(venv / "bin" / "hzpsim"),
        "run",
        "--set",
        "model=tiny-dense",
        "--set",
        "cluster.num_nodes=1",
        "--set",
        "training.global_batch_size=8",
        "--set",
        "strategy.name=zero",
        "--json",
    ]
    result = _run(argv, cwd=work, env=env)
    reports = json.loads(result.stdout)
    reports = reports if isinstance(reports, list) else [reports]
    assert reports
    from hzpsim.run import run_choice
    from hzpsim.scenario import load_scenario

    sc = load_scenario(None, [argv[i + 1] for i, a in enumerate(argv) if a == "--set"])
    in_tree = run_choice(sc, sc.strategies[0])
    for report in reports:
        assert report["num_devices"] == 8
        # the installed wheel predicts exactly what the checkout does
        assert report["step_time_s"] == pytest.approx(in_tree["step_time_s"], rel=1e-12)
        assert report["memory_capacity_bytes"] == pytest.approx(81559 * 2**20)  # dgx-h100: the H100 as the driver reports it
