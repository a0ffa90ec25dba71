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
// - with a deferred commit's pending path (flags & 8), S0 is folded there, in shared memory,
//   before it is packed (fold_pending), and written back to the state once.
// Operands as in the Triton walk: bf16 S0, q, k, tiles, rhs and u; fp32 accumulation.
// reports/h200/gdn/tuning runs 90-93 hold its versions' timings and Nsight pages.
//
// The walk's modes (MODE): 0 reads the K-side tiles and pre-normalised q / k of the Triton
// pre-pass and K-side kernel; 1 computes the tiles itself (kside_products / kside_store, one
// warp per tile, from a k history in shared memory); 2 reads raw q / k and the tiles of this
// file's K-side kernel (kside_kernel), which also writes G and each row's q / k multipliers,
// so the verify is two kernels (the launch rule's, tuning runs 94-107).
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <stdint.h>

namespace {

constexpr int K = 128;       // key dimension (Qwen3.5/3.6, Qwen3-Next)
constexpr int BT = 16;       // nodes per sub-chunk
constexpr int KS_STEPS = K / 16;   // k-steps of the [*, K] products
constexpr int RS = K + 8;    // shared row of q/k in bf16 (padded: conflict-free fragment reads)
constexpr int TILE = BT * BT;

// 64-bit words of ancestor bits a row needs for nc sub-chunks (sub-chunk c's 16 bits: word
// c / 4, shift 16 (c % 4))
__host__ __device__ constexpr int bit_words(int nc) { return (nc + 3) / 4; }

// the K-side tiles of (sequence, value head) bhv in a buffer of `slots` per bhv: tiles
// `slot` (two [16, 16] bf16 tiles), as tree_verify.py's _tile_slot lays them out (change
// both together): diagonal buffer NC slots (slot c), pair buffer NC (NC - 1) / 2 (slot
// c (c - 1) / 2 + i for sub-chunk c's i-th pair)
__host__ __device__ inline int64_t tile_slot(int64_t bhv, int64_t slots, int64_t slot) {
  return (bhv * slots + slot) * 2 * TILE;
}
__host__ __device__ inline int64_t pair_slots(int nc) { return static_cast<int64_t>(nc) * (nc - 1) / 2; }

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

__device__ __forceinline__ void cp8(void* dst, const void* src, bool on) {
  unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(dst));
  asm volatile("cp.async.ca.shared.global [%0], [%1], 8, %2;\n" ::"r"(s), "l"(src),
               "r"(on ? 8 : 0));
}

__device__ __forceinline__ void cp_commit() { asm volatile("cp.async.commit_group;\n"); }

// `bytes` (a multiple of 16) from global memory into L2, nothing waiting on it (sm_90 bulk copy
// engine)
__device__ __forceinline__ void prefetch_l2(const void* src, unsigned bytes) {
  asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;\n" ::"l"(src), "r"(bytes) : "memory");
}
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


// one sub-chunk's staged operands (offsets into a stage, in bytes).  KS (the walk computes
// the K-side tiles itself): no tiles and no k rows in a stage (k goes to the k history, which
// later sub-chunks' pair tiles read again), G to the whole tree's G; the rows' ancestor bits
// (uint64 words 0 .. words(nc) - 1 of each row) instead.  NRM (raw q and k rows): each row's
// multipliers too (scale / |q|, 1 / |k|, from the CUDA K-side kernel).
template <int BV, bool KS, bool NRM = false>
struct Stage {
  static constexpr int k = 0;                                    // !KS
  static constexpr int q = KS ? 0 : k + BT * RS * 2;
  static constexpr int v = q + BT * RS * 2;
  static constexpr int beta = v + BT * (BV + 8) * 2;
  static constexpr int G = beta + BT * 4;                        // !KS
  static constexpr int mult = G + (KS ? 0 : BT * 4);             // NRM: q's, then k's [2][16]
  static constexpr int diag = mult + (NRM ? 2 * BT * 4 : 0);     // !KS: T_c, then P_cc (bf16)
  static constexpr int pairs = diag + (KS ? 0 : 2 * TILE * 2);   // !KS: each pair's a, then p
  static __host__ __device__ int ids(int nc) {
    return pairs + (KS || nc <= 1 ? 0 : (nc - 1) * 2 * TILE * 2);
  }
  static __host__ __device__ int bits(int nc) { return ids(nc) + 16 * ((nc * 4 + 15) / 16); }
  static __host__ __device__ int words(int nc) { return bit_words(nc); }
  static __host__ __device__ int bytes(int nc) { return bits(nc) + (KS ? BT * words(nc) * 8 : 0); }
  // beside the two stages: each warp's u^T fragments of every sub-chunk (one uint4 per lane
  // and m-tile; warps x m-tiles = BV / 16); before the walk the same space holds S0 [K, BV]
  // in fp32 rows of s0_row
  static __host__ __device__ int uhist_bytes(int nc) { return nc * (BV / 16) * 32 * 16; }
  // KS, after those: k rows of every sub-chunk, G of every node, the step's tiles (slot 0:
  // T_c, P_cc; slot 1 + p: pair p's a, p; bf16) and the fp32 A_cc T_c is solved from
  static __host__ __device__ int khist_bytes(int nc) { return KS ? nc * BT * RS * 2 : 0; }
  static __host__ __device__ int gall_bytes(int nc) { return KS ? nc * BT * 4 : 0; }
  static __host__ __device__ int tiles_bytes(int nc) { return KS ? nc * 2 * TILE * 2 : 0; }
  static constexpr int ascr_bytes = KS ? TILE * 4 : 0;
  static __host__ __device__ int walk_bytes(int nc) {
    return 2 * bytes(nc) + uhist_bytes(nc) + khist_bytes(nc) + gall_bytes(nc) +
           tiles_bytes(nc) + ascr_bytes;
  }
  static constexpr int s0_row = BV + 4;
};

