// GGUF block formats kept on the device, repacked at upload (below): Q8_0, Q4_0 and Q4_1
// (32 values a block behind an f16 scale, and Q4_1's f16 minimum), Q4_K and Q6_K (256
// values a block with 6- or 8-bit scales of 32- or 16-value sub-blocks). Values are
// dequantized to f32 in registers as `quant/mod.rs` dequantizes them, and every sum is f32;
// activations are f16 (the block scales' type).

#define QUANT_THREADS 256
#define QUANT_WARPS (QUANT_THREADS / 32)

enum { Q8_0 = 0, Q4_0 = 1, Q4_1 = 2, Q4_K = 3, Q6_K = 4 };

// A matrix's blocks are kept in two runs (the backend repacks them at upload): every block's
// quants (QS bytes each), then every block's scales (SC bytes each), so that a warp reads
// the quants in whole 16-byte pieces. Block g of a buffer of nb blocks has its quants at
// w + g * QS and its scales at w + nb * QS + g * SC. A block is read in PARTS parts, a lane
// each, of VALS values: two runs of VALS / 2 consecutive values (run_a and run_b below).
//   Q8_0: quants are the 32 signed bytes; scales the f16 d.
//   Q4_0, Q4_1: byte i holds value i (low nibble) and i + 16 (high); scales d (and m).
//   Q4_K: 4 groups of 32 bytes, byte i of group c holding value 64c + i (low nibble) and
//     64c + 32 + i (high); scales d, dmin and the 12 bytes of 6-bit sub-block scales/mins.
//   Q6_K: ql (128 bytes) and qh (64), as GGUF orders them; scales the 16 signed sub-block
//     scales, then d.
template <int F> struct Block;
template <> struct Block<Q8_0> { static constexpr int QK = 32, QS = 32, SC = 2, PARTS = 2, VALS = 16; };
template <> struct Block<Q4_0> { static constexpr int QK = 32, QS = 16, SC = 2, PARTS = 2, VALS = 16; };
template <> struct Block<Q4_1> { static constexpr int QK = 32, QS = 16, SC = 4, PARTS = 2, VALS = 16; };
template <> struct Block<Q4_K> { static constexpr int QK = 256, QS = 128, SC = 16, PARTS = 8, VALS = 32; };
template <> struct Block<Q6_K> { static constexpr int QK = 256, QS = 192, SC = 18, PARTS = 8, VALS = 32; };

__device__ __forceinline__ float half_bits(u16 h) {
    f16 v;
    v.bits = h;
    return to_f32(v);
}

// Where in its block the two runs of part p start.
template <int F> __device__ __forceinline__ int run_a(int p) {
    if (F == Q8_0) return 16 * p;
    if (F == Q4_K) return 64 * (p >> 1) + 16 * (p & 1);
    if (F == Q6_K) return 128 * (p >> 2) + 32 * ((p >> 1) & 1) + 16 * (p & 1);
    return 8 * p;
}
template <int F> __device__ __forceinline__ int run_b(int p) {
    if (F == Q8_0) return 16 * p + 8;
    if (F == Q4_K) return run_a<F>(p) + 32;
    if (F == Q6_K) return run_a<F>(p) + 64;
    return 16 + 8 * p;
}

// The 6-bit scale and min of sub-block j from the 12 packed bytes q (quant/mod.rs's
// scale_min_k4).
__device__ __forceinline__ void scale_min_k4(int j, const unsigned char* q, int& sc, int& m) {
    if (j < 4) {
        sc = q[j] & 63;
        m = q[j + 4] & 63;
    } else {
        sc = (q[j + 4] & 0x0F) | ((q[j - 4] >> 6) << 4);
        m = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
    }
}

