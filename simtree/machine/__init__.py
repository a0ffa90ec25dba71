"""The machine a profile or run happened on: the facts recorded beside a profile table
(:mod:`.metadata`: device, driver, library versions, host), a seconds-long probe of how fast
the host runs Python and torch right now (:mod:`.hostprobe`), which `simtree run` compares
with the profile's, the machine tables deployments run on (:mod:`.machines`: GPU memory,
links) and where the CUDA toolchain is (:mod:`.toolchain`: nvcc, the built kernels' cache).
"""
from simtree.machine.hostprobe import probe, ratio
from simtree.machine.metadata import collect_metadata, device_label, package_version

__all__ = ["collect_metadata", "device_label", "package_version", "probe", "ratio"]
