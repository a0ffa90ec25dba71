// GDN tree verify: the transposed walk on the K-side tiles, hand-written for sm_90+ (mma.sync,
// ldmatrix / stmatrix, cp.async, programmatic dependent launch).
//
// The same math and buffers as tree_verify.py's _tree_verify_t_kernel (one program per
// (V block, sequence, value head); sub-chunks of 16 nodes, in stored order or through an
// order table, ORD):
//
//   rhs^T = (V^T - S0^T K^T e^G) b - sum_{c2} U_{c2}^T a_{c,c2}^T,   u^T = rhs^T T_c^T
//   acc^T = S0^T Q^T e^G + sum_{c2} U_{c2}^T p_{c,c2}^T + u^T P_cc^T
//
// What Triton cannot express and this file does instead:
// - S0^T stays in registers for the whole walk, as the A fragments of m16n8k16 products
//   (each warp owns 16 * MT value rows: MT * 32 registers per thread), not in shared memory;
// - rhs^T and u^T never leave registers between products: an m16n8 accumulator pair is the
//   A fragment of the next m16n8k16 product once packed to bf16;
// - each warp keeps the u^T fragments of its own value rows for later sub-chunks in shared
//   memory (lane-private slots, so no barrier guards them), instead of the global u buffer;
// - each sub-chunk's rows (q, k, v, beta, G) and tiles (diagonal and pairs) are copied into
//   shared memory one sub-chunk ahead (cp.async, double-buffered), so the walk never waits
//   on a global load; one barrier per sub-chunk;
// - S0 itself comes in by one round of 16-byte copies into the (still unused) shared memory,
//   and u and o go out through stmatrix (transposed into node rows) and 16-byte stores.
// Operands as in the Triton walk: bf16 S0, q, k, tiles, rhs and u; fp32 accumulation.
// reports/h200/gdn/tuning runs 90-93 hold its versions' timings and Nsight pages.
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <stdint.h>

namespace {

constexpr int K = 128;       // key dimension (Qwen3.5/3.6, Qwen3-Next)
constexpr int BT = 16;       // nodes per sub-chunk
constexpr int KS = K / 16;   // k-steps of the S0 products
constexpr int RS = K + 8;    // shared row of q/k in bf16 (padded: conflict-free fragment reads)
constexpr int TILE = BT * BT;

__device__ __forceinline__ uint32_t pack(float lo, float hi) {
  __nv_bfloat162 h = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<uint32_t*>(&h);
}

__device__ __forceinline__ void mma(float c[4], const uint32_t a[4], uint32_t b0, uint32_t b1) {
  asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
      "{%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

__device__ __forceinline__ void cp16(void* dst, const void* src, bool on) {
  unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(dst));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(s), "l"(src),
               "r"(on ? 16 : 0));
}

__device__ __forceinline__ void cp4(void* dst, const void* src, bool on) {
  unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(dst));
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(s), "l"(src),
               "r"(on ? 4 : 0));
}

__device__ __forceinline__ void cp_commit() { asm volatile("cp.async.commit_group;\n"); }
template <int N>
__device__ __forceinline__ void cp_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N)); }

// two m16n8 accumulators (n-tiles 0 and 1) in bf16 as the A fragment of an m16n8k16 product:
// the same registers are the four 8x8 matrices (n-tile, row half) stmatrix stores
__device__ __forceinline__ void c_to_a(uint32_t a[4], const float c[2][4]) {
  a[0] = pack(c[0][0], c[0][1]);
  a[1] = pack(c[0][2], c[0][3]);
  a[2] = pack(c[1][0], c[1][1]);
  a[3] = pack(c[1][2], c[1][3]);
}

// four 8x8 bf16 matrices from shared memory (lanes 8i..8i+7 give matrix i's row addresses)
__device__ __forceinline__ void ldsm4(uint32_t r[4], const void* p) {
  unsigned a = static_cast<unsigned>(__cvta_generic_to_shared(p));
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(a));
}

