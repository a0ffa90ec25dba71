"""Which stage of a round makes a host tensor under CUDA-graph capture: builds the tiny models'
engines for each runtime mode and prints every capture failure with its full traceback.
    python scripts/capture_check.py > $OUT/capture.log"""
import sys
import torch

from simtree.models import get_model
from simtree.planning.simulate import PolicySpec


def model_for(name, dtype):
    from simtree.runtime.full.lossless import make_predictable
    from simtree.runtime.full.qwen import QwenModel
    from simtree.runtime.full.v4_rank import V4Rank
    shape = get_model(name)
    model = (QwenModel if shape.family == "gdn_hybrid" else V4Rank)(shape, device="cuda", dtype=dtype, seed=1)
    make_predictable(model, 0.3)
    return model


def main():
    from simtree.acceptance.model import calibrate_linear, get_workload
    from simtree.costs.synthetic import synthetic_costs
    from simtree.runtime.full.acceptance import DraftScores, TraceReplay
    from simtree.runtime.full.drafting import round_shape
    from simtree.runtime.full.engine import FullEngine
    from simtree.runtime.full.steps import draft_step
    specs = {"linear": PolicySpec.from_dict("linear", {"budget": 4}),
             "eagle": PolicySpec.from_dict("eagle", {"num_steps": 3, "topk": 2, "budget": 6}),
             "best_first": PolicySpec.from_dict("best_first", {"budget": 6, "draft_depth": 3}),
             "cost_aware": PolicySpec.from_dict("cost_aware", {"max_budget": 10, "draft_depth": 3}),
             "batch_alloc": PolicySpec.from_dict("batch_alloc", {"max_budget_per_seq": 6, "draft_depth": 4})}
    costs = synthetic_costs(weights_us=0.0, per_token_us=10.0)
    failed = 0
    for name, dtype in (("tiny-gdn", torch.float32), ("tiny-v4", torch.bfloat16)):
        model = model_for(name, dtype)
        for label, spec in specs.items():
            try:
                rs = round_shape(spec)
                source = TraceReplay.fixed(2, 4, "cuda")
                source.scores = DraftScores(calibrate_linear(2.6, 4, spread=0.0), rs, "cuda", weights=[1.0])
                engine = FullEngine(model, rs, 4, 256, source, graphs=True, costs=costs)
                engine.capture()
            except Exception as exc:  # noqa: BLE001
                print(f"{name} {label}: BUILD FAILED {type(exc).__name__}: {exc}")
                failed += 1
                continue
            ok = engine.graphs is not None
            print(f"{name} {label}: {'captured' if ok else 'FAILED ' + str(engine.capture_error)}")
            if not ok:
                failed += 1
                print(engine.capture_traceback)
        for s, k in ((3, 1), (3, 2)):
            try:
                step = draft_step(model, 1, s, k, 64, tree_model=get_workload("gsm8k").acceptance)
            except Exception as exc:  # noqa: BLE001
                print(f"{name} draft_step s={s} k={k}: BUILD FAILED {type(exc).__name__}: {exc}")
                failed += 1
                continue
            ok = step.describe()["graphs"]
            print(f"{name} draft_step s={s} k={k}: {'captured' if ok else 'FAILED ' + str(step.engine.capture_error)}")
            if not ok:
                failed += 1
                print(step.engine.capture_traceback)
            step.close()
        sys.stdout.flush()
    print("failures:", failed)


if __name__ == "__main__":
    main()
