"""The CUDA walk's and K-side kernel's dispatch, launch rule and build (CPU); the tests marked
gpu compare their outputs with the Triton walk's and the float64 references (tune_gdn and
bench_gdn check them too, reports/h200/gdn/tuning runs 90-99)."""
import ctypes
import os
from dataclasses import replace

import numpy as np
import pytest
import torch

from simtree.errors import SimtreeError
from simtree.kernels.gdn import gdn_tree_verify_dense_ref, tree_meta
from simtree.kernels.gdn._launch import LaunchNotApplicable, VerifyLaunch, verify_launch_config
from simtree.kernels.gdn._launched import launched_verify
from simtree.kernels.gdn import _cuda_walk as cuda_walk
from simtree.kernels.gdn import _launch as gdn_launch

from test_gdn_verify import KEYS, make_inputs, random_tree, rel_err

HAS_NVCC = cuda_walk.nvcc() is not None


def _rule(b, n, hv=48, ieee=False):
    return verify_launch_config(b, hv, 128, "cuda", n, True, 16, ieee=ieee)


def test_rule_takes_the_cuda_walk_where_measured(monkeypatch):
    # run 91: faster at 10-64 sequences of 64-128 nodes; the rule counts (sequence, value
    # head) rows from 480 and trees of 64-128 nodes, bf16 only
    monkeypatch.setattr(gdn_launch, "sm_count", lambda device: 132)
    rng = np.random.default_rng(0)
    for _ in range(40):
        b, n = int(rng.integers(10, 129)), int(rng.integers(64, 129))
        cfg = _rule(b, n)
        assert cfg.cuda_walk == 2 and cfg.kside > 0 and cfg.prenorm == 1, (b, n)
        # the CUDA K-side kernel at 12 warps (8 below 512 rows of > 96 nodes), prefetching the
        # walk's first states into L2, and beyond 64 nodes each walk program the next one's,
        # late (runs 100-107)
        assert cfg.kside_cuda == (1 if b * 48 < 512 and n > 96 else 2), (b, n)
        assert cfg.walk_kside == 0 and cfg.l2_prefetch == (19 if n > 64 else 2), (b, n)
        assert (cfg.block_v, 2) in cuda_walk.RAW_INSTANCES, (b, n)
        assert cfg.block_t == 16 and (cfg.block_v, 2) in cuda_walk.INSTANCES, (b, n)
        assert _rule(b, n, ieee=True).cuda_walk == 0, (b, n)
        assert _rule(b, n, ieee=True).kside_cuda == 0, (b, n)
        assert _rule(b, n, ieee=True).l2_prefetch == 0, (b, n)
    for b, n in ((9, 128), (4, 128), (1, 64), (16, 63), (64, 33), (64, 16), (64, 129), (16, 256)):
        assert _rule(b, n).cuda_walk == 0, (b, n)
    assert _rule(15, 128, hv=32).cuda_walk == 2 and _rule(14, 128, hv=32).cuda_walk == 0
    assert _rule(15, 128, hv=32).kside_cuda == 1 and _rule(16, 128, hv=32).kside_cuda == 2


def _blockers(**kw):
    x = torch.zeros(64, dtype=torch.bfloat16)
    args = dict(kside=1, ready=True, BT=16, K=128, BV=128, mt=2,
                dtypes=(torch.bfloat16, torch.bfloat16), bf16_buffers=True, tensors=(x, x),
                device="cpu")
    return gdn_launch.cuda_walk_blockers(**{**args, **kw})


def test_every_reason_the_cuda_walk_cannot_run_is_named():
    base = _blockers()
    assert len(base) == 1 and "compute capability >= 9.0" in base[0]   # no GPU here
    x = torch.zeros(64, dtype=torch.bfloat16)
    cases = {"K-side tiles": dict(kside=0), "pre-normalised": dict(ready=False),
             "block_t 32": dict(BT=32), "K 64": dict(K=64),
             "bf16 q/k/v": dict(dtypes=(torch.float16, torch.bfloat16)),
             "u_cache_bf16": dict(bf16_buffers=False), "got (256, 2)": dict(BV=256),
             "got (128, 3)": dict(mt=3), "16-byte aligned": dict(tensors=(x[1:], x))}
    for text, kw in cases.items():
        extra = [w for w in _blockers(**kw) if w not in base]
        assert len(extra) == 1 and text in extra[0], (kw, extra)
    # the walk computing its own K-side tiles has one program per (sequence, value head) only;
    # the walk on raw rows (after the CUDA K-side kernel) has its own instances
    for mode in (1, 2):
        for bv, mt in cuda_walk.INSTANCES:
            extra = [w for w in _blockers(BV=bv, mt=mt, mode=mode) if w not in base]
            assert ((bv, mt) in cuda_walk.instances(mode)) == (extra == []), (mode, bv, mt)
            assert extra == [] or (len(extra) == 1 and f"got ({bv}, {mt})" in extra[0]), extra


