"""Maps the root folders kernels/, profiler/ and runtime/ to simtree.kernels etc.

Their bare names collide with packages on PyPI, so they install as subpackages of simtree
while staying at the root of the repository (docs/architecture.md).  Package data
(simtree/data/**) is listed in pyproject.toml and read through ``simtree.data.data_path``.
Folders are found as namespace packages, so a folder that holds only package data
(``kernels/gdn/cuda``: the CUDA sources nvcc builds on first use) is listed too and
setuptools installs its files without warning that an importable folder is left out.
"""
from setuptools import find_namespace_packages, setup

ROOTS = {"simtree": "simtree", "simtree.kernels": "kernels",
         "simtree.profiler": "profiler", "simtree.runtime": "runtime"}

packages, package_dir = [], {}
for name, folder in ROOTS.items():
    package_dir[name] = folder
    packages.append(name)
    for sub in find_namespace_packages(where=folder, exclude=["__pycache__", "*.__pycache__"]):
        if name == "simtree" and sub.split(".")[0] in ("kernels", "profiler", "runtime"):
            continue
        packages.append(f"{name}.{sub}")
        package_dir[f"{name}.{sub}"] = f"{folder}/{sub.replace('.', '/')}"

setup(packages=packages, package_dir=package_dir)