// One warp's K-side products for sub-chunk c (rows: k rows `krow`, q rows `qrow`, [16, RS]
// bf16 in shared memory) against sub-chunk c2 (k rows `kcol`; c2 == c: the diagonal block):
// kk = K_c K_c2^T and qk = Q_c K_c2^T (mma, fp32).  C element i of n-tile nt: row
// g + 8 (i / 2), column 8 nt + 2t + i % 2.
__device__ __forceinline__ void kside_products(float kk[2][4], float qk[2][4],
                                               const unsigned char* krow,
                                               const unsigned char* qrow,
                                               const unsigned char* kcol, int ldsm_off) {
#pragma unroll
  for (int nt = 0; nt < 2; ++nt)
#pragma unroll
    for (int i = 0; i < 4; ++i) kk[nt][i] = qk[nt][i] = 0.f;
#pragma unroll
  for (int ks = 0; ks < KS_STEPS; ++ks) {
    uint32_t ka[4], qa[4], kb[4];   // ldmatrix's (node half, key half) order: A wants 0 2 1 3
    ldsm4(ka, krow + ldsm_off + ks * 32);
    ldsm4(qa, qrow + ldsm_off + ks * 32);
    ldsm4(kb, kcol + ldsm_off + ks * 32);
    const uint32_t ak[4] = {ka[0], ka[2], ka[1], ka[3]}, aq[4] = {qa[0], qa[2], qa[1], qa[3]};
#pragma unroll
    for (int nt = 0; nt < 2; ++nt) {
      mma(kk[nt], ak, kb[2 * nt], kb[2 * nt + 1]);
      mma(qk[nt], aq, kb[2 * nt], kb[2 * nt + 1]);
    }
  }
}

// One value head's tiles from those products, as _tree_kside_kernel's _kside_heads computes
// them: decayed (e^{G_r - G_j}, `grow` / `gcol` the rows' and columns' G) on the ancestor
// pairs of the rows' bits (`bits_s`: [16, wn] uint64 words, walk order), a times beta_r, into
// `out` (bf16 [16, 16] a, then p; shared or global memory).  The diagonal block's a is
// A_cc's strictly lower part, which goes to `ascr` ([16 * 16] fp32, shared memory) instead:
// `solve_column` turns it into T_c = (I + A_cc)^-1 after a __syncwarp.
__device__ __forceinline__ void kside_store(__nv_bfloat16* out, float* ascr, const float kk[2][4],
                                            const float qk[2][4], const uint64_t* bits_s, int wn,
                                            const float* grow, const float* gcol,
                                            const float* beta_s, int c2, bool diag, int lane) {
  const int g = lane / 4, t = lane % 4;
#pragma unroll
  for (int hi = 0; hi < 2; ++hi) {
    const int r = g + 8 * hi;
    const uint32_t m16 =
        static_cast<uint32_t>(bits_s[r * wn + (c2 >> 2)] >> ((c2 & 3) * 16)) & 0xffffu;
    const float gr = grow[r], br = beta_s[r];
#pragma unroll
    for (int nt = 0; nt < 2; ++nt) {
      float a[2], p[2];
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int j = nt * 8 + 2 * t + e, i = 2 * hi + e;
        const bool anc = (m16 >> j) & 1u;
        const float d = anc ? __expf(gr - gcol[j]) : 0.f;   // G_j >= G_r on the ancestors
        a[e] = diag && j >= r ? 0.f : br * kk[nt][i] * d;
        p[e] = qk[nt][i] * d;
      }
      const int at = r * BT + nt * 8 + 2 * t;
      *reinterpret_cast<uint32_t*>(out + TILE + at) = pack(p[0], p[1]);
      if (diag) *reinterpret_cast<float2*>(ascr + at) = make_float2(a[0], a[1]);
      else *reinterpret_cast<uint32_t*>(out + at) = pack(a[0], a[1]);
    }
  }
}

// column m (0-15) of T = (I + A)^-1 for the strictly lower A in `ascr` ([16 * 16] fp32), into
// `out` (bf16 [16, 16]): T[i][m] = [i == m] - sum_{j < i} A[i][j] T[j][m], forward
// substitution in fp32
__device__ __forceinline__ void solve_column(__nv_bfloat16* out, const float* ascr, int m) {
  float col[BT];
#pragma unroll
  for (int i = 0; i < BT; ++i) col[i] = 0.f;
#pragma unroll
  for (int i = 0; i < BT; ++i) {
    float s = i == m ? 1.f : 0.f;
#pragma unroll
    for (int j = 0; j < i; j += 4) {   // A[i][j'] = 0 and col[j'] = 0 for j' >= i
      const float4 a4 = *reinterpret_cast<const float4*>(ascr + i * BT + j);
      s -= a4.x * col[j] + a4.y * col[j + 1] + a4.z * col[j + 2] + a4.w * col[j + 3];
    }
    col[i] = s;
  }
#pragma unroll
  for (int i = 0; i < BT; ++i) out[i * BT + m] = __float2bfloat16(col[i]);
}