// the same, each matrix transposed on the way (thread l: row l / 4 of the transpose)
__device__ __forceinline__ void ldsm4t(uint32_t r[4], const void* p) {
  unsigned a = static_cast<unsigned>(__cvta_generic_to_shared(p));
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(a));
}

// four 8x8 bf16 fragment matrices to shared memory, transposed (lanes 8i..8i+7 give the row
// addresses of matrix i's transpose: row j holds its column j)
__device__ __forceinline__ void stsm4t(void* p, const uint32_t r[4]) {
  unsigned a = static_cast<unsigned>(__cvta_generic_to_shared(p));
  asm volatile("stmatrix.sync.aligned.m8n8.x4.trans.shared.b16 [%0], {%1,%2,%3,%4};\n"
               ::"r"(a), "r"(r[0]), "r"(r[1]), "r"(r[2]), "r"(r[3]) : "memory");
}


// one sub-chunk's staged operands (offsets into a stage, in bytes)
template <int BV>
struct Stage {
  static constexpr int k = 0;
  static constexpr int q = k + BT * RS * 2;
  static constexpr int v = q + BT * RS * 2;
  static constexpr int beta = v + BT * (BV + 8) * 2;
  static constexpr int G = beta + BT * 4;
  static constexpr int diag = G + BT * 4;             // T_c, then P_cc (bf16)
  static constexpr int pairs = diag + 2 * TILE * 2;   // each pair's a, then p (bf16)
  static __host__ __device__ int ids(int nc) { return pairs + (nc > 1 ? nc - 1 : 0) * 2 * TILE * 2; }
  static __host__ __device__ int bytes(int nc) { return ids(nc) + 16 * ((nc * 4 + 15) / 16); }
  // beside the two stages: each warp's u^T fragments of every sub-chunk (one uint4 per lane
  // and m-tile; warps x m-tiles = BV / 16); before the walk the same space holds S0 [K, BV]
  // in fp32 rows of s0_row
  static __host__ __device__ int uhist_bytes(int nc) { return nc * (BV / 16) * 32 * 16; }
  static constexpr int s0_row = BV + 4;
};

