"""A round captured in a CUDA graph may neither read the device on the host (``.item()``, a
0-d tensor used as an index, ``nonzero``) nor copy host data to the device: capture refuses
both (the GPU says "operation not permitted when stream is capturing").  On the CPU no graph is
captured, so these tests run every stage of a round for each runtime mode and model family
under a dispatch mode that records such operations: the GPU's capture failures are caught here
first."""
import traceback

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from simtree.acceptance.model import calibrate_linear
from simtree.planning.modes import RUNTIME_MODES
from simtree.planning.simulate import PolicySpec
from simtree.runtime.full.acceptance import DraftScores, TraceReplay
from simtree.runtime.full.drafting import round_shape
from simtree.runtime.full.block_engine import make_engine
from simtree.runtime.full.engine import FullEngine

from full_helpers import drafter_costs, tiny_model

# host reads: _local_scalar_dense (item, bool, a 0-d index), the data-dependent shapes; host
# data: lift_fresh of more than one element (torch.tensor / as_tensor of host values; a Python
# scalar assigned into a tensor is a 0-d lift, which CUDA fills without a copy)
HOST_READS = {"_local_scalar_dense", "nonzero", "masked_select", "_unique2", "unique_consecutive",
              "unique_dim", "repeat_interleave"}

SPECS = {"none": PolicySpec.from_dict("none", {}),
         "linear": PolicySpec.from_dict("linear", {"budget": 4}),
         "eagle": PolicySpec.from_dict("eagle", {"num_steps": 3, "topk": 2, "budget": 6}),
         "best_first": PolicySpec.from_dict("best_first", {"budget": 6, "draft_depth": 3}),
         "cost_aware": PolicySpec.from_dict("cost_aware", {"max_budget": 10, "draft_depth": 3}),
         "batch_alloc": PolicySpec.from_dict("batch_alloc", {"max_budget_per_seq": 6, "draft_depth": 4}),
         "block": PolicySpec.from_dict("block", {"budget": 8, "block_len": 7}),
         "tfm": PolicySpec.from_dict("tfm", {"budget": 8, "width": 2, "block_len": 5}),
         "dspark": PolicySpec.from_dict("dspark", {"block_len": 7})}
TINY_DRAFTER = {"sizes": {"layers": 1, "cand_k": 32, "adapter_dim": 16, "markov_rank": 32}}


# the CPU's own backends, which the GPU does not run: the GDN commit in torch (the GPU's is a
# Triton kernel); a repeat_interleave given its output_size reads nothing on CUDA (CPU: nonzero)
CPU_ONLY_FUNCTIONS = {"_commit_torch"}


def _cpu_only(name: str, frames) -> bool:
    if any(f.name in CPU_ONLY_FUNCTIONS for f in frames):
        return True
    return name in ("nonzero", "repeat_interleave") and bool(frames) and "output_size" in (frames[-1].line or "")


