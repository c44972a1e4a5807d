// A mixture of experts on the device, with nothing read back: routing, a grouping of the
// step's slots (row, chosen expert) by expert, each expert's gated MLP over tiles of its
// slots, and each row's weighted sum of its slots.
//
// Every slot's output is its own f32 dot products in a fixed order along k, whichever tile
// it lands in, so the grouping (placed with atomics: the order of slots inside an expert's
// group may vary from run to run) changes no result bit, and a row's output does not depend
// on the other rows of its step. Each expert's weights are read once per tile of its slots
// (MOE_TILE for the f32 tile kernels, MOE_SMALL_BM or MOE_LARGE_BM for the tensor-core
// ones): once per step at decode batch sizes where an expert gets few slots.

// The MOE_* constants come from the backend (cuda/moe.rs).

template <typename T> __device__ __forceinline__ void load8(const T* p, float* f) {
    unpack8<T>(*reinterpret_cast<const uint4*>(p), f);
}
template <> __device__ __forceinline__ void load8<float>(const float* p, float* f) {
    const float4 a = *reinterpret_cast<const float4*>(p);
    const float4 b = *reinterpret_cast<const float4*>(p + 4);
    f[0] = a.x; f[1] = a.y; f[2] = a.z; f[3] = a.w;
    f[4] = b.x; f[5] = b.y; f[6] = b.z; f[7] = b.w;
}

// 8 weights, streamed past L1 as the GEMV streams them (the tile's inputs stay cached).
template <typename T> __device__ __forceinline__ void load8_weights(const T* p, float* f) {
    unpack8<T>(load_streamed(p), f);
}
template <> __device__ __forceinline__ void load8_weights<float>(const float* p, float* f) {
    load8<float>(p, f);
}

// Order key of a probability for the warp's integer max (`redux.sync`): a non-negative
// float's bits order as the float does; a chosen expert (-1) is below every probability.
__device__ __forceinline__ unsigned prob_key(float p) {
    return p < 0.0f ? 0u : __float_as_uint(p) + 1u;
}

// The lane's largest probability among its experts (lane, lane + 32, ...), the lower index
// first among equals; (-1, INT_MAX) where it has none left.
__device__ __forceinline__ void lane_best(const float* p, int experts, float& v, int& i) {
    v = -1.0f;
    i = 0x7fffffff;
    for (int e = threadIdx.x & 31; e < experts; e += 32)
        if (p[e] > v) {
            v = p[e];
            i = e;
        }
}

// One row's routing, a warp's work: softmax over the experts, the k largest probabilities
// in descending order (compared as the CPU compares them, so logits that round to one
// probability tie; the lower index first), rescaled to sum to 1 where `renormalize`, into
// ids[0, k) and probs[0, k). p: `experts` floats of scratch. A warp a row needs no
// block-wide barrier between the k choices. Each choice is two warp-wide integer
// reductions over the lanes' best candidates (the largest key, then the lowest index
// holding it), and only the lane that held the chosen expert looks for its next best: the
// k choices are the routing's serial latency, which the gate/up kernel pays before its
// first weight load.
__device__ __forceinline__ void route_row(const float* l, int experts, int k, int renormalize,
                                          float* p, int* ids, float* probs) {
    const int lane = threadIdx.x & 31;
    float m = NEG_INF;
    for (int e = lane; e < experts; e += 32) m = fmaxf(m, l[e]);
    m = warp_max(m);
    float s = 0.0f;
    for (int e = lane; e < experts; e += 32) {
        p[e] = expf(l[e] - m);
        s += p[e];
    }
    const float sum = warp_sum(s);
    float v;
    int i;
    lane_best(p, experts, v, i);
    float chosen = 0.0f;
    for (int j = 0; j < k; j++) {
        const unsigned best = __reduce_max_sync(0xffffffffu, prob_key(v));
        const int e = (int)__reduce_min_sync(0xffffffffu, prob_key(v) == best ? (unsigned)i
                                                                               : 0x7fffffffu);
        const float prob = __uint_as_float(best - 1u) / sum;
        chosen += prob;
        if (lane == 0) {
            ids[j] = e;
            probs[j] = prob;
        }
        if ((e & 31) == lane) {
            p[e] = -1.0f;
            lane_best(p, experts, v, i);
        }
    }
    __syncwarp();
    if (renormalize)
        for (int j = lane; j < k; j += 32) probs[j] /= chosen;
    __syncwarp();
}