template <int BV, int MT, bool ORD>
__global__ void __launch_bounds__(BV / (16 * MT) * 32)
walk_kernel(const __nv_bfloat16* __restrict__ qn, const __nv_bfloat16* __restrict__ kn,
            const __nv_bfloat16* __restrict__ v, const float* __restrict__ beta,
            const float* __restrict__ s0, const int64_t* __restrict__ cu,
            const int32_t* __restrict__ pairs, const int32_t* __restrict__ npairs, int NC,
            __nv_bfloat16* __restrict__ o, __nv_bfloat16* __restrict__ u,
            const float* __restrict__ G, const __nv_bfloat16* __restrict__ diag,
            const __nv_bfloat16* __restrict__ ptiles, const int32_t* __restrict__ order, int H,
            int HV, int V, int pdl) {
  constexpr int WARPS = BV / (16 * MT);
  constexpr int THREADS = WARPS * 32;
  using S = Stage<BV>;
  extern __shared__ __align__(16) unsigned char smem[];
  const int stage_bytes = S::bytes(NC);
  unsigned char* stages = smem;
  uint4* uhist = reinterpret_cast<uint4*>(smem + 2 * stage_bytes);   // [NC][WARPS][MT][32]
  int* np_s = reinterpret_cast<int*>(smem + 2 * stage_bytes + S::uhist_bytes(NC));  // [NC]
  int* ord_s = np_s + NC;   // ORD: the stored row of each walked node [NC * 16]

  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const int g = lane / 4, t = lane % 4;
  const int i_v = blockIdx.x, i_bh = blockIdx.y;
  const int i_b = i_bh / HV, i_hv = i_bh % HV, i_h = i_hv / (HV / H);
  const int64_t bos = cu[i_b];
  const int n = static_cast<int>(cu[i_b + 1] - bos);
  const int nc = (n + BT - 1) / BT;
  const int64_t bhv = static_cast<int64_t>(i_b) * HV + i_hv;
  const int vrow0 = warp * 16 * MT;   // this warp's first value row inside the V block

  // S0^T [BV, K] as A fragments (row = value row, column = key index), read from S0 [K, BV]
  // staged in shared memory by one round of 16-byte copies (rows padded: conflict-free reads)
  uint32_t sa[MT][KS][4];
  {
    constexpr int SR = S::s0_row;
    float* s0s = reinterpret_cast<float*>(smem);
    const float* sp = s0 + bhv * K * V + i_v * BV;
#pragma unroll 4
    for (int x = tid; x < K * BV / 4; x += THREADS) {
      const int r = x / (BV / 4), j = x % (BV / 4);
      cp16(s0s + r * SR + j * 4, sp + static_cast<int64_t>(r) * V + j * 4, true);
    }
    cp_commit();
    cp_wait<0>();
    __syncthreads();
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
      for (int ks = 0; ks < KS; ++ks) {
        const float* p = s0s + (ks * 16 + 2 * t) * SR + vrow0 + mt * 16 + g;
        sa[mt][ks][0] = pack(p[0], p[SR]);
        sa[mt][ks][1] = pack(p[8], p[SR + 8]);
        sa[mt][ks][2] = pack(p[8 * SR], p[9 * SR]);
        sa[mt][ks][3] = pack(p[8 * SR + 8], p[9 * SR + 8]);
      }
    __syncthreads();   // the stages and the u fragments reuse this space
  }
  if (pdl) asm volatile("griddepcontrol.wait;\n" ::: "memory");   // the K-side tiles, G
  for (int c = tid; c < nc; c += THREADS) np_s[c] = npairs[i_b * NC + c];
  if constexpr (ORD)
    for (int x = tid; x < n; x += THREADS) ord_s[x] = order[bos + x];
  __syncthreads();

  // what each thread copies of a sub-chunk, fixed for the whole walk: q/k and v pieces of
  // 16 bytes (rows r, piece j), base pointers advanced by 16 nodes per sub-chunk
  constexpr int QK_IT = BT * (K / 8) / THREADS, V_IT = BT * (BV / 8) / THREADS;
  static_assert(QK_IT * THREADS == BT * (K / 8) && V_IT * THREADS == BT * (BV / 8), "pieces");
  const int64_t qk_step = static_cast<int64_t>(BT) * H * K, v_step = static_cast<int64_t>(BT) * HV * V;
  const int64_t qk0 = (bos * H + i_h) * K, v0 = (bos * HV + i_hv) * V + i_v * BV;
  const float* beta0 = beta + bos * HV + i_hv;
  const float* G0 = G + bos * HV + i_hv;
  // the K-side tiles' slots as tree_verify.py's _tile_slot lays them out (change both together)
  const __nv_bfloat16* diag0 = diag + bhv * NC * 2 * TILE;
  const __nv_bfloat16* ptile0 = ptiles + bhv * (static_cast<int64_t>(NC) * (NC - 1) / 2) * 2 * TILE;
  const int32_t* ids0 = pairs + static_cast<int64_t>(i_b) * NC * NC;

  auto prefetch = [&](int c) {
    unsigned char* st = stages + (c & 1) * stage_bytes;
    const int np = np_s[c], left = n - c * BT;   // rows of this sub-chunk: min(left, 16)
    const int64_t qk_c = qk0 + c * qk_step, v_c = v0 + c * v_step;
#pragma unroll
    for (int it = 0; it < QK_IT; ++it) {
      const int x = tid + it * THREADS, r = x / (K / 8), j = x % (K / 8);
      const bool on = r < left;
      int64_t off;
      if constexpr (ORD) off = ((on ? ord_s[c * BT + r] : bos) * H + i_h) * K + j * 8;
      else off = qk_c + (on ? r : 0) * static_cast<int64_t>(H) * K + j * 8;
      cp16(st + S::k + (r * RS + j * 8) * 2, kn + off, on);
      cp16(st + S::q + (r * RS + j * 8) * 2, qn + off, on);
    }
#pragma unroll
    for (int it = 0; it < V_IT; ++it) {
      const int x = tid + it * THREADS, r = x / (BV / 8), j = x % (BV / 8);
      const bool on = r < left;
      int64_t off;
      if constexpr (ORD) off = ((on ? ord_s[c * BT + r] : bos) * HV + i_hv) * V + i_v * BV + j * 8;
      else off = v_c + (on ? r : 0) * static_cast<int64_t>(HV) * V + j * 8;
      cp16(st + S::v + (r * (BV + 8) + j * 8) * 2, v + off, on);
    }
    if (tid < 2 * BT) {
      const int r = tid % BT;
      const bool on = r < left;
      int64_t row;   // from beta0 / G0 (row bos)
      if constexpr (ORD) row = ((on ? ord_s[c * BT + r] : bos) - bos) * HV;
      else row = static_cast<int64_t>(c * BT + (on ? r : 0)) * HV;
      if (tid < BT) cp4(st + S::beta + r * 4, beta0 + row, on);
      else cp4(st + S::G + r * 4, G0 + row, on);
    }
    const __nv_bfloat16* dsrc = diag0 + c * 2 * TILE;
    for (int x = tid; x < 2 * TILE / 8; x += THREADS) cp16(st + S::diag + x * 16, dsrc + x * 8, true);
    const __nv_bfloat16* psrc = ptile0 + (c * (c - 1) / 2) * 2 * TILE;
    for (int x = tid; x < np * 2 * TILE / 8; x += THREADS) cp16(st + S::pairs + x * 16, psrc + x * 8, true);
    if (tid < np) cp4(st + S::ids(NC) + tid * 4, ids0 + c * NC + tid, true);
    cp_commit();
  };

  // this lane's row address inside each ldmatrix.x4 of a [16, K] q/k tile: matrix i = lane / 8
  // holds nodes 8 (i / 2) .. + 7 and keys 8 (i % 2) .. + 7 of a 16-key step
  const int lm = lane / 8;
  const int ldsm_off = (((lm >> 1) * 8 + lane % 8) * RS + (lm & 1) * 8) * 2;   // bytes
  // the same for a [16, 16] tile (elements), and for this warp's value columns of the
  // staged [16, BV] v rows (elements; also where stmatrix writes u and o back)
  const int tile_row = ((lm >> 1) * 8 + lane % 8) * BT + (lm & 1) * 8;
  const int frag_row = ((lm >> 1) * 8 + lane % 8) * (BV + 8) + vrow0 + (lm & 1) * 8;
  // the first u / o element of this warp's value rows (node row 0 of the tree)
  const int64_t row_stride = static_cast<int64_t>(HV) * V;
  const int64_t st0 = bos * row_stride + i_hv * static_cast<int64_t>(V) + i_v * BV + vrow0;
  if (nc > 0) prefetch(0);
  for (int c = 0; c < nc; ++c) {
    cp_wait<0>();
    __syncthreads();   // stage c landed for every thread; stage c + 1's buffer is free
    if (c + 1 < nc) prefetch(c + 1);
    const unsigned char* st = stages + (c & 1) * stage_bytes;
    const __nv_bfloat16* vs_ = reinterpret_cast<const __nv_bfloat16*>(st + S::v);
    const float* bs_ = reinterpret_cast<const float*>(st + S::beta);
    const float* gs_ = reinterpret_cast<const float*>(st + S::G);
    const __nv_bfloat16* ds_ = reinterpret_cast<const __nv_bfloat16*>(st + S::diag);
    const __nv_bfloat16* ps_ = reinterpret_cast<const __nv_bfloat16*>(st + S::pairs);
    const int* ids_ = reinterpret_cast<const int*>(st + S::ids(NC));

    // S0 products: rhs^T = S0^T K^T, acc^T = S0^T Q^T ([16 MT, 16] per warp)
    float rhs[MT][2][4], acc[MT][2][4];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
      for (int nt = 0; nt < 2; ++nt)
#pragma unroll
        for (int i = 0; i < 4; ++i) rhs[mt][nt][i] = acc[mt][nt][i] = 0.f;
#pragma unroll
    for (int ks = 0; ks < KS; ++ks) {
      uint32_t kb[4], qb[4];   // b0, b1 of n-tile 0, then of n-tile 1
      ldsm4(kb, st + S::k + ldsm_off + ks * 32);
      ldsm4(qb, st + S::q + ldsm_off + ks * 32);
#pragma unroll
      for (int nt = 0; nt < 2; ++nt)
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
          mma(rhs[mt][nt], sa[mt][ks], kb[2 * nt], kb[2 * nt + 1]);
          mma(acc[mt][nt], sa[mt][ks], qb[2 * nt], qb[2 * nt + 1]);
        }
    }
    // rhs = b (v - e^G rhs), acc = e^G acc; C element i: value row g + 8 (i / 2), node 2t + i % 2.
    // v^T in that layout straight from the staged [node, value] rows (ldmatrix, transposed):
    // matrix 2 nt + hi of m-tile mt holds nodes 8 nt + 2t, + 1 of value row g + 8 hi
    uint32_t vf[MT][4];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) ldsm4t(vf[mt], vs_ + frag_row + mt * 16);
