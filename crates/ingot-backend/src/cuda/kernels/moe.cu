// A mixture of experts on the device, with nothing read back: routing, a grouping of the
// step's slots (row, chosen expert) by expert, each expert's gated MLP over tiles of its
// slots, and each row's weighted sum of its slots.
//
// Every slot's output is its own f32 dot products in a fixed order along k, whichever tile
// it lands in, so the grouping (placed with atomics: the order of slots inside an expert's
// group may vary from run to run) changes no result bit, and a row's output does not depend
// on the other rows of its step. Each expert's weights are read once per tile of up to
// MOE_TILE of its slots: once per step at decode batch sizes where an expert gets few slots.

// MOE_TILE, MOE_WARPS, MOE_GATE_COLS and MOE_DOWN_COLS come from the backend (cuda/moe.rs).

template <typename T> __device__ __forceinline__ void load8(const T* p, float* f) {
    const uint4 v = *reinterpret_cast<const uint4*>(p);
    const T* e = reinterpret_cast<const T*>(&v);
#pragma unroll
    for (int i = 0; i < 8; i++) f[i] = to_f32(e[i]);
}
template <> __device__ __forceinline__ void load8<float>(const float* p, float* f) {
    const float4 a = *reinterpret_cast<const float4*>(p);
    const float4 b = *reinterpret_cast<const float4*>(p + 4);
    f[0] = a.x; f[1] = a.y; f[2] = a.z; f[3] = a.w;
    f[4] = b.x; f[5] = b.y; f[6] = b.z; f[7] = b.w;
}

// 8 weights, streamed past L1 as the GEMV streams them (the tile's inputs stay cached).
template <typename T> __device__ __forceinline__ void load8_weights(const T* p, float* f) {
    const uint4 v = load_streamed(p);
    const T* e = reinterpret_cast<const T*>(&v);
#pragma unroll
    for (int i = 0; i < 8; i++) f[i] = to_f32(e[i]);
}
template <> __device__ __forceinline__ void load8_weights<float>(const float* p, float* f) {
    load8<float>(p, f);
}

// Keeps the larger value, the lower index among equals.
__device__ __forceinline__ void keep_better(float& v, int& i, float v2, int i2) {
    if (v2 > v || (v2 == v && i2 < i)) {
        v = v2;
        i = i2;
    }
}

// The block's largest (value, index), the lower index among equals, to every thread.
__device__ __forceinline__ void block_argmax(float& v, int& i) {
    __shared__ float sv[32];
    __shared__ int si[32];
#pragma unroll
    for (int o = 16; o > 0; o >>= 1)
        keep_better(v, i, __shfl_xor_sync(0xffffffffu, v, o), __shfl_xor_sync(0xffffffffu, i, o));
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    __syncthreads();
    if (lane == 0) {
        sv[warp] = v;
        si[warp] = i;
    }
    __syncthreads();
    const int warps = blockDim.x >> 5;
    v = lane < warps ? sv[lane] : -1.0f;
    i = lane < warps ? si[lane] : 0x7fffffff;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1)
        keep_better(v, i, __shfl_xor_sync(0xffffffffu, v, o), __shfl_xor_sync(0xffffffffu, i, o));
}

__device__ __forceinline__ float block_max(float v) {
    __shared__ float partial[32];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    v = warp_max(v);
    __syncthreads();
    if (lane == 0) partial[warp] = v;
    __syncthreads();
    const int warps = blockDim.x >> 5;
    return warp_max(lane < warps ? partial[lane] : NEG_INF);
}