// Grid: ceil(rows / MOE_ROUTE_WARPS) blocks of MOE_ROUTE_WARPS warps, one warp a row;
// MOE_ROUTE_WARPS * experts floats of dynamic shared memory.
extern "C" __global__ void moe_route(const float* logits, int rows, int experts, int k,
                                     int renormalize, int* ids, float* probs) {
    await_previous_kernel();
    extern __shared__ float route_shared[];
    const int warp = threadIdx.x >> 5;
    const long long r = (long long)blockIdx.x * MOE_ROUTE_WARPS + warp;
    if (r >= rows) return;
    route_row(logits + r * experts, experts, k, renormalize, route_shared + warp * experts,
              ids + r * k, probs + r * k);
}

// One block; 2 * experts ints of dynamic shared memory. Counts each expert's slots, lays
// the groups out in expert order (offsets, and tile_offsets: where each expert's tiles of
// `tile` slots start in the grid), and places every slot in its group (order: the slot at
// each grouped position).
extern "C" __global__ void moe_group(const int* ids, int slots, int experts, int tile,
                                     int* offsets, int* tile_offsets, int* order) {
    await_previous_kernel();
    extern __shared__ int counts[];
    int* cursor = counts + experts;
    for (int e = threadIdx.x; e < experts; e += blockDim.x) counts[e] = 0;
    __syncthreads();
    for (int s = threadIdx.x; s < slots; s += blockDim.x) atomicAdd(&counts[ids[s]], 1);
    __syncthreads();
    if (threadIdx.x == 0) {
        int at = 0, tiles = 0;
        for (int e = 0; e < experts; e++) {
            offsets[e] = at;
            tile_offsets[e] = tiles;
            cursor[e] = at;
            at += counts[e];
            tiles += (counts[e] + tile - 1) / tile;
        }
        offsets[experts] = at;
        tile_offsets[experts] = tiles;
    }
    __syncthreads();
    for (int s = threadIdx.x; s < slots; s += blockDim.x) {
        order[atomicAdd(&cursor[ids[s]], 1)] = s;
    }
}

// The expert and the grouped slots [first, first + n) of tile blockIdx.y (tiles of `tile`
// slots, as moe_group laid them out); false past the step's last tile.
__device__ __forceinline__ bool moe_tile(const int* offsets, const int* tile_offsets, int experts,
                                         int tile, int& e, int& first, int& n) {
    const int t = blockIdx.y;
    if (t >= tile_offsets[experts]) return false;
    // The last expert whose tiles start at or before t (empty experts start where the next
    // one does).
    int lo = 0, hi = experts - 1;
    while (lo < hi) {
        const int mid = (lo + hi + 1) >> 1;
        if (tile_offsets[mid] <= t) lo = mid; else hi = mid - 1;
    }
    e = lo;
    first = offsets[e] + (t - tile_offsets[e]) * tile;
    n = min(tile, offsets[e + 1] - first);
    return true;
}

// acc[r][c] = Σ x_r[kk] · w_c[kk] over [0, len) for the tile's n live rows (of R) against
// C weight rows, summed over the warp and returned to every lane. A lane reads 16
// bytes of each weight row per step along k (8 elements; element by element where rows are
// not whole 16-byte vectors), so the warp's loads are coalesced and several are in flight.
template <typename X, typename W, int R, int C>
__device__ __forceinline__ void warp_tile_dots(const X* const* x, int n, const W* const* w, int len,
                                               float (&acc)[R][C]) {
    const int lane = threadIdx.x & 31;
#pragma unroll
    for (int r = 0; r < R; r++)
#pragma unroll
        for (int c = 0; c < C; c++) acc[r][c] = 0.0f;
    const int vec_len = len % 8 == 0 ? len : 0;
    // Four steps along k unrolled, so that their weight loads are in flight together.
#pragma unroll 4
    for (int kk = lane * 8; kk < vec_len; kk += 32 * 8) {
        float wf[C][8];
#pragma unroll
        for (int c = 0; c < C; c++) load8_weights<W>(w[c] + kk, wf[c]);
#pragma unroll
        for (int r = 0; r < R; r++) {
            if (r < n) {
                float xf[8];
                load8<X>(x[r] + kk, xf);
#pragma unroll
                for (int c = 0; c < C; c++)
#pragma unroll
                    for (int i = 0; i < 8; i++) acc[r][c] += wf[c][i] * xf[i];
            }
        }
    }
    for (int kk = vec_len + lane; kk < len; kk += 32) {
#pragma unroll
        for (int r = 0; r < R; r++) {
            if (r < n) {
#pragma unroll
                for (int c = 0; c < C; c++) acc[r][c] += to_f32(w[c][kk]) * to_f32(x[r][kk]);
            }
        }
    }
#pragma unroll
    for (int r = 0; r < R; r++)
        if (r < n)
#pragma unroll
            for (int c = 0; c < C; c++) acc[r][c] = warp_sum(acc[r][c]);
}