// The deferred commit's fold (docs/math/gdn_tree_solve.md, "The commit deferred"), before the
// walk packs S0: the staged tile s0s [K, BV] (rows SR apart) becomes S* = d S + sum_p w_p
// k_p u_p^T where column j's path waits (pon), is written back to the state s0 and the
// column's flag cleared.  Pending rows of sequence i_b: pk fp32 [P, H, K], pw fp32 [P, HV], pu
// bf16 [P, HV, V], pdec fp32 [HV], plen [B].  THREADS is a multiple of BV: each thread keeps
// one column j and its w_p u_p in registers, 16 path rows at a time, and walks its rows of K
// (k_p[r] is one address across the warp: broadcast loads).  fp32 FMAs.
template <int BV, int THREADS, int SR>
__device__ __forceinline__ void fold_pending(float* s0s, float* __restrict__ s0, int64_t bhv,
                                             int i_b, int i_hv, int i_h, int i_v, int H, int HV,
                                             int V, int P, const float* __restrict__ pk,
                                             const float* __restrict__ pw,
                                             const __nv_bfloat16* __restrict__ pu,
                                             const float* __restrict__ pdec,
                                             int8_t* __restrict__ pon,
                                             const int32_t* __restrict__ plen) {
  static_assert(THREADS % BV == 0, "whole columns per thread group");
  constexpr int RG = THREADS / BV;
  const int tid = threadIdx.x, j = tid % BV, rg = tid / BV;
  const int64_t col = static_cast<int64_t>(i_v) * BV + j;
  int8_t* onp = pon + bhv * V + col;
  const bool on = *onp != 0;
  if (on) {
    const int np = plen[i_b];
    const float dec = pdec[bhv];
    for (int r = rg; r < K; r += RG) s0s[r * SR + j] *= dec;
    for (int p0 = 0; p0 < np; p0 += 16) {
      float wu[16];
#pragma unroll
      for (int p = 0; p < 16; ++p) {
        const int64_t row = static_cast<int64_t>(i_b) * P + p0 + p;
        wu[p] = p0 + p < np ? pw[row * HV + i_hv] * __bfloat162float(pu[(row * HV + i_hv) * V + col]) : 0.f;
      }
      const float* kp = pk + ((static_cast<int64_t>(i_b) * P + p0) * H + i_h) * K;
      const int pn = np - p0 < 16 ? np - p0 : 16;
      for (int r = rg; r < K; r += RG) {
        float acc = s0s[r * SR + j];
#pragma unroll
        for (int p = 0; p < 16; ++p)
          if (p < pn) acc += wu[p] * kp[static_cast<int64_t>(p) * H * K + r];
        s0s[r * SR + j] = acc;
      }
    }
    float* sw = s0 + bhv * K * V + col;
    for (int r = rg; r < K; r += RG) sw[static_cast<int64_t>(r) * V] = s0s[r * SR + j];
  }
  __syncthreads();   // every thread of the column read its flag; the packing reads s0s
  if (on && rg == 0) *onp = 0;
}

