"""Kernel benchmarks and launch-tuning harnesses (GPU first, CPU smoke runs through Triton's
interpreter) and the reports built from their CSVs.

    bench_gdn / tune_gdn / report_gdn    GDN tree verify + commit: benchmark, launch sweeps, report
    bench_v4 / report_v4                 DeepSeek-V4 tree verify: benchmark, report
    gdn_floor / v4_floor / floor_table   GDN and V4 layer verify against their memory floor;
                                         v4_floor_model: the V4 layer's analytic memory and compute floor
    gdn_util, report_util                their shared inputs, timers and markdown tables

Each is a ``python -m simtree.profiler.bench.<name>`` command; they pass the kernels typed
launch configs (``simtree.kernels.gdn.VerifyLaunch`` / ``CommitLaunch``).
"""
