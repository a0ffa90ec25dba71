"""Markdown summary of the Nsight Compute CSV pages ``scripts/ncu_gdn.sh`` writes: per shape, the
verify kernel's (and pre-pass's and K-side kernel's) duration, occupancy, issue rate, tensor-pipe use, spills and
warp stall reasons (cycles per issued instruction), and the verify's SASS instruction mix.

    python3 scripts/ncu_summary.py DIR > DIR/summary.md
"""
import collections
import csv
import gzip
import re
import sys
from pathlib import Path

from simtree.kernels.gdn._tree_kernels import PROFILED_WALKS

DETAILS = ("Duration", "Grid Size", "Block Size", "Registers Per Thread", "Theoretical Occupancy", "Achieved Occupancy",
           "Issued Ipc Active", "Issue Slots Busy", "Warp Cycles Per Issued Instruction",
           "DRAM Throughput", "L1/TEX Cache Throughput", "L2 Hit Rate", "Local Memory Spilling Requests")
RAW = {"tensor pipe active %": "sm__pipe_tensor_cycles_active.avg.pct_of_peak_sustained_active",
       "shared wavefronts": "l1tex__data_pipe_lsu_wavefronts_mem_shared.sum",
       "instructions": "smsp__inst_executed.sum"}
STALL = re.compile(r"smsp__average_warps_issue_stalled_(\w+)_per_issue_active\.ratio$")


def details(path: Path) -> dict:
    rows = list(csv.reader(path.open()))
    h = rows[0]
    k, m, u, v = (h.index(x) for x in ("Kernel Name", "Metric Name", "Metric Unit", "Metric Value"))
    out = collections.defaultdict(dict)
    for r in rows[1:]:
        if len(r) > v and r[m] in DETAILS:
            out[r[k]][r[m]] = f"{r[v]} {r[u]}".strip()
    return out


def raw(path: Path) -> dict:
    rows = list(csv.reader(gzip.open(path, "rt")))
    h = rows[0]
    out = {}
    for r in rows[2:]:
        d = dict(zip(h, r))
        name = d.get("Kernel Name", "")
        rec = {label: d.get(key, "") for label, key in RAW.items()}
        stalls = {STALL.match(key).group(1): float(val.replace(",", "")) for key, val in d.items()
                  if STALL.match(key) and val}
        rec["stalls"] = sorted(stalls.items(), key=lambda kv: -kv[1])
        out[name] = rec
    return out


def sass_rows(path: Path) -> list[tuple[str, int, int, str]]:
    """The source page's SASS lines as (opcode, times executed, stall samples, instruction),
    the opcode with its predicate stripped; of the page's first kernel where it holds more than
    one (each opens with a "Kernel Name" row and its header)."""
    rows = list(csv.reader(gzip.open(path, "rt")))
    h = rows[1]
    s, e = h.index("Warp Stall Sampling (All Samples)"), h.index("Instructions Executed")
    out = []
    for r in rows[2:]:
        if r and r[0] == "Kernel Name":
            break
        text = " ".join(r[1].split())
        m = re.match(r"(@!?U?P\w+\s+)?([A-Z0-9_]+)", text)
        out.append((m.group(2) if m else "?", int(r[e] or 0), int(r[s] or 0), text))
    return out


def most_stalled(path: Path, top: int = 6) -> list[tuple[float, int, str]]:
    """The instructions with the most stall samples: (share of all samples %, times executed,
    instruction), most first."""
    rows = sass_rows(path)
    total = sum(r[2] for r in rows) or 1
    return [(100 * smp / total, ex, text)
            for _, ex, smp, text in sorted(rows, key=lambda r: -r[2])[:top]]


def opcode_mix(path: Path, top: int = 12) -> list[tuple[str, float, float]]:
    ins, smp = collections.Counter(), collections.Counter()
    for op, executed, samples, _ in sass_rows(path):
        ins[op] += executed
        smp[op] += samples
    ti, ts = sum(ins.values()) or 1, sum(smp.values()) or 1
    return [(op, 100 * c / ti, 100 * smp[op] / ts) for op, c in ins.most_common(top)]