// Steps along k whose weight loads a lane of the slot-by-slot kernels issues before the
// first of their products.
#define MOE_ROW_STEPS 2

// acc[c] = Σ x[kk] · w_c[kk] over [0, len) for one input row against C weight rows,
// summed over the warp and returned to every lane: warp_tile_dots for one row, in the same
// order of additions. The weight loads of MOE_ROW_STEPS steps (C * MOE_ROW_STEPS loads of
// 16 bytes a lane) are issued together before their products; the loop of warp_tile_dots,
// left to the compiler, had one or two in flight at a time (ncu, H200), where a decode
// step's few blocks need many to cover the memory's latency.
template <typename T, int C>
__device__ __forceinline__ void warp_row_dots(const T* x, const T* const* w, int len,
                                              float (&acc)[C]) {
    constexpr int S = MOE_ROW_STEPS;
    const int lane = threadIdx.x & 31;
#pragma unroll
    for (int c = 0; c < C; c++) acc[c] = 0.0f;
    const int vec_len = len % 8 == 0 ? len : 0;
    for (int k0 = lane * 8; k0 < vec_len; k0 += 32 * 8 * S) {
        uint4 wv[S][C];
#pragma unroll
        for (int s = 0; s < S; s++) {
            const int kk = k0 + s * 32 * 8;
#pragma unroll
            for (int c = 0; c < C; c++)
                wv[s][c] = kk < vec_len ? load_streamed(w[c] + kk) : make_uint4(0, 0, 0, 0);
        }
#pragma unroll
        for (int s = 0; s < S; s++) {
            const int kk = k0 + s * 32 * 8;
            if (kk < vec_len) {
                float xf[8];
                unpack8<T>(load_input(x + kk), xf);
#pragma unroll
                for (int c = 0; c < C; c++) {
                    float wf[8];
                    unpack8<T>(wv[s][c], wf);
#pragma unroll
                    for (int i = 0; i < 8; i++) acc[c] += wf[i] * xf[i];
                }
            }
        }
    }
    for (int kk = vec_len + lane; kk < len; kk += 32) {
#pragma unroll
        for (int c = 0; c < C; c++) acc[c] += to_f32(w[c][kk]) * to_f32(x[kk]);
    }
#pragma unroll
    for (int c = 0; c < C; c++) acc[c] = warp_sum(acc[c]);
}

// Expert e's gate rows of columns j0..j0 + C into wr[0, C) and its up rows of the same
// columns into wr[C, 2C), in a stack of [gate | up] per expert; columns past ffn read the
// last column again (and are not stored).
template <typename T, int C>
__device__ __forceinline__ void gate_up_rows(const T* w, long long e, int j0, int dim, int ffn,
                                             const T* (&wr)[2 * C]) {
#pragma unroll
    for (int c = 0; c < C; c++) {
        const long long j = min(j0 + c, ffn - 1);
        wr[c] = w + (e * 2 * ffn + j) * dim;
        wr[C + c] = w + (e * 2 * ffn + ffn + j) * dim;
    }
}

// Grid: (ceil(ffn / (MOE_WARPS * MOE_GATE_COLS)), tiles); each warp owns MOE_GATE_COLS
// columns. act[g, j] = silu(gate_e[j] · x) * (up_e[j] · x) for the grouped slots g of the
// tile, x their rows (slot / k), in f32.
template <typename T>
__device__ void moe_gate_up(const T* x, const T* w, const int* order, const int* offsets,
                            const int* tile_offsets, int experts, int k, int dim, int ffn,
                            float* act) {
    constexpr int C = MOE_GATE_COLS;
    int e, first, n;
    if (!moe_tile(offsets, tile_offsets, experts, MOE_TILE, e, first, n)) return;
    const int j0 = (blockIdx.x * MOE_WARPS + (threadIdx.x >> 5)) * C;
    if (j0 >= ffn) return;
    const T* xr[MOE_TILE];
#pragma unroll
    for (int r = 0; r < MOE_TILE; r++) xr[r] = x + (long long)(order[first + min(r, n - 1)] / k) * dim;
    const T* wr[2 * C];
    gate_up_rows<T, C>(w, e, j0, dim, ffn, wr);
    float acc[MOE_TILE][2 * C];
    warp_tile_dots<T, T, MOE_TILE, 2 * C>(xr, n, wr, dim, acc);
    const int lane = threadIdx.x & 31;
#pragma unroll
    for (int r = 0; r < MOE_TILE; r++)
#pragma unroll
        for (int c = 0; c < C; c++)
            if (lane == r * C + c && r < n && j0 + c < ffn) {
                const float g = acc[r][c], u = acc[r][C + c];
                act[(long long)(first + r) * ffn + j0 + c] = g / (1.0f + expf(-g)) * u;
            }
}

