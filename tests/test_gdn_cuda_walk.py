"""The CUDA walk's dispatch, launch rule and build (CPU: its numbers are checked on the GPU by
tune_gdn / bench_gdn against the float64 references, reports/h200/gdn/tuning runs 90-91)."""
import ctypes
import os

import numpy as np
import pytest
import torch

from simtree.errors import SimtreeError
from simtree.kernels.gdn import LaunchNotApplicable, gdn_tree_verify, verify_launch_config
from simtree.kernels.gdn import cuda_walk

from test_gdn_verify import KEYS, make_inputs, random_tree

HAS_NVCC = cuda_walk.nvcc() is not None


def _rule(b, n, hv=48, ieee=False):
    return verify_launch_config(b, hv, 128, "cuda", n, True, 16, ieee=ieee)


def test_rule_takes_the_cuda_walk_where_measured(monkeypatch):
    # run 91: faster at 10-64 sequences of 64-128 nodes; the rule counts (sequence, value
    # head) rows from 480 and trees of 33-128 nodes, bf16 only
    import simtree.kernels.gdn as kg
    monkeypatch.setattr(kg, "_sm_count", lambda device: 132)
    rng = np.random.default_rng(0)
    for _ in range(40):
        b, n = int(rng.integers(10, 129)), int(rng.integers(33, 129))
        cfg = _rule(b, n)
        assert cfg["cuda_walk"] == 2 and cfg["kside"] > 0 and cfg["prenorm"] == 1, (b, n)
        assert _rule(b, n, ieee=True)["cuda_walk"] == 0, (b, n)
    for b, n in ((9, 128), (4, 128), (1, 64), (16, 32), (64, 16), (64, 129), (16, 256)):
        assert _rule(b, n)["cuda_walk"] == 0, (b, n)
    assert _rule(15, 128, hv=32)["cuda_walk"] == 2 and _rule(14, 128, hv=32)["cuda_walk"] == 0


def test_cpu_falls_back_to_the_triton_walk_and_refuses_an_explicit_cuda_walk():
    rng = np.random.default_rng(3)
    trees = [random_tree(int(n), rng, reach=4) for n in rng.integers(20, 40, size=2)]
    inp = make_inputs([t.depth_first() for t in trees], 5)
    args = [inp[k] for k in KEYS] + [inp["parents"], inp["cu_nodes"]]
    assert not cuda_walk.available("cpu")
    with pytest.raises(LaunchNotApplicable, match="cuda_walk"):
        gdn_tree_verify(*args, backend="triton", kside=1, prenorm=1, cuda_walk=2)
    # cuda_walk=0 is the Triton walk; an explicit 0 is never an error
    a, _ = gdn_tree_verify(*args, backend="triton", kside=1, prenorm=1, cuda_walk=0)
    b, _ = gdn_tree_verify(*args, backend="triton", kside=1, prenorm=1)
    assert torch.equal(a, b)


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
    dll = ctypes.CDLL(str(lib))   # loads without a GPU (the CUDA runtime binds lazily)
    dll.gdn_walk_error.restype = ctypes.c_char_p
    assert b"block_v" in dll.gdn_walk_error(1000)
    assert b"shared memory" in dll.gdn_walk_error(1001)


@pytest.mark.skipif(not HAS_NVCC, reason="no nvcc on this machine")
def test_a_failed_build_is_one_line(tmp_path, monkeypatch):
    bad = tmp_path / "walk.cu"
    bad.write_text("this is not CUDA\n")
    monkeypatch.setattr(cuda_walk, "SOURCE", bad)
    monkeypatch.setenv("SIMTREE_CUDA_CACHE", str(tmp_path / "cache"))
    with pytest.raises(SimtreeError, match="nvcc failed building walk.cu") as err:
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