def _small_verify_args(seed):
    """The verify's arguments for two random trees of 20-40 nodes stored depth-first (CPU)."""
    rng = np.random.default_rng(seed)
    trees = [random_tree(int(n), rng, reach=4) for n in rng.integers(20, 40, size=2)]
    inp = make_inputs([t.depth_first() for t in trees], seed + 2)
    return [inp[k] for k in KEYS] + [inp["parents"], inp["cu_nodes"]]


def test_cpu_falls_back_to_the_triton_walk_and_refuses_an_explicit_cuda_walk(monkeypatch):
    args = _small_verify_args(3)
    base = VerifyLaunch(backend="triton", kside=1, prenorm=1)
    run = lambda **switches: launched_verify(*args, launch=replace(base, **switches))  # noqa: E731
    want, _ = run(cuda_walk=0)
    real = gdn_launch.verify_launch_config
    for ks, kcu in ((0, 0), (1, 0), (0, 1)):   # a rule that asks for the CUDA walk (with the
        # K-side in it, or by the CUDA K-side kernel, or neither)
        monkeypatch.setattr(gdn_launch, "verify_launch_config", lambda *a, **k: replace(
            real(*a, **k), cuda_walk=2, walk_kside=ks, kside_cuda=kcu, l2_prefetch=19))
        assert not cuda_walk.available("cpu")
        got, cache = run()   # the default falls back: same launch, outputs
        assert torch.equal(got, want), ks
        assert cache.launch == dict(kside=1, g_pass=1, transposed=0, cuda_walk=0, walk_kside=0,
                                    kside_cuda=0, l2_prefetch=0), ks   # what ran
        # the bench's y0: the Triton walk asked for, the rule's CUDA K-side kernel left out
        # with it (the Triton pre-pass and K-side kernel run)
        got, _ = run(cuda_walk=0)
        assert torch.equal(got, want), ks
    with pytest.raises(LaunchNotApplicable, match="cuda_walk needs .*compute capability"):
        run(cuda_walk=2)
    with pytest.raises(LaunchNotApplicable, match="cuda_walk needs .*compute capability"):
        run(cuda_walk=2, walk_kside=1)
    with pytest.raises(LaunchNotApplicable, match="walk_kside .* needs cuda_walk > 0"):
        run(cuda_walk=0, walk_kside=1)
    for bad in (dict(cuda_walk=0), dict(cuda_walk=2, walk_kside=1)):   # checked before the GPU
        with pytest.raises(LaunchNotApplicable, match="kside_cuda .* needs cuda_walk > 0 .*"
                                                      "and walk_kside = 0"):
            run(kside_cuda=1, **bad)


def test_the_rules_cuda_kside_kernel_gives_way_where_only_it_cannot_run(monkeypatch):
    # an explicit CUDA walk at an instance the raw-row walk lacks (block_v 32) where the rule
    # also asks for the CUDA K-side kernel: the walk runs on the Triton K-side kernel's tiles
    # (mode 0) instead of failing; asked for explicitly, the K-side kernel is an error
    args = _small_verify_args(4)
    base = VerifyLaunch(backend="triton", kside=1, prenorm=1, block_v=32)
    run = lambda **switches: launched_verify(*args, launch=replace(base, **switches))  # noqa: E731
    real = gdn_launch.verify_launch_config
    monkeypatch.setattr(gdn_launch, "verify_launch_config", lambda *a, **k: replace(
        real(*a, **k), cuda_walk=2, kside_cuda=1, l2_prefetch=19))
    monkeypatch.setattr(cuda_walk, "resident_rows", lambda dev, nc, bv, mt, mode, V: 50 + mode)
    monkeypatch.setattr(gdn_launch, "cuda_walk_blockers", lambda **k: (
        [f"instances {cuda_walk.instances(k['mode'])}"]
        if (k["BV"], k["mt"]) not in cuda_walk.instances(k["mode"]) else []))
    calls = []
    monkeypatch.setattr(cuda_walk, "walk", lambda *a, **k: calls.append(k))
    monkeypatch.setattr(cuda_walk, "kside", lambda *a, **k: pytest.fail("K-side kernel launched"))
    _, cache = run(cuda_walk=2)
    assert len(calls) == 1 and calls[0]["mults"] is None and calls[0]["bits"] is None
    assert (cache.launch["cuda_walk"], cache.launch["kside_cuda"], cache.launch["l2_prefetch"]) \
        == (2, 0, 17)   # the rule's K-side kernel and its prefetch bit gave way
    assert calls[0]["block_v"] == 32 and calls[0]["mt"] == 2
    # the rule's L2 bits follow: the walk's late prefetch (rows resident in mode 0), no K-side one
    assert calls[0]["pf"] == 50 and calls[0]["pf_late"] and not calls[0]["cs"]
    with pytest.raises(LaunchNotApplicable, match="cuda_walk needs instances"):
        run(cuda_walk=2, kside_cuda=1)