// MODE 0: pre-normalised q / k and the K-side kernel's tiles; 1 (KS): the walk computes the
// tiles itself; 2 (NRM): raw q / k rows and their multipliers (`mults` [N, H, 2]: scale / |q|,
// 1 / |k|) with the CUDA K-side kernel's tiles, the S0 products scaled per node in fp32
template <int BV, int MT, bool ORD, int MODE>
__global__ void __launch_bounds__(BV / (16 * MT) * 32)
walk_kernel(const __nv_bfloat16* __restrict__ qn, const __nv_bfloat16* __restrict__ kn,
            const __nv_bfloat16* __restrict__ v, const float* __restrict__ beta,
            float* __restrict__ s0, const int64_t* __restrict__ cu,
            const int32_t* __restrict__ pairs, const int32_t* __restrict__ npairs, int NC,
            __nv_bfloat16* __restrict__ o, __nv_bfloat16* __restrict__ u,
            const float* __restrict__ G, const __nv_bfloat16* __restrict__ diag,
            const __nv_bfloat16* __restrict__ ptiles, const int32_t* __restrict__ order,
            const int64_t* __restrict__ bits, const float* __restrict__ mults, int W, int H,
            int HV, int V, int pdl, int pf, int flags, const float* __restrict__ pk,
            const float* __restrict__ pw, const __nv_bfloat16* __restrict__ pu,
            const float* __restrict__ pdec, int8_t* __restrict__ pon,
            const int32_t* __restrict__ plen) {
  constexpr bool KS = MODE == 1, NRM = MODE == 2;
  constexpr int WARPS = BV / (16 * MT);
  static_assert(!NRM || WARPS * 32 >= 4 * BT, "threads 2 BT .. 4 BT copy the rows' multipliers");
  constexpr int THREADS = WARPS * 32;
  using S = Stage<BV, KS, NRM>;
  extern __shared__ __align__(16) unsigned char smem[];
  const int stage_bytes = S::bytes(NC);
  unsigned char* stages = smem;
  uint4* uhist = reinterpret_cast<uint4*>(smem + 2 * stage_bytes);   // [NC][WARPS][MT][32]
  unsigned char* rest = smem + 2 * stage_bytes + S::uhist_bytes(NC);
  // KS: k rows [NC][16][RS], G [NC * 16], tiles [NC][2][16 * 16], A_cc [16 * 16]
  __nv_bfloat16* khist = reinterpret_cast<__nv_bfloat16*>(rest);
  float* gall = reinterpret_cast<float*>(rest + S::khist_bytes(NC));
  __nv_bfloat16* tiles =
      reinterpret_cast<__nv_bfloat16*>(rest + S::khist_bytes(NC) + S::gall_bytes(NC));
  float* ascr = reinterpret_cast<float*>(reinterpret_cast<unsigned char*>(tiles) + S::tiles_bytes(NC));
  int* np_s = reinterpret_cast<int*>(reinterpret_cast<unsigned char*>(ascr) + S::ascr_bytes);  // [NC]
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
  uint32_t sa[MT][KS_STEPS][4];
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
    if (flags & 8)
      fold_pending<BV, THREADS, SR>(s0s, s0, bhv, i_b, i_hv, i_h, i_v, H, HV, V, flags >> 8, pk, pw,
                                    pu, pdec, pon, plen);
    // pf > 0: the S0 of the program pf rows on (the one that takes this program's place when
    // a set of pf resident rows runs at a time) into L2 while this one walks, so its loads
    // come from L2 rather than from memory all at once (flags & 4: two sub-chunks before
    // this program's end instead, so it holds L2 for less of the walk)
    if (pf && !(flags & 4) && tid == 0 && i_v == 0 && i_bh + pf < static_cast<int>(gridDim.y))
      prefetch_l2(s0 + (bhv + pf) * K * V, K * V * 4);
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
      for (int ks = 0; ks < KS_STEPS; ++ks) {
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
  // this (sequence, value head)'s K-side tiles (tile_slot)
  const __nv_bfloat16* diag0 = diag + tile_slot(bhv, NC, 0);
  const __nv_bfloat16* ptile0 = ptiles + tile_slot(bhv, pair_slots(NC), 0);
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
      unsigned char* kdst = KS ? reinterpret_cast<unsigned char*>(khist + c * BT * RS) : st + S::k;
      cp16(kdst + (r * RS + j * 8) * 2, kn + off, on);
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
      else cp4(KS ? reinterpret_cast<unsigned char*>(gall + c * BT + r) : st + S::G + r * 4, G0 + row, on);
    } else if (NRM && tid < 4 * BT) {   // the rows' q, then k multipliers
      const int r = tid % BT, which = tid / BT - 2;
      const bool on = r < left;
      int64_t row;
      if constexpr (ORD) row = on ? ord_s[c * BT + r] : bos;
      else row = bos + c * BT + (on ? r : 0);
      cp4(st + S::mult + (which * BT + r) * 4, mults + (row * H + i_h) * 2 + which, on);
    }
    if constexpr (KS) {   // the rows' ancestor bits (walk order: row bos + position)
      const int wn = S::words(NC);
      for (int x = tid; x < BT * wn; x += THREADS) {
        const int r = x / wn, w = x % wn;
        const bool on = r < left;
        cp8(st + S::bits(NC) + x * 8, bits + (bos + c * BT + (on ? r : 0)) * W + w, on);
      }
    } else {
      const __nv_bfloat16* dsrc = diag0 + c * 2 * TILE;
      for (int x = tid; x < 2 * TILE / 8; x += THREADS) cp16(st + S::diag + x * 16, dsrc + x * 8, true);
      const __nv_bfloat16* psrc = ptile0 + (c * (c - 1) / 2) * 2 * TILE;
      for (int x = tid; x < np * 2 * TILE / 8; x += THREADS) cp16(st + S::pairs + x * 16, psrc + x * 8, true);
    }
    for (int x = tid; x < np; x += THREADS) cp4(st + S::ids(NC) + x * 4, ids0 + c * NC + x, true);
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
    if (pf && (flags & 4) && c == (nc > 2 ? nc - 2 : 0) && tid == 0 && i_v == 0 &&
        i_bh + pf < static_cast<int>(gridDim.y))
      prefetch_l2(s0 + (bhv + pf) * K * V, K * V * 4);
    constexpr int VL = BV >= 64 ? BV / 64 : 1;   // 128-byte lines of a v row
    if ((flags & 2) && c + 2 < nc && tid < BT * VL) {   // v rows of c + 2 into L2
      const int r = tid / VL, j = tid % VL;
      if ((c + 2) * BT + r < n) {
        int64_t off;
        if constexpr (ORD) off = (static_cast<int64_t>(ord_s[(c + 2) * BT + r]) * HV + i_hv) * V + i_v * BV;
        else off = v0 + (c + 2) * v_step + r * static_cast<int64_t>(HV) * V;
        asm volatile("prefetch.global.L2 [%0];\n" ::"l"(v + off + j * 64));
      }
    }
    const unsigned char* st = stages + (c & 1) * stage_bytes;
    const __nv_bfloat16* vs_ = reinterpret_cast<const __nv_bfloat16*>(st + S::v);
    const float* bs_ = reinterpret_cast<const float*>(st + S::beta);
    const float* gs_ = KS ? gall + c * BT : reinterpret_cast<const float*>(st + S::G);
    const __nv_bfloat16* ds_ = KS ? tiles : reinterpret_cast<const __nv_bfloat16*>(st + S::diag);
    const __nv_bfloat16* ps_ = KS ? tiles + 2 * TILE : reinterpret_cast<const __nv_bfloat16*>(st + S::pairs);
    const int* ids_ = reinterpret_cast<const int*>(st + S::ids(NC));
    const unsigned char* ks_ = KS ? reinterpret_cast<const unsigned char*>(khist + c * BT * RS) : st + S::k;
    const int np = np_s[c];
    if constexpr (KS)   // this step's tiles: job 0 the diagonal block, job 1 + p pair p
      for (int job = warp; job <= np; job += WARPS) {
        const int c2 = job ? ids_[job - 1] : c;
        float kk[2][4], qk[2][4];
        kside_products(kk, qk, ks_, st + S::q,
                       reinterpret_cast<const unsigned char*>(khist + c2 * BT * RS), ldsm_off);
        kside_store(tiles + job * 2 * TILE, ascr, kk, qk,
                    reinterpret_cast<const uint64_t*>(st + S::bits(NC)), S::words(NC), gs_,
                    gall + c2 * BT, bs_, c2, job == 0, lane);
        if (job == 0) {
          __syncwarp();
          if (lane < BT) solve_column(tiles, ascr, lane);
          __syncwarp();   // the warp whole again before its next aligned mma / ldmatrix
        }
      }

    // S0 products: rhs^T = S0^T K^T, acc^T = S0^T Q^T ([16 MT, 16] per warp)
    float rhs[MT][2][4], acc[MT][2][4];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
      for (int nt = 0; nt < 2; ++nt)
#pragma unroll
        for (int i = 0; i < 4; ++i) rhs[mt][nt][i] = acc[mt][nt][i] = 0.f;
#pragma unroll
    for (int ks = 0; ks < KS_STEPS; ++ks) {
      uint32_t kb[4], qb[4];   // b0, b1 of n-tile 0, then of n-tile 1
      ldsm4(kb, ks_ + ldsm_off + ks * 32);
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
        const float* ms_ = reinterpret_cast<const float*>(st + S::mult);
        const float egk = NRM ? eg * ms_[BT + node] : eg, egq = NRM ? eg * ms_[node] : eg;
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
#pragma unroll
          for (int hi = 0; hi < 2; ++hi) {
            const int i = 2 * hi + e;
            const uint32_t w = vf[mt][2 * nt + hi];
            const float vv = __uint_as_float(e ? (w & 0xffff0000u) : (w << 16));
            rhs[mt][nt][i] = b * (vv - egk * rhs[mt][nt][i]);
            acc[mt][nt][i] *= egq;
          }
      }
    if constexpr (KS) __syncthreads();   // every job's tiles
    // earlier sub-chunks: rhs -= U_c2^T a^T, acc += U_c2^T p^T (B[k = j][n = r] = tile[r][j])
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
        if (flags & 1) {   // streaming (evict-first): o and u not read again by this verify
          __stcs(reinterpret_cast<uint4*>(o + off), piece[0][it]);
          __stcs(reinterpret_cast<uint4*>(u + off), piece[1][it]);
        } else {
          *reinterpret_cast<uint4*>(o + off) = piece[0][it];
          *reinterpret_cast<uint4*>(u + off) = piece[1][it];
        }
      }
    }
  }
}

