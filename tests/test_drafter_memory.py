"""The deployment memory check with the mode's drafter (simtree/deploy/drafter_memory.py): its
formula against what the block engine really allocates on a tiny model, for each drafter family
(the engine's buffers walked; the draft's peak counted tensor by tensor as it runs), and the
H100 case the out-of-sample runs met: Qwen3.6-27B at batch 64, context 1536 fits with the MTP
chain, not with the block drafter at D=16."""
import pytest
import torch

from simtree.deploy.drafter_memory import DrafterUse, drafter_memory, drafter_use
from simtree.deploy.memory import check_fits, check_rank_fits, largest_batch, rank_memory, smallest_fit
from simtree.errors import SimtreeError
from simtree.kernels.layers.drafters import DraftShape, draft_round, drafter_config, drafter_specs, threshold_keep
from simtree.models import get_model
from simtree.planning.modes import PolicySpec
from simtree.runtime.full.block_engine import make_engine
from simtree.runtime.full.drafting import round_shape

from full_helpers import FAMILIES, PROMPTS, PeakBytes, drafter_costs, reachable, tiny_model

SIZES = {"layers": 2, "cand_k": 32, "adapter_dim": 16, "markov_rank": 32}
SPECS = {"block": PolicySpec.from_dict("block", {"budget": 8, "block_len": 7}),
         "tfm": PolicySpec.from_dict("tfm", {"budget": 8, "width": 2, "block_len": 5}),
         "dspark": PolicySpec.from_dict("dspark", {"block_len": 6, "threshold": 0.05})}
MAX_LEN = 96


def _engine(name: str, family: str, batch: int = 3, rounds: int = 2):
    model = tiny_model(name, dtype=torch.float32)     # the tiny shapes' own dtype (fp32)
    engine = make_engine(model, round_shape(SPECS[family]), batch, MAX_LEN, costs=drafter_costs(), sizes=SIZES)
    if rounds:
        engine.prefill(PROMPTS[:batch])
        engine.run(rounds=rounds)
    return engine


def _owned_bytes(engine) -> int:
    """Bytes of every tensor a new block engine holds beyond what a new MTP-drafted engine of the
    same model holds (the attributes a FullEngine has not: the drafter's weights, caches, RoPE
    table and round inputs, the marginals...), each storage once, less the target's embedding and
    LM head (shared) and the drafter's RoPE table (left out of the formula: under a MB at full
    size)."""
    mtp = make_engine(engine.model, round_shape(PolicySpec.from_dict("linear", {"budget": 4})), engine.B, MAX_LEN)
    own = reachable([v for k, v in vars(engine).items() if k not in vars(mtp)], {})
    for t in (engine.model.w["embed"], engine.model.w["lm_head"], engine.drafter.rope.table):
        own.pop(t.untyped_storage().data_ptr())
    return sum(own.values())


@pytest.mark.parametrize("name", FAMILIES)
@pytest.mark.parametrize("family", ["block", "tfm", "dspark"])
def test_the_formula_counts_what_the_block_engine_allocates(name, family):
    """Weights and state: the bytes of the engine's drafter buffers to the byte (its caches hold
    max_len + 1 rows: the formula's at context max_len); round buffers: the verify's tapped
    features it keeps plus the draft's peak after the backbone, counted as it runs, to the byte
    too (the tiny shapes are fp32, so dspark's rows are its sum and logsumexp's copy)."""
    engine = _engine(name, family)
    B = engine.B
    use = drafter_use(SPECS[family], sizes=SIZES)
    mem = drafter_memory(tiny_model(name, dtype=torch.float32).shape, use, B, MAX_LEN)
    assert mem.weight_bytes + mem.state_bytes == _owned_bytes(_engine(name, family, B, rounds=0))

    d, rs = engine.drafter, engine.rs
    hid = d.hidden(engine.roots)
    with torch.no_grad(), PeakBytes() as peak:
        draft_round(rs.drafter, d.w, d.cfg, hid, engine.roots, engine.tree, DraftShape(rs.tree_nodes, rs.width),
                    keep=threshold_keep(0.05))
    measured = engine._pend.features.nbytes + peak.peak
    assert engine._pend.features.shape[0] == B * use.nodes
    assert mem.round_bytes == measured


