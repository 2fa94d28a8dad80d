"""A torchvision for vLLM's Qwen2-VL code in tests only, never in the package or the venv.

vLLM's Qwen2-VL / Qwen2.5-VL model code imports torchvision. On PyPI the only torchvision matching torch 2.13 is
a CUDA build; on a CPU machine it imports only when installed without its dependencies (``--no-deps``: it would
replace the CPU torch) and without its CUDA extension ``_C`` (which cannot load there). Its ``_meta_registrations``
then still registers fake kernels for the ops ``torchvision::nms`` / ``qnms`` that only ``_C`` defines, which
fails; the shim's ``sitecustomize.py`` defines the two op schemas (no kernels) just before that module is imported.

:func:`torchvision_shim` installs the wheel once into a directory under the system temp dir (or takes the one
``HYBRIDFLOW_TVSHIM`` names, e.g. prepared by ``.ci/run``) and returns it (a fresh install is checked to import
torchvision in a child process); a process that should see torchvision
gets it first on ``PYTHONPATH`` (child processes too: vLLM inspects models in a child process). The pytest process
itself never imports it: with torchvision importable transformers switches image processors to their torchvision
backend, which would change other tests.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Optional

import torch

SITECUSTOMIZE = '''"""Test shim (tests/helpers/tvshim.py): define torchvision's nms/qnms op schemas before its fake kernels."""
import sys


class _DefineTorchvisionOps:
    def find_spec(self, name, path=None, target=None):
        if name == "torchvision._meta_registrations":
            sys.meta_path.remove(self)
            import torch

            if not hasattr(torch.ops.torchvision, "nms"):
                lib = torch.library.Library("torchvision", "DEF")
                for op in ("nms", "qnms"):
                    lib.define(op + "(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
                sys.modules["_hybridflow_tvshim_lib"] = lib  # keep the library (and its definitions) alive
        return None


sys.meta_path.insert(0, _DefineTorchvisionOps())
'''


def matching_torchvision() -> str:
    """The torchvision release built against this torch (torch 2.N pairs with torchvision 0.(N+15))."""
    major, minor = (int(x) for x in torch.__version__.split("+")[0].split(".")[:2])
    if major != 2:
        raise RuntimeError(f"no known torchvision pairing for torch {torch.__version__}")
    return f"0.{minor + 15}.*"


def torchvision_shim() -> tuple[Optional[Path], str]:
    """``(directory, "")`` of a working shim, or ``(None, why)`` when the wheel cannot be had or imported."""
    named = os.environ.get("HYBRIDFLOW_TVSHIM")
    target = Path(named) if named else Path(tempfile.gettempdir()) / f"hybridflow-tvshim-torch{torch.__version__}"
    if not (target / "torchvision").is_dir():
        staging = Path(tempfile.mkdtemp(prefix="tvshim-", dir=target.parent))
        pip = [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(staging),
               f"torchvision=={matching_torchvision()}"]
        done = subprocess.run(pip, capture_output=True, text=True, timeout=600)
        if done.returncode:
            return None, f"pip could not install torchvision --no-deps: {done.stderr.strip()[-300:]}"
        (staging / "sitecustomize.py").write_text(SITECUSTOMIZE)
        check = subprocess.run([sys.executable, "-c", "import torchvision.transforms.v2.functional"],
                               env=shim_env(staging), capture_output=True, text=True, timeout=300)
        if check.returncode:
            return None, f"torchvision in {staging} does not import: {check.stderr.strip()[-300:]}"
        try:
            staging.rename(target)
        except OSError:  # another process made it first
            pass
    if not (target / "sitecustomize.py").is_file():  # a directory prepared by pip alone (.ci/run)
        (target / "sitecustomize.py").write_text(SITECUSTOMIZE)
    return target, ""


def shim_env(shim: Path, extra_paths: tuple[str, ...] = ()) -> dict:
    """This process's environment with ``shim`` (then ``extra_paths``) first on ``PYTHONPATH``."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(shim), *extra_paths, env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    return env