// the shared-memory opt-in of one kernel (`limit`: that kernel's, per device), raised to the
// device's limit on the kernel's first launch on each device (the caller makes the launch's
// GPU the current one; the callers serialise launches per process, Python)
constexpr int DEVICES = 64;
int opt_in(const void* kern, int smem, int* limit) {
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
  return 0;
}

// The K-side tiles by their own kernel, for the CUDA walk on raw q / k rows (MODE 2): what
// _tree_kside_kernel writes (the same tiles in the same slots, tree_verify.py's _tile_slot),
// and what the pre-pass would: G (each node's ancestor-or-self sum of g, per value head) and,
// instead of normalised copies of q and k, each row's multipliers (`mults` [N, H, 2]: scale /
// |q|, 1 / |k|; scale and 1 without the L2 norm), so the verify is two kernels.  One program
// per (sequence, key head) of WARPS warps (8 or 12, two programs per SM either way): the
// tree's raw q and k rows come into shared
// memory in one round of copies; the warps share out the tree's jobs (each sub-chunk c's
// diagonal block and pairs, listed once in shared memory): each job's k.k and q.k products
// once, on the raw bf16 rows, scaled by the rows' multipliers in fp32, then the tiles of each
// of the key head's HV / H value heads (beta and the decays are per value head).  PDL: the
// first kernel of the verify (launched after everything it reads); lets the walk start at once.
template <int WARPS>
struct KTree {   // shared memory of a K-side program (bytes): nc sub-chunks, R value heads
  static __host__ __device__ int k(int nc) { return nc * BT * RS * 2; }   // q rows at 0
  static __host__ __device__ int ascr(int nc) { return 2 * k(nc); }   // [warps][2][TILE] fp32
  static __host__ __device__ int bits(int nc) { return ascr(nc) + WARPS * 2 * TILE * 4; }
  static __host__ __device__ int words(int nc) { return bit_words(nc); }
  static __host__ __device__ int G(int nc) { return bits(nc) + nc * BT * words(nc) * 8; }
  static __host__ __device__ int g(int nc, int R) { return G(nc) + R * nc * BT * 4; }
  static __host__ __device__ int beta(int nc, int R) { return g(nc, R) + R * nc * BT * 4; }
  static __host__ __device__ int mult(int nc, int R) { return beta(nc, R) + R * nc * BT * 4; }
  static __host__ __device__ int jobs(int nc, int R) { return mult(nc, R) + 2 * nc * BT * 4; }
  // the job list [nc * nc] (c | c2 << 8 | slot << 16), its length, then npairs [nc] and
  // pairs [nc][nc] as read
  static __host__ __device__ int bytes(int nc, int R) { return jobs(nc, R) + (2 * nc * nc + nc + 1) * 4; }
};

// sum of squares of the 8 bf16 of a 16-byte piece (fp32)
__device__ __forceinline__ float sumsq(const uint4 x) {
  float s = 0.f;
  const uint32_t w[4] = {x.x, x.y, x.z, x.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float lo = __uint_as_float(w[i] << 16), hi = __uint_as_float(w[i] & 0xffff0000u);
    s += lo * lo + hi * hi;
  }
  return s;
}

