"""The target's verify round in the deployment memory check (simtree/deploy/verify_memory.py): its
formula against what the full runtime's verify and LM head allocate on the tiny models (the
pending a verify hands its commit walked tensor by tensor; the head's and a layer's MLP / MoE
peak counted as they run), and the whole check against every logged H100 run
(runtime/full/memory_runs.py): the runs it gets wrong are exactly the three points
docs/deployments.md names."""
from pathlib import Path

import pytest
import torch

from simtree.deploy.memory import rank_memory
from simtree.deploy.verify_memory import _layer_peak, kept_row_bytes, verify_round
from simtree.kernels.layers import qwen as qwen_layers, v4 as v4_layers
from simtree.planning.modes import PolicySpec
from simtree.runtime.full.block_engine import make_engine
from simtree.runtime.full.drafting import round_shape
from simtree.runtime.full.memory_runs import check_runs, disagreements, logged_runs, write_runs_doc

from full_helpers import FAMILIES, PROMPTS, PeakBytes, reachable, tiny_model

ROOT = Path(__file__).resolve().parents[1]
SPECS = [PolicySpec.from_dict("linear", {"budget": 4}), PolicySpec.from_dict("eagle", {"num_steps": 3, "topk": 2,
                                                                                       "budget": 6})]


def _verified(name: str, spec, batch: int = 3):
    """(model, engine, hidden, pending) of one verify after two rounds of ``spec``."""
    model = tiny_model(name, dtype=torch.float32)
    engine = make_engine(model, round_shape(spec), batch, 96)
    engine.prefill(PROMPTS[:batch])
    engine.run(rounds=2)
    with torch.no_grad():
        hidden, pend = model.verify(engine.st, engine.tree.tokens, engine.tree.parents)
    return model, engine, hidden, pend


def _bytes(obj) -> int:
    return sum(reachable(obj, {}).values())


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.name)
@pytest.mark.parametrize("name", FAMILIES)
def test_what_a_verify_keeps_for_its_commit_is_the_formulas(name, spec):
    """Per layer, the bytes of the pending a verify hands the commit (the round's metadata left
    out): tiny-gdn's to the byte (its GDN cache's tree metadata aside); tiny-v4's at most its
    round's compressed entries over (counted at one a row) and never under; the hidden rows to
    the byte."""
    model, engine, hidden, pend = _verified(name, spec)
    T = hidden.shape[0]
    assert T == engine.B * round_shape(spec).nodes
    rows = kept_row_bytes(model.shape)
    if name == "tiny-gdn":
        for i, layer in pend.layers.items():
            meta = _bytes(layer[2].meta) if isinstance(layer, tuple) else 0
            assert _bytes(layer) - meta == T * rows[i]
    else:
        v = model.shape.v4
        for i, scratch in pend.scratch.items():
            over = T * rows[i] - _bytes(scratch)
            entries = T * (int(v["head_dim"]) + int(v["index_head_dim"])) * 4
            assert 0 <= over <= entries
    r = verify_round(model.shape, T)
    assert r.hidden_bytes == hidden.nbytes and r.kept_bytes == T * sum(rows)


@pytest.mark.parametrize("name", FAMILIES)
def test_the_head_and_a_layers_buffers_are_the_formulas(name):
    """The LM head's peak (float32 logits over the vocabulary and the argmax; V4's streams
    collapsed and normed before it) and a layer's MLP (tiny-gdn) or MoE dispatch (tiny-v4) peak,
    counted as they run: the formula is never under, over by at most one [T, h] row block (V4's
    collapse) or the router's expert table."""
    model, engine, hidden, _ = _verified(name, SPECS[0])
    T, h, dt = hidden.shape[0], model.shape.hidden, 4
    with torch.no_grad(), PeakBytes() as head:
        model.greedy(hidden)
    x = torch.randn(T, h)
    with torch.no_grad(), PeakBytes() as layer:
        if name == "tiny-gdn":
            qwen_layers.mlp(model._layer_w[1], model.d, x)
        else:
            v4_layers.moe(model._layer_w[3], model.d, x, engine.tree.tokens.reshape(-1))
    V = model.shape.vocab
    logits = T * V * 4 + T * 8
    if name == "tiny-gdn":
        assert head.peak == logits and layer.peak == _layer_peak(model.shape, T, dt)
    else:
        assert 0 <= logits + 2 * T * h * dt - head.peak <= T * h * dt
        assert 0 <= _layer_peak(model.shape, T, dt) - layer.peak <= int(model.shape.mlp["n_experts"]) * 4
    assert verify_round(model.shape, T).peak_bytes == max(logits + (2 * T * h * dt if name == "tiny-v4" else 0),
                                                          _layer_peak(model.shape, T, dt))