#pragma unroll
    for (int nt = 0; nt < 2; ++nt)
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int node = nt * 8 + 2 * t + e;
        const float eg = __expf(gs_[node]), b = bs_[node];
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
#pragma unroll
          for (int hi = 0; hi < 2; ++hi) {
            const int i = 2 * hi + e;
            const uint32_t w = vf[mt][2 * nt + hi];
            const float vv = __uint_as_float(e ? (w & 0xffff0000u) : (w << 16));
            rhs[mt][nt][i] = b * (vv - eg * rhs[mt][nt][i]);
            acc[mt][nt][i] *= eg;
          }
      }
    // earlier sub-chunks: rhs -= U_c2^T a^T, acc += U_c2^T p^T (B[k = j][n = r] = tile[r][j])
    const int np = np_s[c];
    for (int p = 0; p < np; ++p) {
      const int c2 = ids_[p];
      const __nv_bfloat16* a_ = ps_ + p * 2 * TILE;
      const __nv_bfloat16* p_ = a_ + TILE;
      uint32_t ua[MT][4];
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) {
        const uint4 x = uhist[((c2 * WARPS + warp) * MT + mt) * 32 + lane];
        ua[mt][0] = x.x; ua[mt][1] = x.y; ua[mt][2] = x.z; ua[mt][3] = x.w;
      }
      uint32_t ab[4], pb[4];   // b0, b1 of n-tile 0, then of n-tile 1
      ldsm4(ab, a_ + tile_row);
      ldsm4(pb, p_ + tile_row);
