"""simtree.runtime.full: the full-scale runtime (random weights, real sizes; docs/full_runtime.md).

    build.py        build_model(name), weight_bytes(shape), check_fits: the registry's models
    qwen.py         Qwen3.6-style GDN hybrid + MTP layer (kernels.gdn tree verify and commits)
    v4_rank.py      one DeepSeek-V4-Flash expert-parallel rank + MTP layer (kernels.v4)
    attention.py    tree attention over a KV cache plus ancestors (Triton kernel, torch form)
    layers.py       norms, RoPE, SwiGLU, routed experts, the MTP layer's draft state
    drafting.py     EAGLE-style trees built on the device; the accepted path
    acceptance.py   live, trace replay and acceptance-model replay
    engine.py       FullEngine: rounds of draft / verify / catch-up / commit, CUDA graphs, timing
    measure.py      full_run: measured against predicted (simtree run --model)
    report.py       summary.csv / summary.md / predicted_vs_measured.png
    steps.py        the engine's own steps for the profiler
    lossless.py     speculative == plain greedy checks
    gpu_run.py      one bounded GPU session (scripts/full_run_gpu.sh)
"""