// Grid: one block per row; `experts` floats of dynamic shared memory. Softmax over the
// experts, the k largest probabilities in descending order (compared as the CPU compares
// them, so logits that round to one probability tie; the lower index first), rescaled to
// sum to 1 where `renormalize`.
extern "C" __global__ void moe_route(const float* logits, int experts, int k, int renormalize,
                                     int* ids, float* probs) {
    await_previous_kernel();
    extern __shared__ float p[];
    const long long r = blockIdx.x;
    const float* l = logits + r * experts;
    float m = NEG_INF;
    for (int e = threadIdx.x; e < experts; e += blockDim.x) m = fmaxf(m, l[e]);
    m = block_max(m);
    float s = 0.0f;
    for (int e = threadIdx.x; e < experts; e += blockDim.x) {
        p[e] = expf(l[e] - m);
        s += p[e];
    }
    const float sum = block_sum(s);
    float chosen = 0.0f;
    for (int j = 0; j < k; j++) {
        float v = -1.0f;
        int i = 0x7fffffff;
        for (int e = threadIdx.x; e < experts; e += blockDim.x) keep_better(v, i, p[e], e);
        block_argmax(v, i);
        chosen += v / sum;
        if (threadIdx.x == 0) {
            ids[r * k + j] = i;
            probs[r * k + j] = v / sum;
            p[i] = -1.0f;
        }
        __syncthreads();
    }
    if (renormalize)
        for (int j = threadIdx.x; j < k; j += blockDim.x) probs[r * k + j] /= chosen;
}

// One block; 2 * experts ints of dynamic shared memory. Counts each expert's slots, lays
// the groups out in expert order (offsets, and tile_offsets: where each expert's tiles of
// MOE_TILE slots start in the grid), and places every slot in its group (order: the slot
// at each grouped position; slot_pos: the grouped position of each slot).
extern "C" __global__ void moe_group(const int* ids, int slots, int experts, int* offsets,
                                     int* tile_offsets, int* order, int* slot_pos) {
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
            tiles += (counts[e] + MOE_TILE - 1) / MOE_TILE;
        }
        offsets[experts] = at;
        tile_offsets[experts] = tiles;
    }
    __syncthreads();
    for (int s = threadIdx.x; s < slots; s += blockDim.x) {
        const int g = atomicAdd(&cursor[ids[s]], 1);
        order[g] = s;
        slot_pos[s] = g;
    }
}

// The expert and the grouped slots [first, first + n) of tile blockIdx.y; false past the
// step's last tile.
__device__ __forceinline__ bool moe_tile(const int* offsets, const int* tile_offsets, int experts,
                                         int& e, int& first, int& n) {
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
    first = offsets[e] + (t - tile_offsets[e]) * MOE_TILE;
    n = min(MOE_TILE, offsets[e + 1] - first);
    return true;
}

// acc[r][c] = Σ x_r[kk] · w_c[kk] over [0, len) for the tile's n live rows (of MOE_TILE)
// against C weight rows, summed over the warp and returned to every lane. A lane reads 16
// bytes of each weight row per step along k (8 elements; element by element where rows are
// not whole 16-byte vectors), so the warp's loads are coalesced and several are in flight.
template <typename X, typename W, int C>
__device__ __forceinline__ void warp_tile_dots(const X* const* x, int n, const W* const* w, int len,
                                               float (&acc)[MOE_TILE][C]) {
    const int lane = threadIdx.x & 31;
#pragma unroll
    for (int r = 0; r < MOE_TILE; r++)
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
        for (int r = 0; r < MOE_TILE; r++) {
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
        for (int r = 0; r < MOE_TILE; r++) {
            if (r < n) {
#pragma unroll
                for (int c = 0; c < C; c++) acc[r][c] += to_f32(w[c][kk]) * to_f32(x[r][kk]);
            }
        }
    }
#pragma unroll
    for (int r = 0; r < MOE_TILE; r++)
        if (r < n)
#pragma unroll
            for (int c = 0; c < C; c++) acc[r][c] = warp_sum(acc[r][c]);
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
    if (!moe_tile(offsets, tile_offsets, experts, e, first, n)) return;
    const int j0 = (blockIdx.x * MOE_WARPS + (threadIdx.x >> 5)) * C;
    if (j0 >= ffn) return;
    const T* xr[MOE_TILE];
#pragma unroll
    for (int r = 0; r < MOE_TILE; r++) xr[r] = x + (long long)(order[first + min(r, n - 1)] / k) * dim;
    // Columns past ffn read the last column again and are not stored.
    const T* wr[2 * C];
#pragma unroll
    for (int c = 0; c < C; c++) {
        const long long j = min(j0 + c, ffn - 1);
        wr[c] = w + ((long long)e * 2 * ffn + j) * dim;
        wr[C + c] = w + ((long long)e * 2 * ffn + ffn + j) * dim;
    }
    float acc[MOE_TILE][2 * C];
    warp_tile_dots<T, T, 2 * C>(xr, n, wr, dim, acc);
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
    if (!moe_tile(offsets, tile_offsets, experts, e, first, n)) return;
    const int j0 = (blockIdx.x * MOE_WARPS + (threadIdx.x >> 5)) * C;
    if (j0 >= dim) return;
    const float* ar[MOE_TILE];
#pragma unroll
    for (int r = 0; r < MOE_TILE; r++) ar[r] = act + (long long)(first + min(r, n - 1)) * ffn;
    const T* wr[C];
#pragma unroll
    for (int c = 0; c < C; c++) wr[c] = w + ((long long)e * dim + min(j0 + c, dim - 1)) * ffn;
    float acc[MOE_TILE][C];
    warp_tile_dots<float, T, C>(ar, n, wr, ffn, acc);
    const int lane = threadIdx.x & 31;
#pragma unroll
    for (int r = 0; r < MOE_TILE; r++)
#pragma unroll
        for (int c = 0; c < C; c++)
            if (lane == r * C + c && r < n && j0 + c < dim)
                y[(long long)order[first + r] * dim + j0 + c] = acc[r][c];
}