// Grid: (ceil(dim / (MOE_WARPS * MOE_DOWN_COLS)), tiles); each warp owns MOE_DOWN_COLS
// columns. y[s, j] = down_e[j] · act[g] for the grouped slots g of the tile, written at
// their slots s = order[g].
template <typename T>
__device__ void moe_down(const float* act, const T* w, const int* order, const int* offsets,
                         const int* tile_offsets, int experts, int dim, int ffn, float* y) {
    constexpr int C = MOE_DOWN_COLS;
    int e, first, n;
    if (!moe_tile(offsets, tile_offsets, experts, MOE_TILE, e, first, n)) return;
    const int j0 = (blockIdx.x * MOE_WARPS + (threadIdx.x >> 5)) * C;
    if (j0 >= dim) return;
    const float* ar[MOE_TILE];
#pragma unroll
    for (int r = 0; r < MOE_TILE; r++) ar[r] = act + (long long)(first + min(r, n - 1)) * ffn;
    const T* wr[C];
#pragma unroll
    for (int c = 0; c < C; c++) wr[c] = w + ((long long)e * dim + min(j0 + c, dim - 1)) * ffn;
    float acc[MOE_TILE][C];
    warp_tile_dots<float, T, MOE_TILE, C>(ar, n, wr, ffn, acc);
    const int lane = threadIdx.x & 31;
#pragma unroll
    for (int r = 0; r < MOE_TILE; r++)
#pragma unroll
        for (int c = 0; c < C; c++)
            if (lane == r * C + c && r < n && j0 + c < dim)
                y[(long long)order[first + r] * dim + j0 + c] = acc[r][c];
}

// A row's weighted sum of its slots into `out`, or added to it where `add`: the sum rounded
// to T first, as a product written out and then added would be.
template <typename T> __device__ __forceinline__ void store_sum(T* out, float sum, int add) {
    *out = from_f32<T>(add ? to_f32(*out) + round_to<T>(sum) : sum);
}

// Grid: (rows, ceil(dim / blockDim.x)), a thread a column. out[r, j] = Σ_i probs[r * k + i] ·
// y[r * k + i, j] in slot order (fused multiply-adds), or added to out where `add`. With a
// block a row, a decode step's few rows waited on a few threads' chains of loads (H200,
// Qwen3-30B-A3B shapes, one row: 9.7 µs a layer).
template <typename T>
__device__ void moe_combine(const float* y, const float* probs, int k, int dim, T* out, int add) {
    const long long r = blockIdx.x;
    const int j = blockIdx.y * blockDim.x + threadIdx.x;
    if (j >= dim) return;
    float acc = 0.0f;
#pragma unroll 8
    for (int i = 0; i < k; i++) acc = fmaf(probs[r * k + i], y[(r * k + i) * dim + j], acc);
    store_sum<T>(out + r * dim + j, acc, add);
}