#pragma unroll
      for (int nt = 0; nt < 2; ++nt)
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {   // a negated (sign bits): rhs -= U a^T
          mma(rhs[mt][nt], ua[mt], ab[2 * nt] ^ 0x80008000u, ab[2 * nt + 1] ^ 0x80008000u);
          mma(acc[mt][nt], ua[mt], pb[2 * nt], pb[2 * nt + 1]);
        }
    }
    // u^T = rhs^T T_c^T, acc^T += u^T P_cc^T; u's bf16 fragments kept for later sub-chunks
    uint32_t ra[MT][4], uf[MT][4];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) c_to_a(ra[mt], rhs[mt]);
    float us[MT][2][4];
    uint32_t tb[4], pb[4];   // T_c and P_cc as B fragments
    ldsm4(tb, ds_ + tile_row);
    ldsm4(pb, ds_ + TILE + tile_row);
#pragma unroll
    for (int nt = 0; nt < 2; ++nt)
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
        for (int i = 0; i < 4; ++i) us[mt][nt][i] = 0.f;
        mma(us[mt][nt], ra[mt], tb[2 * nt], tb[2 * nt + 1]);
      }
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
      c_to_a(uf[mt], us[mt]);
      uhist[((c * WARPS + warp) * MT + mt) * 32 + lane] = make_uint4(uf[mt][0], uf[mt][1], uf[mt][2], uf[mt][3]);
    }
