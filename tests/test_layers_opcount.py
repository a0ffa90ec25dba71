"""Ops per layer, pinned: the CPU proxy of a step's kernel launches (kernels/layers/opcount.py;
one fused op or GEMM = one launch on a GPU, a kernel core = one), counted on tiny models whose
layer lists differ by one layer, so a regrowth of the per-layer book-keeping fails here.

At Qwen3.6-27B's 48 GDN + 16 attention layers these pins give 48 x 12 + 16 x 13 = 784 launches
in the layers of a decode step, against 5,850 kernels the previous runtime launched (H200
torch.profiler of one plain step, /work/tools/qwen_kernels_breakdown.csv)."""
import dataclasses
from collections import Counter

import pytest
import torch

from simtree.kernels.layers.forms import forms
from simtree.kernels.layers.opcount import OpCounter
from simtree.models import get_model
from simtree.runtime.full.qwen import QwenModel
from simtree.runtime.full.v4_rank import V4Rank

torch.set_num_threads(1)

GDN_VERIFY = {"simtree.rms_norm": 2, "aten.mm": 2, "simtree.tree_conv": 1, "simtree.gdn_gates": 1,
              "simtree.gated_rms_norm": 1, "aten.addmm": 2, "simtree.silu_mul": 1}
ATTN_VERIFY = {"simtree.rms_norm": 2, "aten.mm": 2, "simtree.norm_rope": 1, "simtree.norm_rope_into": 1, "aten.copy_": 1,
               "simtree.sigmoid_mul": 1, "aten.addmm": 2, "simtree.silu_mul": 1}
PINS = {  # kind: {stage: (ops outside the cores, cores)}
    "gdn": {"verify": (GDN_VERIFY, {"gdn_tree_verify": 1}), "commit": ({"simtree.gather_rows": 1}, {"gdn_tree_commit": 1}),
            "decode": ({**GDN_VERIFY, "simtree.gather_rows": 1}, {"gdn_decode": 1})},
    "attn": {"verify": (ATTN_VERIFY, {"tree_attention": 1}), "commit": ({"aten.index_copy_": 1}, {}),
             "decode": ({**ATTN_VERIFY, "aten.index_copy_": 1}, {"tree_attention": 1})},
}
# V4 layers: launches per layer (attention projections, RoPE, output, the MoE's routing and
# grouped GEMMs); the ops are the kernels' and the MoE's, so the pins are totals
# (V4 with its hyper-connections (2 x mix, weights op, collapse, expand) and V4 routing: 29 more
# launches a layer than without; the Sinkhorn iterations are one op, simtree::hc_weights)
V4_PINS = {"swa": {"verify": 61, "commit": 1, "decode": 62}, "csa": {"verify": 64, "commit": 1, "decode": 65},
           "hca": {"verify": 61, "commit": 1, "decode": 62}}
# under the form v4_hc="fused" a block's hc_pre is three ops (mix partials, weights, collapse) and
# its hc_post one (merge): 8 a layer against the torch path's 24 on this fp32 model (32 on a bf16
# GPU, where the torch path adds four casts a block)
V4_HC_OPS = {"simtree.hc_mix_partials": 2, "simtree.hc_weights_partials": 2, "simtree.hc_collapse": 2,
             "simtree.hc_merge": 2}
V4_HC_FUSED_SAVES = 16
# per-step extras outside the layers (the round's metadata, most of it the kernels' tree
# metadata / V4 device plans, embedding, head): bounded, not pinned (measured 94 / 30 / 26 and
# 392 / 170 / 526)
STEP_BOUND = {"tiny-gdn": {"verify": 100, "commit": 33, "decode": 30},
              "tiny-v4": {"verify": 410, "commit": 180, "decode": 550}}


def _model(name, kinds):
    shape = dataclasses.replace(get_model(name), layer_kinds=tuple(kinds))
    return (QwenModel if shape.family == "gdn_hybrid" else V4Rank)(shape, "cpu", torch.float32, 0)