template <bool ORD, bool L2NORM, int WARPS>
__global__ void __launch_bounds__(WARPS * 32, 2)   // two programs an SM
kside_kernel(const __nv_bfloat16* __restrict__ q, const __nv_bfloat16* __restrict__ k,
             const float* __restrict__ gin, const float* __restrict__ beta,
             const int64_t* __restrict__ bits, const int64_t* __restrict__ cu,
             const int32_t* __restrict__ pairs, const int32_t* __restrict__ npairs,
             const int32_t* __restrict__ order, float* __restrict__ G, float* __restrict__ mults,
             __nv_bfloat16* __restrict__ diag, __nv_bfloat16* __restrict__ ptiles,
             const float* __restrict__ s0, float scale, int NC, int W, int H, int HV, int V,
             int pdl, int pf) {
  constexpr int THREADS = WARPS * 32;
  // the multiplier loop's full-warp shuffles need whole warps in every iteration: each
  // sub-chunk adds 2 BT 8 pieces to its bound, a multiple of 32, so every warp (its first piece
  // a multiple of 32) runs an iteration whole or not at all
  static_assert((2 * BT * 8) % 32 == 0, "whole warps in the multiplier loop");
  extern __shared__ __align__(16) unsigned char smem[];
  if (pdl) asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
  using S = KTree<WARPS>;
  const int R = HV / H, i_b = blockIdx.x / H, i_h = blockIdx.x % H, hv0 = i_h * R;
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const int64_t bos = cu[i_b];
  const int n = static_cast<int>(cu[i_b + 1] - bos), nc = (n + BT - 1) / BT, rows = nc * BT;
  const int wn = S::words(NC);
  int* jobs = reinterpret_cast<int*>(smem + S::jobs(NC, R));
  int* njobs = jobs + NC * NC;
  int* np_s = njobs + 1;
  int* pairs_s = np_s + NC;
  auto row_of = [&](int pos) -> int64_t {   // flat row of the node at walk position pos (< n)
    if constexpr (ORD) return order[bos + pos];
    else return bos + pos;
  };
  // the sub-chunk pairs in a group of copies of their own, ahead of the rows: the job list
  // needs only them, so it is built while the rows still land
  for (int x = tid; x < nc; x += THREADS) cp4(np_s + x, npairs + i_b * NC + x, true);
  for (int x = tid; x < nc * NC; x += THREADS)
    cp4(pairs_s + x, pairs + static_cast<int64_t>(i_b) * NC * NC + x, true);
  cp_commit();
  // every row's q and k (16-byte pieces), g and beta per value head, ancestor bits
  __nv_bfloat16* qs = reinterpret_cast<__nv_bfloat16*>(smem);
  __nv_bfloat16* ks = reinterpret_cast<__nv_bfloat16*>(smem + S::k(NC));
  for (int x = tid; x < rows * (K / 8); x += THREADS) {
    const int r = x / (K / 8), j = x % (K / 8);
    const bool on = r < n;
    const int64_t off = ((on ? row_of(r) : bos) * H + i_h) * K + j * 8;
    cp16(qs + r * RS + j * 8, q + off, on);
    cp16(ks + r * RS + j * 8, k + off, on);
  }
  float* Gs = reinterpret_cast<float*>(smem + S::G(NC));       // [R][NC * 16]
  float* gs = reinterpret_cast<float*>(smem + S::g(NC, R));
  float* bs = reinterpret_cast<float*>(smem + S::beta(NC, R));
  float* ms = reinterpret_cast<float*>(smem + S::mult(NC, R));  // [2][NC * 16]: q's, k's
  for (int x = tid; x < R * rows; x += THREADS) {
    const int hv = x / rows, r = x % rows;
    const bool on = r < n;
    const int64_t at = (on ? row_of(r) : bos) * HV + hv0 + hv;
    cp4(gs + hv * NC * BT + r, gin + at, on);
    cp4(bs + hv * NC * BT + r, beta + at, on);
  }
  const uint64_t* bits_s = reinterpret_cast<const uint64_t*>(smem + S::bits(NC));  // [NC * 16][wn]
  for (int x = tid; x < rows * wn; x += THREADS) {
    const int r = x / wn, w = x % wn;
    cp8(smem + S::bits(NC) + x * 8, bits + (bos + (r < n ? r : 0)) * W + w, r < n);
  }
  cp_commit();
  cp_wait<1>();   // the pairs
  __syncthreads();
  if (tid == 0) {   // the jobs: every sub-chunk's diagonal block (the longest), then the pairs
    int j = 0;
    for (int c = 0; c < nc; ++c) jobs[j++] = c | c << 8;
    for (int c = 0; c < nc; ++c)
      for (int p = 0; p < np_s[c]; ++p) jobs[j++] = c | pairs_s[c * NC + p] << 8 | (p + 1) << 16;
    *njobs = j;
  }
  cp_wait<0>();
  __syncthreads();
  // pf > 0: the S0 of this program's value heads into L2 where they are among the walk's
  // first pf rows (those the walk's first resident programs load at once)
  if (pf && tid < R && static_cast<int64_t>(i_b) * HV + hv0 + tid < pf)
    prefetch_l2(s0 + (static_cast<int64_t>(i_b) * HV + hv0 + tid) * K * V, K * V * 4);
  // each row's multipliers (8 threads per row, 16 elements each; rows past the tree: zeros)
  for (int x = tid; x < 2 * rows * 8; x += THREADS) {   // whole warps: 2 rows 8 = 256 nc
    const int row = x / 8, part = x % 8, r = row % rows;
    const bool isq = row < rows;
    const uint4* p = reinterpret_cast<const uint4*>((isq ? qs : ks) + r * RS + part * 16);
    float ss = sumsq(p[0]) + sumsq(p[1]);
    ss += __shfl_xor_sync(0xffffffffu, ss, 1);
    ss += __shfl_xor_sync(0xffffffffu, ss, 2);
    ss += __shfl_xor_sync(0xffffffffu, ss, 4);
    const float m = isq ? scale : 1.f;
    const float mult = L2NORM ? m * rsqrtf(fmaxf(ss, 1e-12f)) : m;   // m / max(|x|, 1e-6)
    if (part == 0) {
      ms[(isq ? 0 : NC * BT) + r] = mult;
      if (r < n) mults[(row_of(r) * H + i_h) * 2 + (isq ? 0 : 1)] = mult;
    }
  }
  // G of every node and value head: the sum of g over its ancestor bits (walk order)
  for (int x = tid; x < R * rows; x += THREADS) {
    const int hv = x / rows, r = x % rows;
    float acc = 0.f;
    if (r < n)
      for (int w = 0; w < wn; ++w)
        for (uint64_t word = bits_s[r * wn + w]; word; word &= word - 1)
          acc += gs[hv * NC * BT + w * 64 + __ffsll(static_cast<long long>(word)) - 1];
    Gs[hv * NC * BT + r] = acc;
    if (r < n) G[row_of(r) * HV + hv0 + hv] = acc;
  }
  __syncthreads();
  const int lm = lane / 8, g = lane / 4, t = lane % 4;
  const int ldsm_off = (((lm >> 1) * 8 + lane % 8) * RS + (lm & 1) * 8) * 2;
  float* ascr = reinterpret_cast<float*>(smem + S::ascr(NC)) + warp * 2 * TILE;
  const unsigned char* q8 = reinterpret_cast<const unsigned char*>(qs);
  const unsigned char* k8 = reinterpret_cast<const unsigned char*>(ks);
  for (int j = warp; j < *njobs; j += WARPS) {
    const int c = jobs[j] & 0xff, c2 = (jobs[j] >> 8) & 0xff, slot = jobs[j] >> 16;
    float kk[2][4], qk[2][4];
    kside_products(kk, qk, k8 + c * BT * RS * 2, q8 + c * BT * RS * 2, k8 + c2 * BT * RS * 2,
                   ldsm_off);
    // C element i of n-tile nt: row g + 8 (i / 2) of c, column 8 nt + 2t + i % 2 of c2
#pragma unroll
    for (int nt = 0; nt < 2; ++nt)
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const int r = c * BT + g + 8 * (i / 2), col = c2 * BT + nt * 8 + 2 * t + i % 2;
        const float mk = ms[NC * BT + col];
        kk[nt][i] *= ms[NC * BT + r] * mk;
        qk[nt][i] *= ms[r] * mk;
      }
    // two value heads at a time, so lanes 0-15 and 16-31 solve the two diagonal blocks'
    // inverses side by side
    for (int hv = 0; hv < R; hv += 2) {
      __nv_bfloat16* out[2];
#pragma unroll
      for (int h2 = 0; h2 < 2; ++h2) {
        const int64_t bhv = static_cast<int64_t>(i_b) * HV + hv0 + hv + h2;
        out[h2] = slot ? ptiles + tile_slot(bhv, pair_slots(NC), c * (c - 1) / 2 + slot - 1)
                       : diag + tile_slot(bhv, NC, c);
        if (hv + h2 < R) {
          const float* gh = Gs + (hv + h2) * NC * BT;
          kside_store(out[h2], ascr + h2 * TILE, kk, qk, bits_s + c * BT * wn, wn, gh + c * BT,
                      gh + c2 * BT, bs + (hv + h2) * NC * BT + c * BT, c2, slot == 0, lane);
        }
      }
      if (slot == 0) {
        __syncwarp();
        if (hv + lane / BT < R)
          solve_column(lane < BT ? out[0] : out[1], ascr + (lane / BT) * TILE, lane % BT);
        __syncwarp();   // ascr is free again
      }
    }
  }
}