// Part p of block g: its VALS values, y[0..VALS/2) of run_a and y[VALS/2..VALS) of run_b.
template <int F>
__device__ __forceinline__ void dequantize_part(const unsigned char* w, long long nb, long long g,
                                                int p, float* y) {
    const unsigned char* quants = w + g * Block<F>::QS;
    const unsigned char* s = w + nb * Block<F>::QS + g * Block<F>::SC;
    if (F == Q8_0) {
        const float d = half_bits(*reinterpret_cast<const u16*>(s));
        const uint4 q = *reinterpret_cast<const uint4*>(quants + 16 * p);
        const u32 words[4] = {q.x, q.y, q.z, q.w};
#pragma unroll
        for (int i = 0; i < 16; i++)
            y[i] = d * (float)(signed char)((words[i >> 2] >> (8 * (i & 3))) & 0xff);
    } else if (F == Q4_0 || F == Q4_1) {
        float d, m = 0.0f;
        if (F == Q4_1) {
            const u32 dm = *reinterpret_cast<const u32*>(s);
            d = half_bits(dm & 0xffff);
            m = half_bits(dm >> 16);
        } else {
            d = half_bits(*reinterpret_cast<const u16*>(s));
        }
        const uint2 q = *reinterpret_cast<const uint2*>(quants + 8 * p);
        const u32 words[2] = {q.x, q.y};
#pragma unroll
        for (int i = 0; i < 8; i++) {
            const u32 byte = (words[i >> 2] >> (8 * (i & 3))) & 0xff;
            if (F == Q4_0) {
                y[i] = d * (float)((int)(byte & 0xf) - 8);
                y[8 + i] = d * (float)((int)(byte >> 4) - 8);
            } else {
                y[i] = d * (float)(byte & 0xf) + m;
                y[8 + i] = d * (float)(byte >> 4) + m;
            }
        }
    } else if (F == Q4_K) {
        const uint4 sv = *reinterpret_cast<const uint4*>(s);
        const unsigned char* sb = reinterpret_cast<const unsigned char*>(&sv);
        const float d = half_bits(sb[0] | (sb[1] << 8)), dmin = half_bits(sb[2] | (sb[3] << 8));
        const int c = p >> 1;
        int sc1, m1, sc2, m2;
        scale_min_k4(2 * c, sb + 4, sc1, m1);
        scale_min_k4(2 * c + 1, sb + 4, sc2, m2);
        const float d1 = d * (float)sc1, mm1 = dmin * (float)m1;
        const float d2 = d * (float)sc2, mm2 = dmin * (float)m2;
        const uint4 q = *reinterpret_cast<const uint4*>(quants + 32 * c + 16 * (p & 1));
        const u32 words[4] = {q.x, q.y, q.z, q.w};
#pragma unroll
        for (int i = 0; i < 16; i++) {
            const u32 byte = (words[i >> 2] >> (8 * (i & 3))) & 0xff;
            y[i] = d1 * (float)(byte & 0xf) - mm1;
            y[16 + i] = d2 * (float)(byte >> 4) - mm2;
        }
    } else {
        const int half = p >> 2, j = (p >> 1) & 1, h = p & 1;
        const float d = half_bits(*reinterpret_cast<const u16*>(s + 16));
        const float d_a = d * (float)(signed char)s[8 * half + h + 2 * j];
        const float d_b = d * (float)(signed char)s[8 * half + h + 4 + 2 * j];
        const uint4 ql = *reinterpret_cast<const uint4*>(quants + 64 * half + 32 * j + 16 * h);
        const uint4 qh = *reinterpret_cast<const uint4*>(quants + 128 + 32 * half + 16 * h);
        const u32 lw[4] = {ql.x, ql.y, ql.z, ql.w}, hw[4] = {qh.x, qh.y, qh.z, qh.w};
#pragma unroll
        for (int i = 0; i < 16; i++) {
            const u32 lo = (lw[i >> 2] >> (8 * (i & 3))) & 0xff;
            const u32 hi = (hw[i >> 2] >> (8 * (i & 3))) & 0xff;
            const int qa = (int)((lo & 0xf) | (((hi >> (2 * j)) & 3) << 4)) - 32;
            const int qb = (int)((lo >> 4) | (((hi >> (2 * j + 4)) & 3) << 4)) - 32;
            y[i] = d_a * (float)qa;
            y[16 + i] = d_b * (float)qb;
        }
    }
}