def test_l2_prefetch_and_kside_warps_reach_the_kernels(monkeypatch):
    # the bits of l2_prefetch as the launches get them: 1 the walk's prefetch (rows ahead: the
    # resident rows), 2 the CUDA K-side kernel's (its first rows), 4 streaming stores, 8 the
    # walk's v rows two sub-chunks ahead, 16 the walk's prefetch late; the rule's walk without
    # the CUDA K-side kernel drops bit 2, an explicit request for it (or any bit without the
    # CUDA walk) is refused; outside 0-31 a one-line error
    args = _small_verify_args(5)
    base = VerifyLaunch(backend="triton", kside=1, prenorm=1)
    run = lambda **switches: launched_verify(*args, launch=replace(base, **switches))  # noqa: E731
    monkeypatch.setattr(gdn_launch, "cuda_walk_blockers", lambda **k: [])
    monkeypatch.setattr(cuda_walk, "resident_rows", lambda dev, nc, bv, mt, mode, V: 100 + mode)
    calls = []
    monkeypatch.setattr(cuda_walk, "walk", lambda *a, **k: calls.append(("walk", k)))
    monkeypatch.setattr(cuda_walk, "kside", lambda *a, **k: calls.append(("kside", k)))
    for bits in range(32):
        calls.clear()
        run(cuda_walk=2, kside_cuda=1, l2_prefetch=bits)
        (_, ks), (_, wk) = calls
        assert ks["pf"] == (102 if bits & 2 else 0), bits
        assert torch.equal(ks["s0"], args[5].float()), bits   # the walk's fp32 state
        assert wk["pf"] == (102 if bits & 1 else 0) and wk["cs"] == bool(bits & 4), bits
        assert wk["pfv"] == bool(bits & 8) and wk["pf_late"] == bool(bits & 16), bits
        assert ks["warps"] == 8, bits
    calls.clear()   # kside_cuda 2: the K-side kernel at 12 warps a program
    run(cuda_walk=2, kside_cuda=2)
    assert calls[0][0] == "kside" and calls[0][1]["warps"] == 12
    with pytest.raises(SimtreeError, match="kside_cuda is 0 .*, 1 .* or 2"):
        run(cuda_walk=2, kside_cuda=3)
    real = gdn_launch.verify_launch_config
    monkeypatch.setattr(gdn_launch, "verify_launch_config", lambda *a, **k: replace(
        real(*a, **k), cuda_walk=2, kside_cuda=0, l2_prefetch=31))
    calls.clear()
    run()   # the rule's bits on the walk on the Triton K-side tiles
    assert [c for c, _ in calls] == ["walk"] and calls[0][1]["pf"] == 100 and calls[0][1]["cs"]
    assert calls[0][1]["pfv"] and calls[0][1]["pf_late"]
    with pytest.raises(LaunchNotApplicable, match="l2_prefetch .* kside_cuda > 0"):
        run(l2_prefetch=2)
    with pytest.raises(LaunchNotApplicable, match="l2_prefetch .* needs cuda_walk > 0"):
        run(cuda_walk=0, l2_prefetch=1)
    with pytest.raises(SimtreeError, match="l2_prefetch is a sum of the bits 1, 2, 4, 8 and 16"):
        run(l2_prefetch=32)


def test_instances_and_targets():
    for bv, mt in cuda_walk.INSTANCES:
        cuda_walk.check_instance(bv, mt)
        assert bv // (16 * mt) >= 1
    for bad in ((96, 2), (128, 3), (256, 1)):
        with pytest.raises(SimtreeError, match="block_v, m-tiles per warp"):
            cuda_walk.check_instance(*bad)
    assert "sm_90a" in cuda_walk.arch_flag(9, 0) and "compute_90a" in cuda_walk.arch_flag(9, 0)
    assert cuda_walk.arch_flag(8, 6).endswith("code=sm_86")