template <bool ORD, bool L2NORM, int WARPS>
int kside_launch(void** a, int B, int NC, int H, int HV, int W, int V, int pdl, int pf,
                 float scale, cudaStream_t stream) {
  if (bit_words(NC) > W) return 1002;
  if (HV % H || NC > 64) return 1003;
  const int smem = KTree<WARPS>::bytes(NC, HV / H);
  auto kern = kside_kernel<ORD, L2NORM, WARPS>;
  static int limit[DEVICES] = {};
  const int err = opt_in(reinterpret_cast<const void*>(kern), smem, limit);
  if (err) return err;
  // launched after everything it reads (no programmatic dependence on the kernel before)
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3(B * H);
  cfg.blockDim = dim3(WARPS * 32);
  cfg.dynamicSmemBytes = smem;
  cfg.stream = stream;
  return static_cast<int>(cudaLaunchKernelEx(
      &cfg, kern, static_cast<const __nv_bfloat16*>(a[0]), static_cast<const __nv_bfloat16*>(a[1]),
      static_cast<const float*>(a[2]), static_cast<const float*>(a[3]),
      static_cast<const int64_t*>(a[4]), static_cast<const int64_t*>(a[5]),
      static_cast<const int32_t*>(a[6]), static_cast<const int32_t*>(a[7]),
      static_cast<const int32_t*>(a[8]), static_cast<float*>(a[9]), static_cast<float*>(a[10]),
      static_cast<__nv_bfloat16*>(a[11]), static_cast<__nv_bfloat16*>(a[12]),
      static_cast<const float*>(a[13]), scale, NC, W, H, HV, V, pdl, pf));
}

template <int BV, int MT, bool ORD, int MODE>
int launch(void** a, int B, int NC, int H, int HV, int V, int W, int pdl, int pf, int flags,
           cudaStream_t stream, int* blocks_per_sm) {
  constexpr int THREADS = BV / (16 * MT) * 32;
  constexpr bool KS = MODE == 1;
  using S = Stage<BV, KS, MODE == 2>;
  if (KS && S::words(NC) > W) return 1002;
  const int walk_smem = S::walk_bytes(NC);
  const int s0_smem = K * S::s0_row * 4;   // S0 staged before the walk, in the same space
  const int smem = (walk_smem > s0_smem ? walk_smem : s0_smem) +
                   16 * ((NC * (ORD ? BT + 1 : 1) * 4 + 15) / 16);
  auto kern = walk_kernel<BV, MT, ORD, MODE>;
  static int limit[DEVICES] = {};
  cudaError_t err = static_cast<cudaError_t>(opt_in(reinterpret_cast<const void*>(kern), smem, limit));
  if (err != cudaSuccess) return static_cast<int>(err);
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
                           static_cast<float*>(a[4]), static_cast<const int64_t*>(a[5]),
                           static_cast<const int32_t*>(a[6]), static_cast<const int32_t*>(a[7]), NC,
                           static_cast<__nv_bfloat16*>(a[8]), static_cast<__nv_bfloat16*>(a[9]),
                           static_cast<const float*>(a[10]), static_cast<const __nv_bfloat16*>(a[11]),
                           static_cast<const __nv_bfloat16*>(a[12]),
                           static_cast<const int32_t*>(a[13]), static_cast<const int64_t*>(a[14]),
                           static_cast<const float*>(a[15]), W, H, HV, V, pdl, pf, flags,
                           static_cast<const float*>(a[16]), static_cast<const float*>(a[17]),
                           static_cast<const __nv_bfloat16*>(a[18]), static_cast<const float*>(a[19]),
                           static_cast<int8_t*>(a[20]), static_cast<const int32_t*>(a[21]));
  return static_cast<int>(err);
}