def test_plain_decoding_keeps_nothing_for_a_commit_and_holds_no_mtp_cache():
    """A plain round (Qwen's decode) commits as it goes, and its engine allocates no MTP layer
    state: the check counts neither; the MTP chain's round counts both."""
    model = tiny_model("tiny-gdn", dtype=torch.float32)
    plain = make_engine(model, round_shape(PolicySpec.from_dict("none")), 3, 96)
    assert plain.ds is None
    mem = rank_memory(model.shape, "tp=1", "h100", 3, 80, rank_alone=True, drafter=PolicySpec.from_dict("none"),
                      cache_len=96)
    chain = rank_memory(model.shape, "tp=1", "h100", 3, 80, rank_alone=True, drafter=SPECS[0], cache_len=96)
    assert mem.verify.kept_bytes == 0 and mem.drafter.mtp_state_bytes == make_engine(
        model, round_shape(SPECS[0]), 3, 96).ds.kv.nbytes
    assert chain.verify.kept_bytes > 0 and chain.drafter.total_bytes == 0
    assert mem.total_bytes == (mem.weight_bytes + mem.cache_bytes - mem.drafter.mtp_state_bytes
                               + mem.verify.total_bytes + mem.machine.context_bytes)


def test_the_check_against_every_logged_h100_run():
    """Every logged H100 run that ran or ran out of memory: the check refuses those that ran out
    of memory and accepts those that ran, but for three points' runs (docs/deployments.md: plain
    decoding at 82.7 GB and block D=8 at 81.0 GB ran; EAGLE D=16 at batch 48, context 4096, ran
    out of memory at 80.5 GB counted), each within 2 GB of the usable memory."""
    checked = check_runs(logged_runs(ROOT))
    assert len(checked) > 500 and sum(r.out_of_memory for r, _ in checked) >= 30
    wrong = {(r.model, r.context_len, r.batch_size, r.spec.name, r.out_of_memory) for r, _ in disagreements(checked)}
    assert wrong == {("qwen3.6-27b", 4096, 64, "none", False), ("qwen3.6-27b", 1536, 64, "block_d8_p7", False),
                     ("qwen3.6-27b", 4096, 48, "eagle_s6_k4_d16", True)}
    assert all(abs(m.total_bytes - m.usable_bytes) < 2e9 for _, m in disagreements(checked))


def test_the_runs_table_in_the_docs_is_current():
    assert write_runs_doc(ROOT / "docs/deployments.md", ROOT, write=False), \
        "docs/deployments.md: run python -m simtree.runtime.full.memory_runs docs/deployments.md"


def test_a_doc_without_the_block_or_a_missing_archive_is_one_line(tmp_path):
    from simtree.errors import SimtreeError
    doc = tmp_path / "doc.md"
    doc.write_text("no table here\n")
    with pytest.raises(SimtreeError, match="no <!-- memory-runs:start --> ... <!-- memory-runs:end --> block"):
        write_runs_doc(doc, ROOT)
    with pytest.raises(SimtreeError, match=r"oos_runs.tgz: cannot read its runs") as err:
        logged_runs(tmp_path)
    assert "\n" not in str(err.value)