// Grouped products on tensor cores (16-bit weights): each block multiplies one tile of an
// expert's grouped slots, BM of them, by BN of the expert's weight rows over the whole of
// k, with m16n8k16 mma.sync and f32 sums. Both operands stream through shared memory in
// slabs of MOE_MMA_BK along k (cp.async, a ring of STAGES slabs), rows padded by 16 bytes
// so that the 8 rows × 4 lanes of a fragment load meet 32 different banks. WM × WN warps:
// WM along the slots and WN along the weight rows. The k order of every sum is fixed (slabs
// in order, 16 at a time), so a slot's output is the same bits whatever tile shape or
// other slots share its block.
//
// GATE: the gate/up product with the SiLU·mul in its epilogue. The block's weight rows are
// BN / 2 gate rows and the up rows of the same columns, and each warp's fragments hold both
// halves of its columns, so act = silu(gate) * up is formed in registers, each product
// rounded to T as the dense MLP's product and silu_mul round them; act is written in
// grouped order. Otherwise the down product, whose f32 outputs go to their slots.
//
// The tile is expert e's grouped slots [first, first + n); `order` gives the slot at each
// grouped position.
template <typename T, int BM, int BN, int WM, int WN, int STAGES, bool GATE>
__device__ void moe_mma_tile(const T* a, const T* w, const int* order, int e, int first, int n,
                             int k_route, int len, int n_out, void* out) {
    constexpr int BK = MOE_MMA_BK, LD = BK + 8, THREADS = 32 * WM * WN, PIECES = BK / 8;
    constexpr int MI = BM / 16 / WM, NI = BN / 8 / WN;
    static_assert(MI * 16 * WM == BM && NI * 8 * WN == BN && (!GATE || NI % 2 == 0), "tile shape");
    extern __shared__ __align__(16) unsigned char mma_shared[];
    T* as = reinterpret_cast<T*>(mma_shared);  // [STAGES][BM][LD]
    T* ws = as + STAGES * BM * LD;              // [STAGES][BN][LD]
    __shared__ const T* arow[BM];
    __shared__ const T* wrow[BN];
    constexpr int COLS = GATE ? BN / 2 : BN;
    const int j0 = blockIdx.x * COLS;
    if (j0 >= n_out) return;
    // Rows past the tile's slots point at its last slot (they are zero-filled, not read);
    // columns past n_out read the last valid one again and are not stored.
    for (int r = threadIdx.x; r < BM; r += THREADS) {
        const int g = first + min(r, n - 1);
        const int slot = order[g];
        arow[r] = a + (long long)(GATE ? slot / k_route : g) * len;
    }
    const long long rows_per_expert = GATE ? 2LL * n_out : n_out;
    for (int c = threadIdx.x; c < BN; c += THREADS) {
        const int j = min(j0 + (GATE && c >= COLS ? c - COLS : c), n_out - 1);
        wrow[c] = w + (e * rows_per_expert + (GATE && c >= COLS ? n_out + j : j)) * len;
    }
    __syncthreads();
    auto load = [&](int stage, int kk) {
        for (int i = threadIdx.x; i < BM * PIECES; i += THREADS)
            cp_async16(as + (stage * BM + i / PIECES) * LD + i % PIECES * 8,
                       arow[i / PIECES] + kk + i % PIECES * 8, i / PIECES < n);
        for (int i = threadIdx.x; i < BN * PIECES; i += THREADS)
            cp_async16(ws + (stage * BN + i / PIECES) * LD + i % PIECES * 8,
                       wrow[i / PIECES] + kk + i % PIECES * 8, true);
    };
    const int steps = len / BK;
#pragma unroll
    for (int s = 0; s < STAGES - 1; s++) {
        if (s < steps) load(s, s * BK);
        cp_async_commit();
    }
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const int wm = warp / WN, wn = warp % WN;
    // The shared weight row of n-tile ni's lane g: with GATE, the first NI / 2 tiles are gate
    // rows and the rest the up rows of the same columns.
    auto wtile_row = [&](int ni) {
        if (GATE) {
            constexpr int H = NI / 2;
            return (ni < H ? 0 : COLS) + wn * H * 8 + (ni % H) * 8 + g;
        }
        return wn * NI * 8 + ni * 8 + g;
    };
    float acc[MI][NI][4];
#pragma unroll
    for (int i = 0; i < MI; i++)
#pragma unroll
        for (int j = 0; j < NI; j++)
#pragma unroll
            for (int q = 0; q < 4; q++) acc[i][j][q] = 0.0f;
    for (int s = 0; s < steps; s++) {
        cp_async_wait<STAGES - 2>();
        __syncthreads();
        if (s + STAGES - 1 < steps) load((s + STAGES - 1) % STAGES, (s + STAGES - 1) * BK);
        cp_async_commit();
        const T* at = as + (s % STAGES) * BM * LD;
        const T* wt = ws + (s % STAGES) * BN * LD;
#pragma unroll
        for (int kk = 0; kk < BK; kk += 16) {
            u32 af[MI][4];
#pragma unroll
            for (int i = 0; i < MI; i++) {
                const T* p = at + ((wm * MI + i) * 16 + g) * LD + kk + 2 * t;
                af[i][0] = *reinterpret_cast<const u32*>(p);
                af[i][1] = *reinterpret_cast<const u32*>(p + 8 * LD);
                af[i][2] = *reinterpret_cast<const u32*>(p + 8);
                af[i][3] = *reinterpret_cast<const u32*>(p + 8 * LD + 8);
            }
#pragma unroll
            for (int j = 0; j < NI; j++) {
                const T* q = wt + wtile_row(j) * LD + kk + 2 * t;
                const u32 b0 = *reinterpret_cast<const u32*>(q);
                const u32 b1 = *reinterpret_cast<const u32*>(q + 8);
#pragma unroll
                for (int i = 0; i < MI; i++) mma16816<T>(acc[i][j], af[i], b0, b1);
            }
        }
    }
    cp_async_wait<0>();
    // acc[i][j]: slots (wm * MI + i) * 16 + g (+ 8 in elements 2 and 3), columns 2t, 2t + 1.
#pragma unroll
    for (int i = 0; i < MI; i++)
#pragma unroll
        for (int h = 0; h < 2; h++) {
            const int r = (wm * MI + i) * 16 + g + 8 * h;
            if (r >= n) continue;
            if (GATE) {
                T* act = reinterpret_cast<T*>(out) + (long long)(first + r) * n_out;
#pragma unroll
                for (int j = 0; j < NI / 2; j++)
#pragma unroll
                    for (int c = 0; c < 2; c++) {
                        const int col = j0 + wn * NI / 2 * 8 + j * 8 + 2 * t + c;
                        if (col >= n_out) continue;
                        const float gate = round_to<T>(acc[i][j][2 * h + c]);
                        const float up = round_to<T>(acc[i][j + NI / 2][2 * h + c]);
                        act[col] = from_f32<T>(gate / (1.0f + expf(-gate)) * up);
                    }
            } else {
                const int slot = order[first + r];
                float* y = reinterpret_cast<float*>(out) + (long long)slot * n_out;
#pragma unroll
                for (int j = 0; j < NI; j++)
#pragma unroll
                    for (int c = 0; c < 2; c++) {
                        const int col = j0 + wn * NI * 8 + j * 8 + 2 * t + c;
                        if (col < n_out) y[col] = acc[i][j][2 * h + c];
                    }
            }
        }
}