@pytest.mark.skipif(not HAS_NVCC, reason="no nvcc on this machine")
def test_walk_builds_once_into_its_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("SIMTREE_CUDA_CACHE", str(tmp_path))
    lib = cuda_walk.build(9, 0)
    assert lib.parent == tmp_path and lib.exists()
    stamp = lib.stat().st_mtime_ns
    assert cuda_walk.build(9, 0) == lib and lib.stat().st_mtime_ns == stamp   # not rebuilt
    assert [p.name for p in tmp_path.iterdir()] == [lib.name]                  # no leftovers
    dll = cuda_walk._load(lib)   # loads without a GPU (the CUDA runtime binds lazily)
    assert b"block_v" in dll.gdn_walk_error(1000)
    assert b"shared memory" in dll.gdn_walk_error(1001)
    assert b"fewer words" in dll.gdn_walk_error(1002)
    # the typed entry point takes walk.cu's arguments; an instance it lacks is refused before
    # any CUDA call (so this runs without a GPU), with the K-side in the walk as without
    ptrs = (ctypes.c_void_p * 16)()
    for ordered in (0, 1):
        for bv, mt, ks in ((96, 2, 0), (96, 2, 1), (64, 2, 1), (32, 2, 1), (64, 1, 2), (3, 2, 3)):
            assert ks == 3 or (bv, mt) not in cuda_walk.instances(ks)
            assert dll.gdn_walk_launch(ptrs, 1, 8, 16, 48, 128, bv, mt, ks, 2, 1, ordered, 0, 0,
                                       None, None) == 1000, (bv, mt, ks)
        # eight sub-chunks need two words of ancestor bits per row: one is refused
        assert dll.gdn_walk_launch(ptrs, 1, 8, 16, 48, 128, 128, 2, 1, 1, 1, ordered, 0, 0,
                                   None, None) == 1002
        kptrs = (ctypes.c_void_p * 14)()
        assert dll.gdn_kside_launch(kptrs, 1, 8, 16, 48, 1, 128, 1, ordered, 1, 0, 8, 0.1,
                                    None) == 1002
        assert dll.gdn_kside_launch(kptrs, 1, 8, 16, 48, 2, 128, 1, ordered, 1, 0, 16, 0.1,
                                    None) == 1004   # 8 or 12 warps
        # 40 value heads over 16 key heads; 65 sub-chunks
        for nc, h, w in ((8, 16, 2), (65, 8, 17)):
            hv = 40 if h == 16 else 48
            assert dll.gdn_kside_launch(kptrs, 1, nc, h, hv, w, 128, 1, ordered, 1, 0, 8, 0.1,
                                        None) == 1003
    assert b"value heads a multiple of the key heads" in dll.gdn_walk_error(1003)
    assert b"8 or 12 warps" in dll.gdn_walk_error(1004)


@pytest.mark.skipif(not HAS_NVCC, reason="no nvcc on this machine")
def test_the_walk_needs_hopper(tmp_path, monkeypatch):
    monkeypatch.setenv("SIMTREE_CUDA_CACHE", str(tmp_path))
    with pytest.raises(SimtreeError, match="error .*requires .target sm_90") as err:   # the first error line
        cuda_walk.build(8, 0)
    assert "\n" not in str(err.value)


@pytest.mark.skipif(not HAS_NVCC, reason="no nvcc on this machine")
def test_a_failed_build_is_one_line(tmp_path, monkeypatch):
    bad = tmp_path / "walk.cu"
    bad.write_text("this is not CUDA\n")
    monkeypatch.setattr(cuda_walk, "SOURCE", bad)
    monkeypatch.setenv("SIMTREE_CUDA_CACHE", str(tmp_path / "cache"))
    with pytest.raises(SimtreeError, match="nvcc failed building walk.cu: .*error") as err:
        cuda_walk.build(9, 0)
    assert "\n" not in str(err.value)
    assert not any((tmp_path / "cache").glob("*.so"))


def test_no_nvcc_is_a_clear_error(monkeypatch):
    monkeypatch.setattr(cuda_walk, "nvcc", lambda: None)
    with pytest.raises(SimtreeError, match="needs nvcc"):
        cuda_walk.build(9, 0)


def test_nvcc_from_cuda_home(tmp_path, monkeypatch):
    exe = tmp_path / "bin" / "nvcc"
    exe.parent.mkdir()
    exe.write_text("#!/bin/sh\n")
    os.chmod(exe, 0o755)
    monkeypatch.setenv("CUDA_HOME", str(tmp_path))
    assert cuda_walk.nvcc() == str(exe)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("order", ["stored", "table"])