// out[r, j] (+)= Σ_k x[r, k] · w[j, k] (+ bias[j]) for r < M and QUANT_ROWS rows j of w per
// block: each x value read serves QUANT_ROWS weight rows. Lanes take a part of a block each
// (32 / PARTS consecutive blocks per warp step), so a warp reads 256 to 512 contiguous bytes
// of quants and 512 to 2,048 contiguous bytes of x per row; the block's 8 warps take every
// 8th group of blocks along k, and their sums meet in shared memory in warp order. A row's
// sums are taken in the same order whatever M is, so a row's result does not depend on the
// other rows of its step.
template <int F, typename O, int M>
__device__ void quant_gemv(const f16* x, const unsigned char* w, long long nb, const float* bias,
                           int n, int k, O* out, long long ld, int accumulate) {
    constexpr int PARTS = Block<F>::PARTS, VALS = Block<F>::VALS, PER_WARP = 32 / PARTS;
    constexpr int V = VALS / 16;  // 16-byte pieces of x per run
    __shared__ float partial[QUANT_WARPS][M][QUANT_ROWS];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, p = lane % PARTS;
    const int j0 = blockIdx.x * QUANT_ROWS;
    const int blocks = k / Block<F>::QK;
    float acc[M][QUANT_ROWS];
#pragma unroll
    for (int r = 0; r < M; r++)
#pragma unroll
        for (int i = 0; i < QUANT_ROWS; i++) acc[r][i] = 0.0f;
#pragma unroll 2
    for (int b = warp * PER_WARP + lane / PARTS; b < blocks; b += QUANT_WARPS * PER_WARP) {
        uint4 xa[M][V], xb[M][V];
#pragma unroll
        for (int r = 0; r < M; r++) {
            const f16* xr = x + (long long)r * k + (long long)b * Block<F>::QK;
#pragma unroll
            for (int v = 0; v < V; v++) {
                xa[r][v] = *reinterpret_cast<const uint4*>(xr + run_a<F>(p) + 8 * v);
                xb[r][v] = *reinterpret_cast<const uint4*>(xr + run_b<F>(p) + 8 * v);
            }
        }
#pragma unroll
        for (int i = 0; i < QUANT_ROWS; i++) {
            if (j0 + i >= n) break;
            float wf[VALS];
            dequantize_part<F>(w, nb, (long long)(j0 + i) * blocks + b, p, wf);
#pragma unroll
            for (int r = 0; r < M; r++) {
#pragma unroll
                for (int v = 0; v < V; v++) {
                    float xf[8];
                    unpack8<f16>(xa[r][v], xf);
#pragma unroll
                    for (int t = 0; t < 8; t++) acc[r][i] += wf[8 * v + t] * xf[t];
                }
#pragma unroll
                for (int v = 0; v < V; v++) {
                    float xf[8];
                    unpack8<f16>(xb[r][v], xf);
#pragma unroll
                    for (int t = 0; t < 8; t++) acc[r][i] += wf[VALS / 2 + 8 * v + t] * xf[t];
                }
            }
        }
    }
#pragma unroll
    for (int r = 0; r < M; r++)
#pragma unroll
        for (int i = 0; i < QUANT_ROWS; i++) {
            const float v = warp_sum(acc[r][i]);
            if (lane == 0) partial[warp][r][i] = v;
        }
    __syncthreads();
    if (threadIdx.x < M * QUANT_ROWS) {
        const int r = threadIdx.x / QUANT_ROWS, i = threadIdx.x % QUANT_ROWS, j = j0 + i;
        if (j < n) {
            float v = 0.0f;
#pragma unroll
            for (int q = 0; q < QUANT_WARPS; q++) v += partial[q][r][i];
            if (bias) v += bias[j];
            O* o = out + r * ld + j;
            if (accumulate) v += to_f32(*o);
            *o = from_f32<O>(v);
        }
    }
}