// One tile of grouped slots: tile blockIdx.y as moe_group laid them out.
template <typename T, int BM, int BN, int WM, int WN, int STAGES, bool GATE>
__device__ void moe_mma(const T* a, const T* w, const int* order, const int* offsets,
                        const int* tile_offsets, int experts, int k_route, int len, int n_out,
                        void* out) {
    int e, first, n;
    if (!moe_tile(offsets, tile_offsets, experts, BM, e, first, n)) return;
    moe_mma_tile<T, BM, BN, WM, WN, STAGES, GATE>(a, w, order, e, first, n, k_route, len, n_out,
                                                  out);
}

// Steps too small to group (cuda/moe.rs's ROW_PATH_ROWS) run slot by slot as
// matrix-vector products, with no grouping (an expert then gets about one slot anyway): a
// warp owns a few weight rows of the slot's expert and its lanes stream them along k, as
// the tile kernels do for one row. A tensor-core tile would stream a slab of 16 slots for
// its one live slot, with fewer weight bytes in flight (H200, Qwen3-30B-A3B shapes, B=1:
// 303.2 tok/s against 254.0). These sums run in another k order than the tiles', so a
// row's outputs in such a small step may differ from the same row's in a larger step by
// the rounding of the f32 sums (the dense products' GEMV and tensor-core paths differ
// alike). The gate/up product routes the row inside (a warp's work in each block, cheaper
// than a launch of its own); the down product and moe_combine follow. Fusing the weighted
// sum into the down kernel (a block a row's slots over a few columns, summed through shared
// memory) lost to the two kernels: H200, 24 layers of Qwen3-30B-A3B shapes, B=1, 598.6
// tok/s against 616.8.