template <bool ORD>
int dispatch(void** a, int B, int NC, int H, int HV, int V, int block_v, int mt, int ks, int W,
             int pdl, int pf, int flags, cudaStream_t s, int* bps) {
  if (ks == 1) {   // the K-side in the walk: one program per (sequence, value head) only
    if (block_v == 128 && mt == 2) return launch<128, 2, ORD, 1>(a, B, NC, H, HV, V, W, pdl, pf, flags, s, bps);
    if (block_v == 128 && mt == 1) return launch<128, 1, ORD, 1>(a, B, NC, H, HV, V, W, pdl, pf, flags, s, bps);
    return 1000;
  }
  if (ks == 2) {   // raw q / k with their multipliers (the CUDA K-side kernel's)
    if (block_v == 128 && mt == 2) return launch<128, 2, ORD, 2>(a, B, NC, H, HV, V, W, pdl, pf, flags, s, bps);
    if (block_v == 128 && mt == 1) return launch<128, 1, ORD, 2>(a, B, NC, H, HV, V, W, pdl, pf, flags, s, bps);
    if (block_v == 64 && mt == 2) return launch<64, 2, ORD, 2>(a, B, NC, H, HV, V, W, pdl, pf, flags, s, bps);
    return 1000;
  }
  if (ks) return 1000;
  if (block_v == 128 && mt == 2) return launch<128, 2, ORD, 0>(a, B, NC, H, HV, V, W, pdl, pf, flags, s, bps);
  if (block_v == 128 && mt == 1) return launch<128, 1, ORD, 0>(a, B, NC, H, HV, V, W, pdl, pf, flags, s, bps);
  if (block_v == 64 && mt == 2) return launch<64, 2, ORD, 0>(a, B, NC, H, HV, V, W, pdl, pf, flags, s, bps);
  if (block_v == 64 && mt == 1) return launch<64, 1, ORD, 0>(a, B, NC, H, HV, V, W, pdl, pf, flags, s, bps);
  if (block_v == 32 && mt == 2) return launch<32, 2, ORD, 0>(a, B, NC, H, HV, V, W, pdl, pf, flags, s, bps);
  return 1000;
}

}  // namespace

// a: qn, kn, v, beta, s0, cu, pairs, npairs, o, u, G, diag, pair tiles, order, bits, mults,
// then the pending path of a deferred commit (pk, pw, pu, pdec, pon, plen: read where flags & 8,
// with P = flags >> 8 rows per sequence; fold_pending) (device pointers; order: int32 flat rows of the nodes in walk order, used when ordered != 0;
// ks 1: the walk computes the K-side tiles itself from bits, int64 [N, W] ancestor bits in
// walk order, and diag / pair tiles are not read; ks 2: qn / kn are the raw rows, mults
// [N, H, 2] fp32 their multipliers).  pf > 0: each program prefetches into L2 the S0 of the
// program pf rows of (sequence, value head) on; flags: 1 o and u stored streaming
// (evict-first), 2 each sub-chunk's v rows prefetched into L2 two sub-chunks ahead, 4 the
// pf prefetch issued two sub-chunks before the program's end rather than at its start, 8 the
// pending path folded into S0 first (written back to s0).
// blocks_per_sm non-null: only report the resident programs per SM (nothing launched).
// Returns a cudaError_t (0: launched); 1000: no such (block_v, m-tiles per warp); 1001: the
// sub-chunks need more shared memory than a program may hold; 1002: fewer bit words than
// sub-chunks need.
extern "C" int gdn_walk_launch(void** a, int B, int NC, int H, int HV, int V, int block_v, int mt,
                               int ks, int W, int pdl, int ordered, int pf, int flags, void* stream,
                               int* blocks_per_sm) {
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  return ordered
             ? dispatch<true>(a, B, NC, H, HV, V, block_v, mt, ks, W, pdl, pf, flags, s, blocks_per_sm)
             : dispatch<false>(a, B, NC, H, HV, V, block_v, mt, ks, W, pdl, pf, flags, s, blocks_per_sm);
}

// a: q, k (raw bf16 [N, H, K]), g, beta (fp32 [N, HV]), bits, cu, pairs, npairs, order, and
// written: G (fp32 [N, HV]), mults (fp32 [N, H, 2]), diag, pair tiles (device pointers, as
// gdn_walk_launch's; order used when ordered != 0), then s0 (fp32 [B * HV, K, V], only
// prefetched: pf > 0 brings the first pf rows of (sequence, value head) into L2 for the walk):
// what the walk with ks = 2 reads, for HV / H value heads per key head; pdl: let the walk
// start early; warps: 8 or 12 a program.  Returns a cudaError_t (0:
// launched), 1001 / 1002 as the walk, 1003: value heads not a multiple of the key heads, or
// more than 64 sub-chunks, 1004: warps neither 8 nor 12.
template <int WARPS>
int kside_dispatch(void** a, int B, int NC, int H, int HV, int W, int V, int pdl, int ordered,
                   int l2norm, int pf, float scale, cudaStream_t s) {
  if (ordered)
    return l2norm ? kside_launch<true, true, WARPS>(a, B, NC, H, HV, W, V, pdl, pf, scale, s)
                  : kside_launch<true, false, WARPS>(a, B, NC, H, HV, W, V, pdl, pf, scale, s);
  return l2norm ? kside_launch<false, true, WARPS>(a, B, NC, H, HV, W, V, pdl, pf, scale, s)
                : kside_launch<false, false, WARPS>(a, B, NC, H, HV, W, V, pdl, pf, scale, s);
}

extern "C" int gdn_kside_launch(void** a, int B, int NC, int H, int HV, int W, int V, int pdl,
                                int ordered, int l2norm, int pf, int warps, float scale,
                                void* stream) {
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  if (warps == 8) return kside_dispatch<8>(a, B, NC, H, HV, W, V, pdl, ordered, l2norm, pf, scale, s);
  if (warps == 12) return kside_dispatch<12>(a, B, NC, H, HV, W, V, pdl, ordered, l2norm, pf, scale, s);
  return 1004;
}

extern "C" const char* gdn_walk_error(int code) {
  if (code == 1000) return "no CUDA walk for this block_v / m-tiles per warp";
  if (code == 1001) return "the trees' sub-chunks need more shared memory than a program may hold";
  if (code == 1002) return "the ancestor bits have fewer words per row than the sub-chunks need";
  if (code == 1003) return "the K-side kernel needs value heads a multiple of the key heads and at most 64 sub-chunks";
  if (code == 1004) return "the K-side kernel has 8 or 12 warps a program";
  return cudaGetErrorString(static_cast<cudaError_t>(code));
}
