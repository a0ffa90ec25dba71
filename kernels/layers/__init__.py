"""simtree.kernels.layers: model layers built from the kernels (docs/layers.md).

The full runtime's models compose them and the profiler times them (variant ``layers``), so a
composed step is the sum of what the runtime runs.

    qwen.py        GDN mixer, gated attention, dense MLP, MTP layer; the round's metadata
    v4.py          V4 attention block on the kernels' device plans, the rank's MoE, MTP layer
    moe.py         routing and the grouped GEMMs of the routed experts
    fp8.py         block-scaled FP8 weights and GEMMs (fp8_kernel.py: Triton), the FP8 experts
    head.py        embedding, final norm + float32 logits, greedy argmax, draft top-k
    attention.py   tree attention over a KV cache plus ancestors (_attention_kernel.py: Triton)
    ops.py         the fused ops as custom ops (fused.py, fused_mhc.py: Triton; reference.py: torch forms)
    mhc.py         V4's hyper-connections (torch path, or the fused ops under the form v4_hc)
    rope.py        RoPE tables; weights.py: random weights from parameter specs
    opcount.py     the CPU proxy of a step's kernel launches
    forms.py       which form the ops run in (fused Triton or torch), set by callers
"""