class HostTraffic(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.hits = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func._schema.name.split("::")[-1]
        if name in HOST_READS or (name == "lift_fresh" and args and args[0].numel() > 1):
            frames = [f for f in traceback.extract_stack()[:-1] if "/torch/" not in f.filename]
            if _cpu_only(name, frames):
                return func(*args, **(kwargs or {}))
            where = frames[-1] if frames else None
            self.hits.append(f"{name} at {where.filename}:{where.lineno} ({where.line})" if where else name)
        return func(*args, **(kwargs or {}))


def test_every_runtime_mode_is_listed():
    assert set(SPECS) == set(RUNTIME_MODES)


@pytest.mark.parametrize("name", ["tiny-gdn", "tiny-v4"])
def test_rounds_neither_read_nor_copy_host_data(name):
    model = tiny_model(name, dtype=torch.float32)
    costs = drafter_costs()
    found = {}
    for label, spec in SPECS.items():
        rs = round_shape(spec)
        source = TraceReplay.fixed(2, 4, "cpu")
        source.scores = DraftScores(calibrate_linear(2.6, 4, spread=0.0), rs, "cpu", weights=[1.0])
        engine = make_engine(model, rs, 4, 128, source, graphs=False, costs=costs,
                             **(TINY_DRAFTER if rs.block_drafter else {}))
        engine.fill_context(24, seed=1)
        with torch.no_grad():
            for _, stage in engine._stages():      # warm-up, as capture() runs it: caches fill
                stage()
            guard = HostTraffic()
            with guard:
                for _, stage in engine._stages():
                    stage()
        if guard.hits:
            found[label] = sorted(set(guard.hits))
    assert not found, found


@pytest.mark.parametrize("name", ["tiny-gdn", "tiny-v4"])
def test_plain_rounds_of_a_multi_shape_engine_neither_read_nor_copy_host_data(name):
    """The controller's plain tier keeps the MTP layer's rows in a buffer at a device-held row
    index (its catch-up runs outside the graphs, when drafting resumes)."""
    model = tiny_model(name, dtype=torch.float32)
    engine = FullEngine(model, round_shape(SPECS["none"]), 4, 128, TraceReplay.fixed(2, 4, "cpu"), graphs=False,
                        shapes=[round_shape(SPECS["eagle"]), round_shape(SPECS["linear"])], lag_rows=2)
    engine.fill_context(24, seed=1)
    with torch.no_grad():
        for _ in range(3):                      # warm-up, as capture() runs it: past the buffer's end
            engine._plain()
        guard = HostTraffic()
        with guard:
            engine._plain()
    assert engine.lag.at.tolist() == [0] and not guard.hits, guard.hits


@pytest.mark.parametrize("name", ["tiny-gdn", "tiny-v4"])
def test_every_catch_up_bucket_neither_reads_nor_copies_host_data(name):
    """The drafter's catch-up is captured per row bucket (runtime/full/lag.py): its body, with the
    waiting count on the device, is capturable at every bucket."""
    model = tiny_model(name, dtype=torch.float32)
    engine = FullEngine(model, round_shape(SPECS["none"]), 2, 128, graphs=False,
                        shapes=[round_shape(SPECS["eagle"])])
    engine.fill_context(24, seed=1)
    lag, found = engine.lag, {}
    lag.count.fill_(1)
    with torch.no_grad():
        for b in lag.buckets:
            lag._run(model, engine.ds, engine._chain_bits, engine._set_first, b)   # bits built, as prepare's warm-up
            guard = HostTraffic()
            with guard:
                lag._run(model, engine.ds, engine._chain_bits, engine._set_first, b)
            if guard.hits:
                found[b] = sorted(set(guard.hits))
    assert not found, found


def test_every_tensor_a_round_leaves_on_the_engine_is_a_listed_stage_output():
    """capture() binds each round shape's stage outputs again after its replays, from the list
    FullEngine.STAGE_OUTPUTS: a tensor a stage leaves on the engine that the list misses would be
    read from another shape's graphs; a listed name no stage writes is stale."""
    model = tiny_model("tiny-gdn", dtype=torch.float32)
    costs = drafter_costs()
    unlisted, left = {}, set()
    for label, spec in SPECS.items():
        rs = round_shape(spec)
        engine = make_engine(model, rs, 4, 64, TraceReplay.fixed(2, 4, "cpu"), graphs=False, costs=costs,
                             trace_topk=4, **(TINY_DRAFTER if rs.block_drafter else {}))
        engine.fill_context(8, seed=1)
        before = dict(vars(engine))
        with torch.no_grad():
            for _, stage in engine._stages():
                stage()
        new = {k for k, v in vars(engine).items() if isinstance(v, (torch.Tensor, tuple)) and before.get(k) is not v}
        if new - set(FullEngine.STAGE_OUTPUTS):
            unlisted[label] = sorted(new - set(FullEngine.STAGE_OUTPUTS))
        left |= new
    assert not unlisted, unlisted
    assert left == set(FullEngine.STAGE_OUTPUTS)