@pytest.mark.parametrize("name", FAMILIES)
def test_the_mtp_layers_cache_is_what_an_mtp_engine_allocates_and_the_mtp_drafter_adds_nothing(name):
    """The MTP layer's cache the target's count holds (and the check takes off for a block
    drafter) is the one an MTP-drafted engine allocates, max_len + 1 rows: tiny-gdn's
    full-attention MTP layer, and tiny-v4's SWA one, whose latent cache holds every position,
    not its window; the MTP drafter itself adds nothing to the target's count."""
    model = tiny_model(name, dtype=torch.float32)
    engine = make_engine(model, round_shape(PolicySpec.from_dict("linear", {"budget": 4})), 3, MAX_LEN)
    mem = drafter_memory(model.shape, "block", 3, MAX_LEN)
    assert mem.mtp_state_bytes == engine.ds.kv.nbytes > 0
    if name == "tiny-v4":
        assert MAX_LEN > model.shape.v4["window"]
    mtp = drafter_memory(model.shape, PolicySpec.from_dict("eagle", {"num_steps": 3, "topk": 2, "budget": 6}), 3,
                         MAX_LEN)
    assert mtp.total_bytes == 0 and not mtp.use.block_drafter


def test_an_mtp_drafted_mode_adds_no_drafter_its_round_sizes_the_verify():
    """An MTP-drafted mode adds no drafter bytes and says no drafter (plain decoding takes the MTP
    layer's cache off: its engine does not allocate one); their round (verified nodes,
    accepted-path rows) sizes the verify buffers and the cache rows past the context; no mode
    named is the default round (8 nodes, 8 rows); a block drafter adds its own."""
    base = rank_memory("qwen3.6-27b", "tp=1", "h100", 64, 1536, rank_alone=True)
    assert base.verify.rows == 64 * 8 and base.cache_len == 1536 + 8
    by_mode = {}
    for spec in (PolicySpec.from_dict("none"), PolicySpec.from_dict("linear", {"budget": 4}),
                 PolicySpec.from_dict("eagle", {"num_steps": 6, "topk": 4, "budget": 16})):
        mem = by_mode[spec.name] = rank_memory("qwen3.6-27b", "tp=1", "h100", 64, 1536, rank_alone=True, drafter=spec)
        plain = spec.mode == "none"
        assert mem.drafter.total_bytes == -mem.drafter.mtp_state_bytes and (mem.drafter.mtp_state_bytes > 0) == plain
        assert "drafter" not in mem.summary() and ("plain decoding does not allocate" in mem.summary()) == plain
        assert mem.total_bytes == (mem.weight_bytes + mem.cache_bytes + mem.drafter.total_bytes
                                   + mem.verify.total_bytes + mem.machine.context_bytes)
    assert [by_mode[n].verify.rows for n in by_mode] == [64, 256, 1024]
    assert [by_mode[n].cache_len for n in by_mode] == [1537, 1540, 1543]
    assert by_mode["none"].total_bytes < by_mode["linear_d4"].total_bytes < by_mode["eagle_s6_k4_d16"].total_bytes
    block = rank_memory("qwen3.6-27b", "tp=1", "h100", 64, 1536, rank_alone=True, drafter="block")
    assert block.total_bytes > base.total_bytes and "of the block drafter" in block.summary()


