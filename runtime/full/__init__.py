"""simtree.runtime.full: the runtime's models and its one engine, from the tiny default to full
scale (random weights or a checkpoint's; docs/full_runtime.md).

    build.py           build_model(name or checkpoint folder), weight_bytes(shape), check_fits
    tiny.py            the tiny default checkpoint (runtime-tiny) and the command that writes it
    generate.py        generate: prompts decoded round by round, per-round stats and traces (simtree run)
    decode.py          decode_prompts: given prompts decoded live (simtree run --prompt-ids)
    qwen.py            Qwen3.6-style GDN hybrid + MTP layer, composed of kernels.layers.qwen
    v4_rank.py         one DeepSeek-V4-Flash expert-parallel rank + MTP layer, of kernels.layers.v4
    layers.py          the MTP layer's draft state
    drafting.py        EAGLE-style trees built on the device; the accepted path
    acceptance.py      live, trace replay and acceptance-model replay
    engine.py          FullEngine: rounds of draft / verify / catch-up / commit, CUDA graphs, timing
    rounds.py          the rounds driven from the host: run (begin, step, stats), RunStats, reads back
    layout.py          the buffers of one round shape (an engine switches between several per round)
    measure.py         full_run: measured against predicted (simtree run --model); repredict
    report.py          summary.csv / summary.md / predicted_vs_measured.png
    steps.py           the engine's own whole steps (verify + commit, draft + catch-up)
    lossless.py        speculative == plain greedy checks
    gpu_run.py         one bounded GPU session (scripts/full_gpu.sh)
    session_report.py  its home side: fit, plan, repredict, composed vs measured (scripts/full_report.sh)
"""