#pragma unroll
    for (int nt = 0; nt < 2; ++nt)
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) mma(acc[mt][nt], uf[mt], pb[2 * nt], pb[2 * nt + 1]);
    // u and o rows (stored order) through this warp's own columns of the v rows staged for
    // this sub-chunk (read only by this warp, and done with): each m-tile's fragments
    // transposed into [node, value] rows, then 16-byte stores of whole row pieces
    uint32_t of[MT][4];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) c_to_a(of[mt], acc[mt]);
    __nv_bfloat16* stg = const_cast<__nv_bfloat16*>(vs_) + vrow0;
    const int64_t st_c = st0 + static_cast<int64_t>(c) * BT * row_stride;
    uint4 piece[2][MT];
#pragma unroll
    for (int which = 0; which < 2; ++which) {   // o, then u
#pragma unroll
      for (int mt = 0; mt < MT; ++mt)
        stsm4t(const_cast<__nv_bfloat16*>(vs_) + frag_row + mt * 16, which ? uf[mt] : of[mt]);
      __syncwarp();
#pragma unroll
      for (int it = 0; it < MT; ++it) {
        const int x = lane + 32 * it, r = x / (2 * MT), j = x % (2 * MT);
        piece[which][it] = *reinterpret_cast<const uint4*>(stg + r * (BV + 8) + j * 8);
      }
      __syncwarp();
    }
#pragma unroll
    for (int it = 0; it < MT; ++it) {
      const int x = lane + 32 * it, r = x / (2 * MT), j = x % (2 * MT);
      if (c * BT + r < n) {
        int64_t off;
        if constexpr (ORD) off = st0 + (ord_s[c * BT + r] - bos) * row_stride + j * 8;
        else off = st_c + r * row_stride + j * 8;
        *reinterpret_cast<uint4*>(o + off) = piece[0][it];
        *reinterpret_cast<uint4*>(u + off) = piece[1][it];
      }
    }
  }
}