// act[slot, j] = silu(gate_e[j] · x) * (up_e[j] · x) for the slot's row x = x[slot / k] and
// its expert e, routed from the row's f32 logits by the block itself into its dynamic shared
// memory (experts floats of scratch, then k ids and k weights; slot % k picks among the row's
// experts); the first block of each slot also writes the slot's ids and probs. Each
// product is rounded to T before SiLU·mul, as the dense MLP's product is. NORM: x is the
// residual stream, taken through an RMSNorm whose weights are folded into w: the second warp
// gathers the row's sum of squares while the first routes, and the products are scaled by
// 1 / rms(x), as gemv_norm scales them.
template <typename T, bool NORM>
__device__ void moe_row_gate_up(const T* x, const float* logits, const T* w, int experts, int k,
                                int renormalize, int dim, int ffn, float eps, int* ids,
                                float* probs, T* act) {
    constexpr int C = MOE_GATE_COLS;
    extern __shared__ float row_route[];
    int* row_ids = reinterpret_cast<int*>(row_route + experts);
    float* row_probs = reinterpret_cast<float*>(row_ids + k);
    const int slot = blockIdx.y, lane = threadIdx.x & 31;
    const T* xr = x + (long long)(slot / k) * dim;
    if (threadIdx.x < 32)
        route_row(logits + (long long)(slot / k) * experts, experts, k, renormalize, row_route,
                  row_ids, row_probs);
    __shared__ float inv_rms;
    if (NORM && threadIdx.x >> 5 == 1) {
        float ss = 0.0f;
        for (int kk = lane * 8; kk < dim; kk += 32 * 8) {
            float xf[8];
            unpack8<T>(load_input(xr + kk), xf);
#pragma unroll
            for (int i = 0; i < 8; i++) ss += xf[i] * xf[i];
        }
        ss = warp_sum(ss);
        if (lane == 0) inv_rms = rsqrtf(ss / dim + eps);
    }
    __syncthreads();
    const float scale = NORM ? inv_rms : 1.0f;
    const int e = row_ids[slot % k];
    if (blockIdx.x == 0 && threadIdx.x == 0) {
        ids[slot] = e;
        probs[slot] = row_probs[slot % k];
    }
    const int j0 = (blockIdx.x * MOE_WARPS + (threadIdx.x >> 5)) * C;
    if (j0 >= ffn) return;
    const T* wr[2 * C];
    gate_up_rows<T, C>(w, e, j0, dim, ffn, wr);
    float acc[2 * C];
    warp_row_dots<T, 2 * C>(xr, wr, dim, acc);
#pragma unroll
    for (int c = 0; c < C; c++)
        if (lane == c && j0 + c < ffn) {
            const float gate = round_to<T>(acc[c] * scale);
            const float up = round_to<T>(acc[C + c] * scale);
            act[(long long)slot * ffn + j0 + c] = from_f32<T>(gate / (1.0f + expf(-gate)) * up);
        }
}

// y[slot, j] = down_e[j] · act[slot] for the slot's expert e = ids[slot], in f32.
template <typename T>
__device__ void moe_row_down(const T* act, const T* w, const int* ids, int dim, int ffn,
                             float* y) {
    constexpr int C = MOE_DOWN_COLS;
    const int slot = blockIdx.y;
    const int j0 = (blockIdx.x * MOE_WARPS + (threadIdx.x >> 5)) * C;
    if (j0 >= dim) return;
    const long long e = ids[slot];
    const T* ar = act + (long long)slot * ffn;
    const T* wr[C];
#pragma unroll
    for (int c = 0; c < C; c++) wr[c] = w + (e * dim + min(j0 + c, dim - 1)) * ffn;
    float acc[C];
    warp_row_dots<T, C>(ar, wr, ffn, acc);
    const int lane = threadIdx.x & 31;
#pragma unroll
    for (int c = 0; c < C; c++)
        if (lane == c && j0 + c < dim) y[(long long)slot * dim + j0 + c] = acc[c];
}

// Grid: (ceil(ffn / (BN / 2)), tiles of BM slots); 32 * WM * WN threads, the shared
// memory cuda/moe.rs computes. x rows are the slots' rows (slot / k); act [slots, ffn] in T.
// Grid: (ceil(dim / BN), tiles); act [slots, ffn] in grouped order, y [slots, dim] f32.
#define MOE_MMA(T, S, SIZE, BM, BN, WM, WN, STAGES)                                                \
    extern "C" __global__ void __launch_bounds__(32 * WM * WN) moe_mma_gate_up_##SIZE##_##S(       \
        const T* x, const T* w, const int* order, const int* offsets, const int* tile_offsets,    \
        int experts, int k, int dim, int ffn, T* act) {                                            \
        await_previous_kernel();                                                                   \
        moe_mma<T, BM, BN, WM, WN, STAGES, true>(x, w, order, offsets, tile_offsets, experts, k,   \
                                                 dim, ffn, act);                                   \
    }                                                                                              \
    extern "C" __global__ void __launch_bounds__(32 * WM * WN) moe_mma_down_##SIZE##_##S(          \
        const T* act, const T* w, const int* order, const int* offsets, const int* tile_offsets,  \
        int experts, int dim, int ffn, float* y) {                                                 \
        await_previous_kernel();                                                                   \
        moe_mma<T, BM, BN, WM, WN, STAGES, false>(act, w, order, offsets, tile_offsets, experts,   \
                                                  0, ffn, dim, y);                                 \
    }

