"""Maps the root folders kernels/, profiler/ and runtime/ to simtree.kernels etc.

Their bare names collide with packages on PyPI, so they install as subpackages of simtree
while staying at the root of the repository (docs/architecture.md).  Package data
(simtree/data/**) is listed in pyproject.toml and read through ``simtree.data.data_path``.
"""
from setuptools import find_packages, setup

ROOTS = {"simtree": "simtree", "simtree.kernels": "kernels",
         "simtree.profiler": "profiler", "simtree.runtime": "runtime"}

packages, package_dir = [], {}
for name, folder in ROOTS.items():
    package_dir[name] = folder
    packages.append(name)
    for sub in find_packages(where=folder):
        if name == "simtree" and sub.split(".")[0] in ("kernels", "profiler", "runtime"):
            continue
        packages.append(f"{name}.{sub}")
        package_dir[f"{name}.{sub}"] = f"{folder}/{sub.replace('.', '/')}"

setup(packages=packages, package_dir=package_dir)