template <int BV, int MT, bool ORD>
int launch(void** a, int B, int NC, int H, int HV, int V, int pdl, cudaStream_t stream,
           int* blocks_per_sm) {
  constexpr int THREADS = BV / (16 * MT) * 32;
  using S = Stage<BV>;
  const int walk_smem = 2 * S::bytes(NC) + S::uhist_bytes(NC);
  const int s0_smem = K * S::s0_row * 4;   // S0 staged before the walk, in the same space
  const int smem = (walk_smem > s0_smem ? walk_smem : s0_smem) +
                   16 * ((NC * (ORD ? BT + 1 : 1) * 4 + 15) / 16);
  auto kern = walk_kernel<BV, MT, ORD>;
  // the shared-memory opt-in, raised to the device's limit on the first launch of this
  // instance on each device (the caller makes the launch's GPU the current one); the callers
  // serialise launches per process (Python)
  constexpr int DEVICES = 64;
  static int limit[DEVICES] = {};
  int dev = 0;
  cudaError_t err = cudaGetDevice(&dev);
  if (err != cudaSuccess) return static_cast<int>(err);
  if (dev >= DEVICES || smem > limit[dev]) {
    int most = 0;
    err = cudaDeviceGetAttribute(&most, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev);
    if (err != cudaSuccess) return static_cast<int>(err);
    if (smem > most) return 1001;
    err = cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, most);
    if (err != cudaSuccess) return static_cast<int>(err);
    if (dev < DEVICES) limit[dev] = most;
  }
  if (blocks_per_sm) {
    err = cudaOccupancyMaxActiveBlocksPerMultiprocessor(blocks_per_sm, kern, THREADS, smem);
    return static_cast<int>(err);
  }
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3(V / BV, B * HV);
  cfg.blockDim = dim3(THREADS);
  cfg.dynamicSmemBytes = smem;
  cfg.stream = stream;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = pdl ? 1 : 0;
  cfg.attrs = attr;
  cfg.numAttrs = 1;
  err = cudaLaunchKernelEx(&cfg, kern, static_cast<const __nv_bfloat16*>(a[0]),
                           static_cast<const __nv_bfloat16*>(a[1]),
                           static_cast<const __nv_bfloat16*>(a[2]), static_cast<const float*>(a[3]),
                           static_cast<const float*>(a[4]), static_cast<const int64_t*>(a[5]),
                           static_cast<const int32_t*>(a[6]), static_cast<const int32_t*>(a[7]), NC,
                           static_cast<__nv_bfloat16*>(a[8]), static_cast<__nv_bfloat16*>(a[9]),
                           static_cast<const float*>(a[10]), static_cast<const __nv_bfloat16*>(a[11]),
                           static_cast<const __nv_bfloat16*>(a[12]),
                           static_cast<const int32_t*>(a[13]), H, HV, V, pdl);
  return static_cast<int>(err);
}

template <bool ORD>
int dispatch(void** a, int B, int NC, int H, int HV, int V, int block_v, int mt, int pdl,
             cudaStream_t s, int* blocks_per_sm) {
  if (block_v == 128 && mt == 2) return launch<128, 2, ORD>(a, B, NC, H, HV, V, pdl, s, blocks_per_sm);
  if (block_v == 128 && mt == 1) return launch<128, 1, ORD>(a, B, NC, H, HV, V, pdl, s, blocks_per_sm);
  if (block_v == 64 && mt == 2) return launch<64, 2, ORD>(a, B, NC, H, HV, V, pdl, s, blocks_per_sm);
  if (block_v == 64 && mt == 1) return launch<64, 1, ORD>(a, B, NC, H, HV, V, pdl, s, blocks_per_sm);
  if (block_v == 32 && mt == 2) return launch<32, 2, ORD>(a, B, NC, H, HV, V, pdl, s, blocks_per_sm);
  return 1000;
}

}  // namespace

// a: qn, kn, v, beta, s0, cu, pairs, npairs, o, u, G, diag, pair tiles, order (device
// pointers; order: int32 flat rows of the nodes in walk order, used when ordered != 0).
// blocks_per_sm non-null: only report the resident programs per SM (nothing launched).
// Returns a cudaError_t (0: launched); 1000: no such (block_v, m-tiles per warp); 1001: the
// sub-chunks need more shared memory than a program may hold.
extern "C" int gdn_walk_launch(void** a, int B, int NC, int H, int HV, int V, int block_v, int mt,
                               int pdl, int ordered, void* stream, int* blocks_per_sm) {
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  return ordered ? dispatch<true>(a, B, NC, H, HV, V, block_v, mt, pdl, s, blocks_per_sm)
                 : dispatch<false>(a, B, NC, H, HV, V, block_v, mt, pdl, s, blocks_per_sm);
}

extern "C" const char* gdn_walk_error(int code) {
  if (code == 1000) return "no CUDA walk for this block_v / m-tiles per warp";
  if (code == 1001) return "the trees' sub-chunks need more shared memory than a program may hold";
  return cudaGetErrorString(static_cast<cudaError_t>(code));
}