// Grid: one block per row. out[r, j] = Σ_i probs[r * k + i] · y[r * k + i, j] in slot order.
template <typename T>
__device__ void moe_combine(const float* y, const float* probs, int k, int dim, T* out) {
    const long long r = blockIdx.x;
    for (int j = threadIdx.x; j < dim; j += blockDim.x) {
        float acc = 0.0f;
        for (int i = 0; i < k; i++) acc += probs[r * k + i] * y[(r * k + i) * dim + j];
        out[r * dim + j] = from_f32<T>(acc);
    }
}

// The grouped-GEMM path's ends. Grid: one block per grouped slot g: xs[g] = x[order[g] / k].
template <typename T>
__device__ void moe_gather(const T* x, const int* order, int k, int dim, T* xs) {
    const long long g = blockIdx.x;
    const T* src = x + (long long)(order[g] / k) * dim;
    for (int j = threadIdx.x; j < dim; j += blockDim.x) xs[g * dim + j] = src[j];
}

// Grid: one block per row. out[r, j] = Σ_i probs[s] · ys[slot_pos[s], j] over the row's
// slots s = r * k + i, in slot order, ys in grouped order.
template <typename T>
__device__ void moe_combine_grouped(const T* ys, const float* probs, const int* slot_pos, int k,
                                    int dim, T* out) {
    const long long r = blockIdx.x;
    for (int j = threadIdx.x; j < dim; j += blockDim.x) {
        float acc = 0.0f;
        for (int i = 0; i < k; i++)
            acc += probs[r * k + i] * to_f32(ys[(long long)slot_pos[r * k + i] * dim + j]);
        out[r * dim + j] = from_f32<T>(acc);
    }
}

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
                                               T* out) {                                           \
        await_previous_kernel();                                                                   \
        moe_combine<T>(y, probs, k, dim, out);                                                     \
    }                                                                                              \
    extern "C" __global__ void moe_gather_##S(const T* x, const int* order, int k, int dim,       \
                                              T* xs) {                                             \
        await_previous_kernel();                                                                   \
        moe_gather<T>(x, order, k, dim, xs);                                                       \
    }                                                                                              \
    extern "C" __global__ void moe_combine_grouped_##S(const T* ys, const float* probs,           \
                                                       const int* pos, int k, int dim, T* out) {   \
        await_previous_kernel();                                                                   \
        moe_combine_grouped<T>(ys, probs, pos, k, dim, out);                                       \
    }

MOE(float, f32)
MOE(bf16, bf16)
MOE(f16, f16)