def loop_bodies(path: Path, grid_warps: int, top: int = 8) -> list[str]:
    """The verify's SASS grouped by execution count (each count is one loop body: once per
    program, per sub-chunk, per pair), largest share first: instructions per warp and
    iteration, iterations per warp, share of all executed instructions, commonest opcodes."""
    groups = collections.defaultdict(collections.Counter)
    for op, executed, _, _ in sass_rows(path):
        groups[executed][op] += 1
    total = sum(ex * sum(c.values()) for ex, c in groups.items()) or 1
    out = []
    for ex, c in sorted(groups.items(), key=lambda kv: -kv[0] * sum(kv[1].values())):
        if ex == 0 or ex * sum(c.values()) < 0.01 * total:
            continue
        out.append(f"{sum(c.values())} instructions x {ex / grid_warps:.2f} per warp "
                   f"({100 * ex * sum(c.values()) / total:.1f}%): "
                   + ", ".join(f"{op} {k}" for op, k in c.most_common(top)))
    return out


def launches(d: Path) -> str:
    """The launch the profiled calls ran, as ``ncu_gdn_verify.py`` logged it per shape (its
    "three verifies done (...)" line): "the default launch" or the keyword arguments given."""
    got = set()
    for log in d.glob("verify_b*_n*.log"):
        got.update(re.findall(r"three verifies done \((.*)\)", log.read_text(errors="replace")))
    if not got or got == {"default launch"}:
        return "the default launch"
    return "the launch " + " / ".join(f"`{g}`" for g in sorted(got))


def main() -> None:
    d = Path(sys.argv[1])
    reps = sorted(d.glob("verify_b*_n*.details.csv"),
                  key=lambda p: tuple(map(int, re.findall(r"\d+", p.name)[:2])))
    if not reps:
        raise SystemExit(f"no verify_b*_n*.details.csv under {d}")
    ver = (d / "ncu_version.txt").read_text().strip() if (d / "ncu_version.txt").exists() else "?"
    print("# Nsight Compute on the GDN tree verify (generated by `scripts/ncu_summary.py`)\n")
    print(f"ncu {ver}; `scripts/ncu_gdn.sh` (full section set, `--clock-control none`, the third "
          "call of each shape profiled, every kernel of it); Qwen3.6-27B shapes, bf16, EAGLE-like trees stored "
          f"depth-first, {launches(d)}. Durations are under the profiler (one replayed launch), "
          "not the benchmark's CUDA-graph medians.\n")
    for p in reps:
        shape = p.name.split(".")[0].replace("verify_", "")
        det, rw = details(p), raw(p.with_name(p.name.replace("details.csv", "raw.csv.gz")))
        print(f"## {shape}\n")
        print("| metric | " + " | ".join(det) + " |")
        print("|---|" + "---|" * len(det))
        for key in DETAILS:
            print(f"| {key} | " + " | ".join(det[k].get(key, "") for k in det) + " |")
        for label in RAW:
            print(f"| {label} | " + " | ".join(str(rw.get(k, {}).get(label, "")) for k in det) + " |")
        print("| top stalls (cycles per issued instruction) | " + " | ".join(
            ", ".join(f"{n} {v:.2f}" for n, v in rw.get(k, {}).get("stalls", [])[:6]) for k in det) + " |")
        sass = p.with_name(p.name.replace("details.csv", "sass.csv.gz"))
        if sass.exists():
            print("\nVerify kernel, SASS opcodes: share of executed instructions / of stall samples: "
                  + ", ".join(f"{op} {a:.1f}/{b:.1f}%" for op, a, b in opcode_mix(sass)))
            rows = list(csv.reader(p.open()))
            h = rows[0]
            k, m, v = h.index("Kernel Name"), h.index("Metric Name"), h.index("Metric Value")
            get = {r[m]: r[v] for r in rows[1:] if len(r) > v and any(w in r[k] for w in PROFILED_WALKS)}
            warps = int(get["Grid Size"].replace(",", "")) * int(get["Block Size"]) // 32
            print("\nVerify kernel, SASS by loop body (same execution count):\n")
            for line in loop_bodies(sass, warps):
                print(f"- {line}")
            print("\nVerify kernel, the instructions with the most stall samples (share of all "
                  "samples, times executed):\n")
            for share, ex, text in most_stalled(sass):
                print(f"- {share:.1f}% x {ex}: `{text}`")
        print()


if __name__ == "__main__":
    main()
