"""The V4 compressors' projections three ways on the GPU, at V4-Flash shapes (hidden 4096; CSA:
kv + gate of 2 x 512 and the indexer's 2 x 128 columns each; HCA: 512 each):

- fp32: today's form, x (bf16, the normed hidden) upcast and multiplied by fp32 weights (SGEMM);
- bf16_out32: the weights stored in bf16 as the checkpoint ships them, x @ W^T on the tensor
  cores with an fp32 output (torch.mm(..., out_dtype=float32)): the same products (bf16 x bf16 is
  exact in fp32) in fp32 accumulation, half the weight bytes;
- bf16: the same, output rounded to bf16 (transformers' form), for scale.

Each checked against float64 of the same bf16 inputs first.  CUDA graphs, warm-up, medians over
rotated fresh inputs.  Writes --out CSV (form, layer, tokens, cols, us, floor_us, max_rel_err, gpu, torch).
    python scripts/v4_comp_gemm_gpu.py --out $OUT/comp_gemm.csv
"""
import argparse
import csv
import sys

import torch

from simtree.profiler.timing import measured_bandwidth, time_workload

LAYERS = {"csa": 2 * (2 * 512) + 2 * (2 * 128), "hca": 2 * 512}   # concatenated wkv + wgate columns per layer kind
H = 4096


def forms(x, w32, w16):
    return {"fp32": lambda: x.float() @ w32.T,
            "bf16_out32": lambda: torch.mm(x, w16.T, out_dtype=torch.float32),
            "bf16": lambda: x @ w16.T}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--tokens", default="1,4,16,64,256")
    a = ap.parse_args()
    bw = measured_bandwidth("cuda")["copy_GBps"]
    rows = []
    for layer, cols in LAYERS.items():
        w16 = (torch.randn(cols, H, device="cuda") * H ** -0.5).bfloat16()
        w32 = w16.float()
        for T in (int(t) for t in a.tokens.split(",")):
            xs = [torch.randn(T, H, device="cuda").bfloat16() for _ in range(4)]
            ref = xs[0].double() @ w16.double().T
            for name in forms(xs[0], w32, w16):
                got = forms(xs[0], w32, w16)[name]()
                err = float(((got.double() - ref).abs().max() / ref.abs().max()))
                us = time_workload([forms(x, w32, w16)[name] for x in xs], "cuda", use_graph=True, spin_ms=5.0).median_us
                wbytes = cols * H * (4 if name == "fp32" else 2)
                floor = (wbytes + T * H * 2 + T * cols * (2 if name == "bf16" else 4)) / (bw * 1e3)
                rows.append(dict(form=name, layer=layer, tokens=T, cols=cols, us=round(us, 2), floor_us=round(floor, 2),
                                 max_rel_err=f"{err:.2e}", gpu=torch.cuda.get_device_name(), torch=torch.__version__))
                print(rows[-1], flush=True)
    with open(a.out, "w", newline="") as f:
        wr = csv.DictWriter(f, fieldnames=list(rows[0]))
        wr.writeheader()
        wr.writerows(rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
