"""Optional GPU attention core through sgl-flash-mla's V4 sparse decode (SM90, legacy path).

The V4 cache format ("584 bytes per token", FlashMLA's MODEL1 FP8 sparse layout): a page of
``page_block_size`` tokens stores the data rows first — 448 float8_e4m3 NoPE values then 64
bfloat16 RoPE values (576 bytes) per token — then one 8-byte scale row per token (7
float8_e8m0 power-of-two scales, one per 64 NoPE values, and a pad byte); pages are padded
to a multiple of 576 bytes.  :func:`pack_v4_rows` writes that layout from bf16 rows, so the
flat row index of our pools (page * page_size + offset) is the index FlashMLA reads, and our
per-node index lists go to it unchanged: ``indices`` for [window pool | node latents],
``extra_indices_in_kvcache`` for [compressed pool | scratch entries].

Nothing here runs without a CUDA device and the ``flash_mla`` package; every entry point
raises a one-line error instead.  The API details are checked at run time (signature printed
by :func:`probe_and_bench`).
"""
from __future__ import annotations

import inspect
import time

import torch

__all__ = ["flashmla_available", "PackedRows", "pack_v4_rows", "unpack_v4_rows", "flashmla_sparse_attention",
           "emulate_flashmla_sparse_attention",
           "probe_and_bench"]

NOPE, ROPE, TILE = 448, 64, 64
ROW_BYTES = NOPE + 2 * ROPE + 8  # 584


def flashmla_available() -> tuple[bool, str]:
    try:
        import flash_mla  # noqa: F401
        return True, getattr(flash_mla, "__file__", "flash_mla")
    except Exception as exc:  # noqa: BLE001
        return False, f"{type(exc).__name__}: {exc}"