def _counts(model, B=2, n=4) -> dict:
    """{stage: OpCounter} of one verify (+ greedy pick), its commit and a decode step, each
    counted on its second run (the first fills the per-shape caches)."""
    st = model.new_state(B, 40)
    st.lengths.fill_(9)
    tokens = torch.randint(0, 100, (B, n), generator=torch.Generator().manual_seed(0))
    parents = torch.tensor([[-1, 0, 0, 1]] * B)
    accepted = torch.tensor([3, 1])

    def verify():
        h, pend = model.verify(st, tokens, parents)
        model.greedy(h)
        return pend

    stages = {"verify": verify, "commit": lambda: model.commit(st, verify(), accepted),
              "decode": lambda: model.greedy(model.decode(st, tokens[:, 0]))}
    out = {}
    for name, fn in stages.items():
        fn()
        pend = verify() if name == "commit" else None
        with OpCounter() as c:
            model.commit(st, pend, accepted) if name == "commit" else fn()
        out[name] = c
    return out


def _delta(a: OpCounter, b: OpCounter):
    ops, cores = Counter(b.ops), Counter(b.cores)
    ops.subtract(a.ops)
    cores.subtract(a.cores)
    return {k: v for k, v in ops.items() if v}, {k: v for k, v in cores.items() if v}


@pytest.mark.parametrize("kind", ["gdn", "attn"])
def test_qwen_layer_ops_are_pinned(kind):
    base = _counts(_model("tiny-gdn", ["gdn", "attn"]))
    more = _counts(_model("tiny-gdn", ["gdn", "attn", kind]))
    for stage, (ops, cores) in PINS[kind].items():
        assert _delta(base[stage], more[stage]) == (ops, cores), stage


@pytest.mark.parametrize("kind", ["swa", "csa", "hca"])
def test_v4_layer_launches_are_pinned(kind):
    with forms(v4_hc="torch"):          # the pins are the torch path's, whatever the runtime's default
        base = _counts(_model("tiny-v4", ["swa", "csa", "hca"]))
        more = _counts(_model("tiny-v4", ["swa", "csa", "hca", kind]))
    for stage, launches in V4_PINS[kind].items():
        ops, cores = _delta(base[stage], more[stage])
        assert sum(ops.values()) + sum(cores.values()) == launches, (stage, ops, cores)
        assert all(v > 0 for v in ops.values()), ops      # nothing per layer that a round could share


@pytest.mark.parametrize("kind", ["swa", "csa", "hca"])
def test_v4_layer_launches_drop_with_fused_hyper_connections(kind):
    with forms(v4_hc="fused"):            # against the torch path's pins above
        base = _counts(_model("tiny-v4", ["swa", "csa", "hca"]))
        more = _counts(_model("tiny-v4", ["swa", "csa", "hca", kind]))
    for stage, launches in V4_PINS[kind].items():
        ops, cores = _delta(base[stage], more[stage])
        saved = V4_HC_FUSED_SAVES if stage != "commit" else 0
        assert sum(ops.values()) + sum(cores.values()) == launches - saved, (stage, ops, cores)
        if saved:
            assert {k: ops.get(k) for k in V4_HC_OPS} == V4_HC_OPS and "simtree.hc_weights" not in ops


@pytest.mark.parametrize("name", ["tiny-gdn", "tiny-v4"])
def test_step_extras_outside_the_layers_stay_bounded(name):
    model = _model(name, get_model(name).layer_kinds)
    counts = _counts(model)
    per_layer = PINS if name == "tiny-gdn" else None
    for stage, c in counts.items():
        layers = sum(sum(PINS[k][stage][0].values()) + sum(PINS[k][stage][1].values()) for k in model.kinds) \
            if per_layer else sum(V4_PINS[k][stage] for k in model.kinds)
        assert c.launches - layers <= STEP_BOUND[name][stage], (stage, c.launches - layers)
