"""The GDN commit by the dtype of the verify's u buffer and of the commit's products, on the GPU:
for each shape the verify runs with u in fp32 and in bf16 (``u_cache_bf16``), then the commit
(each tree's deepest node accepted) is timed with CUDA graphs for fp32 products on fp32 u, and
fp32 / bf16 products (``dot16``) on bf16 u; each committed state's relative error against the
float64 sequential decoding of the accepted paths is printed beside it (Qwen3.6-27B shapes, bf16
inputs, the benchmark's depth-first trees; the committed state of one call per variant).

    python3 scripts/gdn_commit_times.py [--shapes 16:32,16:128,64:64,64:128] > commit_times.txt
"""
import argparse

import torch

from simtree.kernels.gdn import gdn_accepted_paths_ref, tree_meta
from simtree.kernels.gdn._launch import CommitLaunch, VerifyLaunch
from simtree.kernels.gdn._launched import launched_commit, launched_verify
from simtree.profiler.bench.gdn_util import QWEN36, graph_time_us, shape_inputs, shape_trees

KEYS = ("q", "k", "v", "g", "beta", "state", "parents", "cu_nodes")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="16:32,16:64,16:128,64:32,64:64,64:128")
    ap.add_argument("--replays", type=int, default=20)
    ap.add_argument("--tiny", action="store_true", help="tiny heads on the CPU (a smoke run)")
    args = ap.parse_args()
    dev = "cpu" if args.tiny else "cuda"
    if not args.tiny and not torch.cuda.is_available():
        raise SystemExit("gdn_commit_times times the commit on a CUDA GPU; none is visible")
    dims = dict(H=2, HV=4, K=16, V=32) if args.tiny else {k: QWEN36[k] for k in ("H", "HV", "K", "V")}
    name = "cpu" if args.tiny else torch.cuda.get_device_name()
    print(f"# {name}, torch {torch.__version__}; commit us (CUDA graph "
          f"median), rel err vs float64 sequential decoding of the accepted paths")
    for shape in args.shapes.split(","):
        b, n = map(int, shape.split(":"))
        trees, _, _ = shape_trees(b, n, 0, "dfs")
        copies = shape_inputs(b, n, 0, dims, order="dfs", trees=trees, max_copies=8, device=dev)
        meta = tree_meta(copies[0]["parents"], copies[0]["cu_nodes"], depth_first=True)
        acc = torch.as_tensor(copies[0]["tb"].deepest_nodes, device=dev)
        # float64 ground truth: each tree's accepted root path decoded token by token
        truth = gdn_accepted_paths_ref(*(copies[0][k].double().cpu() for k in KEYS[:6]), trees,
                                       copies[0]["cu_nodes"].cpu(), acc.cpu())
        for ucache, dot16 in ((0, 0), (1, 0), (1, 1)):
            verify = VerifyLaunch(backend="triton", u_cache_bf16=ucache)
            commit = CommitLaunch(dot16=dot16)
            caches = [launched_verify(*(c[k] for k in KEYS), launch=verify, meta=meta,
                                      check=False)[1] for c in copies]
            S = copies[0]["state"].clone()
            launched_commit(S, copies[0]["k"], caches[0], copies[0]["parents"],
                            copies[0]["cu_nodes"], acc, check=False, launch=commit)
            err = float((S.double().cpu() - truth).abs().max() / truth.abs().max())
            states = [c["state"].clone() for c in copies]
            t = graph_time_us([lambda c=c, ca=ca, s=s: launched_commit(
                s, c["k"], ca, c["parents"], c["cu_nodes"], acc, check=False, launch=commit)
                for c, ca, s in zip(copies, caches, states)], replays=args.replays)
            print(f"b{b} n{n} u={'bf16' if ucache else 'fp32'} dot16={dot16} "
                  f"{t['median']:.1f} us rel_err={err:.2e}", flush=True)
            del caches, states


if __name__ == "__main__":
    main()