def _quantize_rows(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """rows [n, 512] -> (data [n, 576] uint8: FP8 NoPE | bf16 RoPE bytes, scales [n, 8] uint8).

    NoPE part quantised per 64 values with a power-of-two scale (amax / 448 rounded up)."""
    n = rows.shape[0]
    x = rows.float()
    nope = x[:, :NOPE].reshape(n, NOPE // TILE, TILE)
    exp2 = torch.ceil(torch.log2(nope.abs().amax(-1).clamp_min(1e-30) / 448.0)).clamp(-127, 127)
    q = (nope / torch.exp2(exp2).unsqueeze(-1)).to(torch.float8_e4m3fn).view(torch.uint8).reshape(n, NOPE)
    rope = x[:, NOPE:].to(torch.bfloat16).contiguous().view(torch.uint8).reshape(n, 2 * ROPE)
    scales = torch.cat([(exp2 + 127).to(torch.uint8), rows.new_zeros(n, 8 - NOPE // TILE, dtype=torch.uint8)], 1)
    return torch.cat([q, rope], 1), scales


class PackedRows:
    """A flat row space in FlashMLA's V4 layout: row i lives in block i // page, slot i % page.

    raw [nb, bytes per padded block] uint8; ``k_cache`` is the [nb, page, 1, 584] FP8 view
    FlashMLA reads; :meth:`write` quantises rows into arbitrary row slots (no full re-pack)."""

    def __init__(self, num_rows: int, device, page_block_size: int = 64):
        self.page = page_block_size
        self.nb = max(1, -(-num_rows // page_block_size))
        self.num_rows = self.nb * page_block_size
        per_block = page_block_size * ROW_BYTES
        self.raw = torch.zeros(self.nb, -(-per_block // 576) * 576, dtype=torch.uint8, device=device)
        self._data = self.raw[:, :page_block_size * (NOPE + 2 * ROPE)].view(self.nb, page_block_size, NOPE + 2 * ROPE)
        self._scales = self.raw[:, page_block_size * (NOPE + 2 * ROPE):per_block].view(self.nb, page_block_size, 8)
        self.k_cache = self.raw.view(torch.float8_e4m3fn)[:, :per_block].view(self.nb, page_block_size, 1, ROW_BYTES)

    def write(self, row_ids: torch.Tensor, rows: torch.Tensor, use_triton: bool | None = None) -> None:
        """row_ids [n] (int64, device) <- rows [n, 512]; one Triton launch on CUDA (pack.py),
        a dozen torch ops otherwise."""
        if rows.shape[0] == 0:
            return
        if rows.is_cuda if use_triton is None else use_triton:
            from .pack import pack_rows_triton
            pack_rows_triton(self.raw, self.page, row_ids, rows)
            return
        data, scales = _quantize_rows(rows)
        blk, off = row_ids // self.page, row_ids % self.page
        self._data[blk, off] = data
        self._scales[blk, off] = scales


def pack_v4_rows(rows: torch.Tensor, page_block_size: int = 64) -> torch.Tensor:
    """rows [P, 512] (bf16/fp32) -> k_cache view [P / page, page, 1, 584] float8_e4m3fn."""
    P, D = rows.shape
    if D != NOPE + ROPE:
        raise ValueError(f"V4 cache rows must be 512 wide, got {D}")
    packed = PackedRows(P, rows.device, page_block_size)
    packed.write(torch.arange(P, device=rows.device), rows)
    return packed.k_cache


def unpack_v4_rows(cache: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`pack_v4_rows` (dequantised) -> [P, 512] float32."""
    nb, ps = cache.shape[0], cache.shape[1]
    raw = cache.view(torch.uint8).reshape(nb, -1) if cache.is_contiguous() else None
    if raw is None:
        base = cache.view(torch.uint8)
        raw = torch.as_strided(base, (nb, ps * ROW_BYTES), (base.stride(0), 1))
    data = raw[:, :ps * (NOPE + 2 * ROPE)].reshape(nb, ps, NOPE + 2 * ROPE)
    scales = raw[:, ps * (NOPE + 2 * ROPE):ps * ROW_BYTES].reshape(nb, ps, 8)[..., :NOPE // TILE]
    nope = data[..., :NOPE].contiguous().view(torch.float8_e4m3fn).float().view(nb, ps, NOPE // TILE, TILE)
    nope = nope * torch.exp2(scales.float() - 127).unsqueeze(-1)
    rope = data[..., NOPE:].contiguous().view(torch.bfloat16).float()
    return torch.cat([nope.reshape(nb, ps, NOPE), rope], -1).reshape(nb * ps, NOPE + ROPE)


def _call_kwargs(fn) -> set:
    """Parameter names of fn; a **kwargs wrapper counts as taking the V4 switches."""
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return set()
    names = set(params)
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        names |= {"use_legacy", "kv_format"}
    return names


def flashmla_sparse_attention(q: torch.Tensor, indices: torch.Tensor, k_cache: torch.Tensor,
                              sink: torch.Tensor, scale: float, extra_indices: torch.Tensor | None = None,
                              extra_k_cache: torch.Tensor | None = None, sched=None):
    """q [B, s_q, H, 512] bf16; indices [B, s_q, K] int32 (-1 skips) into k_cache rows;
    extra_* likewise.  Returns (out [B, s_q, H, 512], sched) — pass sched back to reuse it."""
    import flash_mla
    fn = flash_mla.flash_mla_with_kvcache
    if sched is None:
        sched = flash_mla.get_mla_metadata()[0]
    kw = dict(q=q, k_cache=k_cache, block_table=None, cache_seqlens=None, head_dim_v=512,
              tile_scheduler_metadata=sched, softmax_scale=scale, is_fp8_kvcache=True,
              indices=indices.to(torch.int32), attn_sink=sink.float())
    if extra_k_cache is not None:
        kw.update(extra_k_cache=extra_k_cache, extra_indices_in_kvcache=extra_indices.to(torch.int32))
    params = _call_kwargs(fn)
    if "use_legacy" in params:
        kw["use_legacy"] = True
    if "kv_format" in params:
        kw["kv_format"] = "V4"
    out, _ = fn(**kw)
    return out, sched


def emulate_flashmla_sparse_attention(q, indices, k_cache, sink, scale, extra_indices=None,
                                      extra_k_cache=None, sched=None):
    """CPU stand-in of :func:`flashmla_sparse_attention` (dequantise + torch attention), for
    tests of everything around the kernel: packing, spare rows, index remapping."""
    from .attention import sparse_attention_torch
    B, s_q, H, D = q.shape
    srcs = [unpack_v4_rows(k_cache)]
    idx = indices.reshape(B * s_q, -1).long()
    if extra_k_cache is not None:
        ext = extra_indices.reshape(B * s_q, -1).long()
        idx = torch.cat([idx, torch.where(ext >= 0, ext + srcs[0].shape[0], -1)], 1)
        srcs.append(unpack_v4_rows(extra_k_cache))
    out = sparse_attention_torch(q.float().reshape(B * s_q, H, D), idx, srcs, sink.float(), scale)
    return out.view(B, s_q, H, D).to(q.dtype), sched


def probe_and_bench(device, log, time_us, budget_s: float = 60.0) -> dict:
    """Import flash_mla, print its API, check one call against torch, time the known shapes."""
    ok, where = flashmla_available()
    res: dict = {"available": ok, "where": where}
    if not ok:
        log(f"flashmla: not importable ({where})")
        return res
    import flash_mla
    res["signature"] = str(inspect.signature(flash_mla.flash_mla_with_kvcache))
    log(f"flashmla: {where}; flash_mla_with_kvcache{res['signature']}")
    from .attention import sparse_attention_torch
    t0 = time.time()
    g = torch.Generator(device=device).manual_seed(0)
    H, D, scale = 64, 512, 512 ** -0.5
    try:  # correctness on dequantised rows
        B, s_q, K, KE = 2, 3, 128, 64
        rows = torch.randn(512, D, generator=g, device=device)
        extra = torch.randn(256, D, generator=g, device=device)
        kc, ec = pack_v4_rows(rows), pack_v4_rows(extra)
        res["pack_roundtrip_err"] = float((unpack_v4_rows(kc) - rows).abs().max())
        idx = torch.randint(-1, 512, (B, s_q, K), generator=g, device=device)
        idx[..., 0] = 3  # at least one valid row per query
        eidx = torch.randint(-1, 256, (B, s_q, KE), generator=g, device=device)
        q = torch.randn(B, s_q, H, D, generator=g, device=device).to(torch.bfloat16)
        sink = torch.randn(H, generator=g, device=device)
        out, _ = flashmla_sparse_attention(q, idx, kc, sink, scale, eidx, ec)
        all_idx = torch.cat([idx, torch.where(eidx >= 0, eidx + 512, -1)], -1).view(B * s_q, -1)
        ref = sparse_attention_torch(q.float().view(B * s_q, H, D), all_idx,
                                     [unpack_v4_rows(kc)[:512], unpack_v4_rows(ec)[:256]], sink, scale)
        res["check_max_err"] = err = float((out.float().view(B * s_q, H, D) - ref).abs().max())
        res["check_ok"] = err < 5e-2
        log(f"flashmla: check vs torch on dequantised rows: max err {err:.3g} ({'OK' if err < 5e-2 else 'MISMATCH'})")
    except Exception as exc:  # noqa: BLE001
        res["check_error"] = f"{type(exc).__name__}: {str(exc)[:500]}"
        log(f"flashmla: check failed: {res['check_error']}")
        return res
    timings = []
    for b in (1, 16, 64):  # 640 indices per query: 128 window + 512 compressed (as measured before)
        for s_q in (1, 16):
            if time.time() - t0 > budget_s:
                break
            try:
                n_rows = max(4096, b * 1024)
                kc = pack_v4_rows(torch.randn(n_rows, D, generator=g, device=device))
                ec = pack_v4_rows(torch.randn(n_rows * 4, D, generator=g, device=device))
                idx = torch.randint(0, n_rows, (b, s_q, 128), generator=g, device=device, dtype=torch.int32)
                eidx = torch.randint(0, n_rows * 4, (b, s_q, 512), generator=g, device=device, dtype=torch.int32)
                q = torch.randn(b, s_q, H, D, generator=g, device=device).to(torch.bfloat16)
                sink = torch.randn(H, device=device)
                _, sched = flashmla_sparse_attention(q, idx, kc, sink, scale, eidx, ec)
                t = time_us(lambda: flashmla_sparse_attention(q, idx, kc, sink, scale, eidx, ec, sched))
                timings.append({"batch": b, "s_q": s_q, "indices": 640, "us": round(t[0], 2), "timing": t[4]})
                log(f"flashmla: b={b} s_q={s_q} 640 idx: {t[0]:.1f} us")
            except Exception as exc:  # noqa: BLE001
                timings.append({"batch": b, "s_q": s_q, "error": f"{type(exc).__name__}: {str(exc)[:300]}"})
                log(f"flashmla: b={b} s_q={s_q} failed: {type(exc).__name__}: {str(exc)[:300]}")
    res["timings"] = timings
    return res