@pytest.mark.parametrize("bv,mt,ks,kcu", [(*i, 0, 0) for i in cuda_walk.INSTANCES]
                         + [(*i, 1, 0) for i in cuda_walk.KSIDE_INSTANCES]
                         + [(*i, 0, kcu) for i in cuda_walk.RAW_INSTANCES for kcu in (1, 2)])
def test_cuda_walk_matches_the_triton_walk_on_the_gpu(bv, mt, ks, kcu, order, monkeypatch):
    # o and u of the CUDA walk against the Triton transposed walk on the Triton K-side
    # kernel's tiles (ks: the CUDA walk computes those tiles itself; kcu: the CUDA K-side
    # kernel writes them) and against the float64 reference:
    # random trees of 65-128 nodes (last sub-chunks partial), two or three value heads per key
    # head, stored depth-first or walked through the heavy-first order table of breadth-first
    # trees
    from simtree.profiler.bench.gdn_util import random_gdn_inputs
    if not cuda_walk.available("cuda"):
        pytest.skip("the CUDA walk does not run on this GPU")
    rng = np.random.default_rng(bv * 10 + mt + 2 * (order == "table") + 4 * ks + 8 * kcu)
    for H, HV in ((4, 12), (4, 8)):
        trees = [random_tree(int(n), rng, reach=5) for n in rng.integers(65, 129, size=5)]
        if order == "stored":
            trees = [t.depth_first() for t in trees]
        inp = random_gdn_inputs(trees, H=H, HV=HV, K=128, V=128, seed=int(rng.integers(1 << 30)))
        meta = tree_meta(inp["parents"], inp["cu_nodes"], depth_first=order == "stored")
        args = [inp[k] for k in KEYS] + [inp["parents"], inp["cu_nodes"]]
        base = VerifyLaunch(backend="triton", kside=1, prenorm=1, g_pass=1, solve_bf16=1,
                            u_bf16=1, u_cache_bf16=1, block_t=16, block_v=bv)
        run = lambda args, **switches: launched_verify(  # noqa: E731
            *args, meta=meta, launch=replace(base, **switches))
        o_t, c_t = run(args, transposed=1, cuda_walk=0)
        o_c, c_c = run(args, cuda_walk=mt, walk_kside=ks, kside_cuda=kcu, l2_prefetch=0)
        ref = gdn_tree_verify_dense_ref(*(inp[k].double() for k in KEYS), inp["parents"],
                                        inp["cu_nodes"])
        assert rel_err(o_c, ref) < 2e-2 and rel_err(o_t, ref) < 2e-2, (H, HV)
        assert rel_err(o_c, o_t) < 1e-2 and rel_err(c_c.u, c_t.u) < 1e-2, (H, HV)
        if kcu:   # G written by the CUDA K-side kernel instead of the pre-pass
            assert rel_err(c_c.G, c_t.G) < 1e-5, (H, HV)
        # the L2 prefetches and streaming stores move no number: outputs bit for bit the same
        # (7 rows resident at a time, so the walk's prefetch reaches real rows and past the last;
        # the late prefetch, the rule's, at two m-tiles per warp, the early one at one)
        with monkeypatch.context() as m:
            m.setattr(cuda_walk, "resident_rows", lambda *a, **k: 7)
            o_p, c_p = run(args, cuda_walk=mt, walk_kside=ks, kside_cuda=kcu,
                           l2_prefetch=(15 if kcu else 13) | 16 * (mt == 2))
        assert torch.equal(o_p, o_c) and torch.equal(c_p.u, c_c.u), (H, HV)
        if kcu:   # its multipliers without the L2 norm, at another scale (q and k raw values
            # then reach the products: inputs normalised first so the recurrence stays bounded)
            raw = dict(inp, q=torch.nn.functional.normalize(inp["q"].float(), dim=-1).to(inp["q"].dtype),
                       k=torch.nn.functional.normalize(inp["k"].float(), dim=-1).to(inp["k"].dtype))
            args2 = [raw[k] for k in KEYS] + [raw["parents"], raw["cu_nodes"]]
            nk = dict(meta=meta, qk_l2norm=False, scale=0.05)
            o_t2, _ = launched_verify(*args2, **nk, launch=replace(base, transposed=1, cuda_walk=0))
            o_c2, _ = launched_verify(*args2, **nk,
                                      launch=replace(base, cuda_walk=mt, kside_cuda=kcu))
            ref2 = gdn_tree_verify_dense_ref(*(raw[k].double() for k in KEYS), raw["parents"],
                                             raw["cu_nodes"], scale=0.05, qk_l2norm=False)
            assert rel_err(o_c2, ref2) < 2e-2 and rel_err(o_c2, o_t2) < 1e-2, (H, HV)