def test_qwen_on_an_h100_at_batch_64_context_1536_refuses_block_d16_not_the_mtp_chain():
    """The out-of-sample H100 runs: the MTP chain (linear D=4) fits (73.2 GB of 80.8 usable); the
    block drafter at D=16 adds its 3.7 GB of weights, 2.1 GB of caches (1544 rows) and 0.9 GB of round
    buffers and is refused, naming the largest batch that fits with it."""
    chain = check_rank_fits("qwen3.6-27b", "tp=1", "h100", 64, 1536, drafter=PolicySpec.from_dict("linear", {"budget": 4}))
    assert chain.fits and chain.total_bytes / 1e9 == pytest.approx(73.2, abs=0.05)
    block_d16 = PolicySpec.from_dict("block", {"budget": 16, "block_len": 7})
    mem = rank_memory("qwen3.6-27b", "tp=1", "h100", 64, 1536, rank_alone=True, drafter=block_d16)
    assert [round(x / 1e9, 1) for x in (mem.drafter.weight_bytes, mem.drafter.state_bytes,
                                        mem.drafter.round_bytes)] == [3.7, 2.1, 0.9]
    with pytest.raises(SimtreeError, match="block drafter") as err:
        check_rank_fits("qwen3.6-27b", "tp=1", "h100", 64, 1536, drafter=block_d16)
    most = largest_batch("qwen3.6-27b", "tp=1", "h100", 1536, limit=64, rank_alone=True, drafter=block_d16)
    assert 0 < most < 64 and f"at most batch {most} fits" in str(err.value) and "\n" not in str(err.value)
    tfm = PolicySpec.from_dict("tfm", {"budget": 16, "width": 4, "block_len": 7})
    assert not rank_memory("qwen3.6-27b", "tp=1", "h100", 64, 1536, rank_alone=True, drafter=tfm).fits


def test_a_deployment_refused_with_its_drafter_names_the_deployment_that_holds_it():
    """check_fits with the mode's drafter: the MTP chain fits one H100 at batch 64, context 1536;
    the block drafter at D=16 does not, and the smallest deployment that fits is searched with the
    drafter too (tp=2, each rank holding its shard of the drafter), all in one line."""
    block_d16 = PolicySpec.from_dict("block", {"budget": 16, "block_len": 7})
    assert check_fits("qwen3.6-27b", "tp=1", "h100", 64, 1536).fits
    with pytest.raises(SimtreeError) as err:
        check_fits("qwen3.6-27b", "tp=1", "h100", 64, 1536, drafter=block_d16)
    msg = str(err.value)
    assert "\n" not in msg and "of the block drafter (block 7, 16 nodes:" in msg
    assert msg.endswith("it needs 2 GPUs (tp=2), asked for 1")
    two = smallest_fit("qwen3.6-27b", "h100", 64, 1536, drafter=block_d16)
    assert str(two.deployment) == "tp=2" and two.drafter.use == drafter_use(block_d16)
    assert 0 < two.drafter.weight_bytes < rank_memory("qwen3.6-27b", "tp=1", "h100", 64, 1536,
                                                      drafter=block_d16).drafter.weight_bytes


def test_bad_drafters_are_one_line():
    with pytest.raises(SimtreeError, match="unknown drafter 'medusa'"):
        drafter_use("medusa")
    with pytest.raises(SimtreeError, match="unknown size"):
        DrafterUse("block", sizes=(("heads", 2),))
    with pytest.raises(SimtreeError, match="block_len"):
        DrafterUse("block", block_len=0)


@pytest.mark.parametrize("model", ["qwen3.6-27b", "deepseek-v4-flash"])
@pytest.mark.parametrize("family", ["block", "tfm", "dspark"])
def test_the_full_size_weights_are_the_kernels_drafter_specs(model, family):
    """At full size (no allocation): the formula's weights are the element count of the weights
    the kernels build for the drafter (``drafter_specs`` of ``drafter_config``, without the shared
    embedding and LM head) at the shape's dtype; V4's drafter is the dense stand-in of its rank."""
    import math

    shape = get_model(model).shard("ep=8" if model == "deepseek-v4-flash" else "tp=1")
    specs = drafter_specs(drafter_config(shape, family), with_ends=False)
    assert drafter_memory(shape, family, 8, 4096).weight_bytes == 2 * sum(math.prod(s.shape) for s in specs)