// Stores part p's VALS values as f16 at their places in the block's values at o.
template <int F> __device__ __forceinline__ void store_part(f16* o, int p, const float* y) {
    constexpr int HALF = Block<F>::VALS / 2;
#pragma unroll
    for (int run = 0; run < 2; run++) {
        f16* dst = o + (run ? run_b<F>(p) : run_a<F>(p));
#pragma unroll
        for (int v = 0; v < HALF / 8; v++) {
            uint4 packed;
            u16* e = reinterpret_cast<u16*>(&packed);
#pragma unroll
            for (int i = 0; i < 8; i++) e[i] = from_f32<f16>(y[run * HALF + 8 * v + i]).bits;
            *reinterpret_cast<uint4*>(dst + 8 * v) = packed;
        }
    }
}

// The blocks of w, `blocks` of them, as f16 values: one thread a part of a block.
template <int F>
__device__ void quant_dequantize(const unsigned char* w, long long blocks, f16* out) {
    const long long t = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    const long long g = t / Block<F>::PARTS;
    const int p = t % Block<F>::PARTS;
    if (g >= blocks) return;
    float y[Block<F>::VALS];
    dequantize_part<F>(w, blocks, g, p, y);
    store_part<F>(out + g * Block<F>::QK, p, y);
}

// Rows of a quantized embedding table (nb blocks) as f16, as `embedding` in elementwise.cu
// gathers them: ids outside first..first + rows are left as they are.
template <int F>
__device__ void quant_embedding(const unsigned char* table, long long nb, const int* ids,
                                int first, int rows, int dim, f16* out) {
    const long long row = blockIdx.x;
    const int id = ids[row] - first;
    if (id < 0 || id >= rows) return;
    const int blocks = dim / Block<F>::QK;
    for (int t = threadIdx.x; t < Block<F>::PARTS * blocks; t += blockDim.x) {
        const int b = t / Block<F>::PARTS, p = t % Block<F>::PARTS;
        float y[Block<F>::VALS];
        dequantize_part<F>(table, nb, (long long)id * blocks + b, p, y);
        store_part<F>(out + row * dim + (long long)b * Block<F>::QK, p, y);
    }
}

#define QUANT_GEMV(F, S, O, SO, M)                                                                 \
    extern "C" __global__ void __launch_bounds__(QUANT_THREADS) quant_gemv_##S##_##SO##_m##M(     \
        const f16* x, const unsigned char* w, long long nb, const float* bias, int n, int k,       \
        O* out, long long ld, int accumulate) {                                                    \
        await_previous_kernel();                                                                   \
        quant_gemv<F, O, M>(x, w, nb, bias, n, k, out, ld, accumulate);                            \
    }

#define QUANT_GEMV_ROWS(F, S, O, SO)                                                               \
    QUANT_GEMV(F, S, O, SO, 1) QUANT_GEMV(F, S, O, SO, 2) QUANT_GEMV(F, S, O, SO, 3)              \
    QUANT_GEMV(F, S, O, SO, 4)

#define QUANT(F, S)                                                                                \
    QUANT_GEMV_ROWS(F, S, f16, f16)                                                                \
    QUANT_GEMV_ROWS(F, S, float, f32)                                                              \
    extern "C" __global__ void quant_dequantize_##S(const unsigned char* w, long long blocks,      \
                                                    f16* out) {                                    \
        await_previous_kernel();                                                                   \
        quant_dequantize<F>(w, blocks, out);                                                       \
    }                                                                                              \
    extern "C" __global__ void quant_embedding_##S(const unsigned char* t, long long nb,           \
                                                   const int* ids, int first, int rows, int dim,   \
                                                   f16* out) {                                     \
        await_previous_kernel();                                                                   \
        quant_embedding<F>(t, nb, ids, first, rows, dim, out);                                     \
    }

QUANT(Q8_0, q8_0)
QUANT(Q4_0, q4_0)
QUANT(Q4_1, q4_1)
QUANT(Q4_K, q4_k)
QUANT(Q6_K, q6_k)