MOE_MMA(bf16, bf16, small, MOE_SMALL_BM, MOE_SMALL_BN, MOE_SMALL_WM, MOE_SMALL_WN,
        MOE_SMALL_STAGES)
MOE_MMA(f16, f16, small, MOE_SMALL_BM, MOE_SMALL_BN, MOE_SMALL_WM, MOE_SMALL_WN,
        MOE_SMALL_STAGES)
MOE_MMA(bf16, bf16, large, MOE_LARGE_BM, MOE_LARGE_BN, MOE_LARGE_WM, MOE_LARGE_WN,
        MOE_LARGE_STAGES)
MOE_MMA(f16, f16, large, MOE_LARGE_BM, MOE_LARGE_BN, MOE_LARGE_WM, MOE_LARGE_WN,
        MOE_LARGE_STAGES)

// Grid: (ceil(ffn / (MOE_WARPS * MOE_GATE_COLS)), slots) and
// (ceil(dim / (MOE_WARPS * MOE_DOWN_COLS)), slots), MOE_WARPS warps; act [slots, ffn]
// and y [slots, dim] in slot order.
#define MOE_ROW(T, S)                                                                              \
    extern "C" __global__ void __launch_bounds__(MOE_WARPS * 32) moe_row_gate_up_##S(              \
        const T* x, const float* logits, const T* w, int experts, int k, int renormalize, int dim, \
        int ffn, float eps, int* ids, float* probs, T* act) {                                      \
        await_previous_kernel();                                                                   \
        moe_row_gate_up<T, false>(x, logits, w, experts, k, renormalize, dim, ffn, eps, ids,       \
                                  probs, act);                                                     \
    }                                                                                              \
    extern "C" __global__ void __launch_bounds__(MOE_WARPS * 32) moe_row_gate_up_norm_##S(         \
        const T* x, const float* logits, const T* w, int experts, int k, int renormalize, int dim, \
        int ffn, float eps, int* ids, float* probs, T* act) {                                      \
        await_previous_kernel();                                                                   \
        moe_row_gate_up<T, true>(x, logits, w, experts, k, renormalize, dim, ffn, eps, ids, probs, \
                                 act);                                                             \
    }                                                                                              \
    extern "C" __global__ void __launch_bounds__(MOE_WARPS * 32) moe_row_down_##S(                 \
        const T* act, const T* w, const int* ids, int dim, int ffn, float* y) {                    \
        await_previous_kernel();                                                                   \
        moe_row_down<T>(act, w, ids, dim, ffn, y);                                                 \
    }

MOE_ROW(bf16, bf16)
MOE_ROW(f16, f16)

#define MOE(T, S)                                                                                  \
    extern "C" __global__ void __launch_bounds__(MOE_WARPS * 32) moe_gate_up_##S(                     \
        const T* x, const T* w, const int* order, const int* offsets, const int* tile_offsets,    \
        int experts, int k, int dim, int ffn, float* act) {                                        \
        await_previous_kernel();                                                                   \
        moe_gate_up<T>(x, w, order, offsets, tile_offsets, experts, k, dim, ffn, act);             \
    }                                                                                              \
    extern "C" __global__ void __launch_bounds__(MOE_WARPS * 32) moe_down_##S(                        \
        const float* act, const T* w, const int* order, const int* offsets,                        \
        const int* tile_offsets, int experts, int dim, int ffn, float* y) {                        \
        await_previous_kernel();                                                                   \
        moe_down<T>(act, w, order, offsets, tile_offsets, experts, dim, ffn, y);                   \
    }                                                                                              \
    extern "C" __global__ void moe_combine_##S(const float* y, const float* probs, int k, int dim, \
                                               T* out, int add) {                                  \
        await_previous_kernel();                                                                   \
        moe_combine<T>(y, probs, k, dim, out, add);                                                \
    }

MOE(float, f32)
MOE(bf16, bf16)
MOE(f16, f16)
