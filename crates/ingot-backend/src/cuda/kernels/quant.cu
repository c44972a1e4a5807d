// GGUF block formats kept on the device (Q8_0, Q4_0, Q4_1: 32 weights a block behind an f16
// scale, and Q4_1's f16 minimum), repacked at upload (below). Values are dequantized to f32
// in registers as `quant/mod.rs` dequantizes them, and every sum is f32; activations are f16
// (the block scales' type).

#define QK 32
#define QUANT_THREADS 256
#define QUANT_WARPS (QUANT_THREADS / 32)

enum { Q8_0 = 0, Q4_0 = 1, Q4_1 = 2 };

// A matrix's blocks are kept in two runs (the backend repacks them at upload): every block's
// quants (QS bytes each), then every block's scale (and Q4_1's minimum; SC bytes each), so
// that a warp reads both in whole 16-byte pieces. Block g of a buffer of nb blocks has its
// quants at w + g * QS and its scale at w + nb * QS + g * SC. Q4 quants hold value i in the
// low nibble of byte i and value i + 16 in the high nibble; Q8_0's value i is byte i.
template <int F> struct Block;
template <> struct Block<Q8_0> { static constexpr int QS = 32, SC = 2; };
template <> struct Block<Q4_0> { static constexpr int QS = 16, SC = 2; };
template <> struct Block<Q4_1> { static constexpr int QS = 16, SC = 4; };

__device__ __forceinline__ float half_bits(u16 h) {
    f16 v;
    v.bits = h;
    return to_f32(v);
}

// The scale d and minimum m of block g (m = 0 where the format has none; Q4_0's offset of
// 8 is taken as m = -8 d).
template <int F>
__device__ __forceinline__ void block_scale(const unsigned char* w, long long nb, long long g,
                                            float& d, float& m) {
    const unsigned char* s = w + nb * Block<F>::QS + g * Block<F>::SC;
    if (F == Q4_1) {
        const u32 dm = *reinterpret_cast<const u32*>(s);
        d = half_bits(dm & 0xffff);
        m = half_bits(dm >> 16);
    } else {
        d = half_bits(*reinterpret_cast<const u16*>(s));
        m = 0.0f;
    }
}

// Half `h` of block g: 16 values, y[0..8) and y[8..16) at the two runs of 8 the half covers
// (Q4: values 8h.. and 16 + 8h..; Q8_0: values 16h.. and 16h + 8..), as `quant/mod.rs`
// dequantizes them.
template <int F>
__device__ __forceinline__ void dequantize_half(const unsigned char* w, long long nb, long long g,
                                                int h, float* y) {
    float d, m;
    block_scale<F>(w, nb, g, d, m);
    if (F == Q8_0) {
        const uint4 q = *reinterpret_cast<const uint4*>(w + g * Block<F>::QS + 16 * h);
        const u32 words[4] = {q.x, q.y, q.z, q.w};
#pragma unroll
        for (int i = 0; i < 16; i++)
            y[i] = d * (float)(signed char)((words[i >> 2] >> (8 * (i & 3))) & 0xff);
    } else {
        const uint2 q = *reinterpret_cast<const uint2*>(w + g * Block<F>::QS + 8 * h);
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
    }
}

// Where in its block the two runs of 8 values of half h start.
template <int F> __device__ __forceinline__ int run_a(int h) { return F == Q8_0 ? 16 * h : 8 * h; }
template <int F> __device__ __forceinline__ int run_b(int h) {
    return F == Q8_0 ? 16 * h + 8 : 16 + 8 * h;
}

// out[r, j] (+)= Σ_k x[r, k] · w[j, k] (+ bias[j]) for r < M and QUANT_ROWS rows j of w per
// block: each x value read serves QUANT_ROWS weight rows. Lanes take half a block each (16
// lanes' pairs, 16 consecutive blocks per warp step), so a warp reads 256 (Q4) or 512 (Q8)
// contiguous bytes of quants and 512 contiguous bytes of x per row; the block's 8 warps take
// every 8th group of 16 blocks along k, and their sums meet in shared memory in warp order.
// A row's sums are taken in the same order whatever M is, so a row's result does not depend
// on the other rows of its step.
template <int F, typename O, int M>
__device__ void quant_gemv(const f16* x, const unsigned char* w, long long nb, const float* bias,
                           int n, int k, O* out, long long ld, int accumulate) {
    __shared__ float partial[QUANT_WARPS][M][QUANT_ROWS];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, h = lane & 1;
    const int j0 = blockIdx.x * QUANT_ROWS;
    const int blocks = k / QK;
    float acc[M][QUANT_ROWS];
#pragma unroll
    for (int r = 0; r < M; r++)
#pragma unroll
        for (int i = 0; i < QUANT_ROWS; i++) acc[r][i] = 0.0f;
#pragma unroll 2
    for (int b = warp * 16 + (lane >> 1); b < blocks; b += QUANT_WARPS * 16) {
        uint4 xa[M], xb[M];
#pragma unroll
        for (int r = 0; r < M; r++) {
            const f16* xr = x + (long long)r * k + b * QK;
            xa[r] = *reinterpret_cast<const uint4*>(xr + run_a<F>(h));
            xb[r] = *reinterpret_cast<const uint4*>(xr + run_b<F>(h));
        }
#pragma unroll
        for (int i = 0; i < QUANT_ROWS; i++) {
            if (j0 + i >= n) break;
            float wf[16];
            dequantize_half<F>(w, nb, (long long)(j0 + i) * blocks + b, h, wf);
#pragma unroll
            for (int r = 0; r < M; r++) {
                float xf[8];
                unpack8<f16>(xa[r], xf);
#pragma unroll
                for (int t = 0; t < 8; t++) acc[r][i] += wf[t] * xf[t];
                unpack8<f16>(xb[r], xf);
#pragma unroll
                for (int t = 0; t < 8; t++) acc[r][i] += wf[8 + t] * xf[t];
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

// Stores 16 values as f16: y[0..8) at o + a, y[8..16) at o + b.
__device__ __forceinline__ void store_half(f16* o, int a, int b, const float* y) {
#pragma unroll
    for (int run = 0; run < 2; run++) {
        uint4 packed;
        u16* e = reinterpret_cast<u16*>(&packed);
#pragma unroll
        for (int i = 0; i < 8; i++) e[i] = from_f32<f16>(y[8 * run + i]).bits;
        *reinterpret_cast<uint4*>(o + (run ? b : a)) = packed;
    }
}

// The blocks of w, `blocks` of them, as f16 values: one thread a half block.
template <int F>
__device__ void quant_dequantize(const unsigned char* w, long long blocks, f16* out) {
    const long long t = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    const long long g = t >> 1;
    const int h = t & 1;
    if (g >= blocks) return;
    float y[16];
    dequantize_half<F>(w, blocks, g, h, y);
    store_half(out + g * QK, run_a<F>(h), run_b<F>(h), y);
}

// Rows of a quantized embedding table (nb blocks) as f16, as `embedding` in elementwise.cu
// gathers them: ids outside first..first + rows are left as they are.
template <int F>
__device__ void quant_embedding(const unsigned char* table, long long nb, const int* ids,
                                int first, int rows, int dim, f16* out) {
    const long long row = blockIdx.x;
    const int id = ids[row] - first;
    if (id < 0 || id >= rows) return;
    const int blocks = dim / QK;
    for (int t = threadIdx.x; t < 2 * blocks; t += blockDim.x) {
        const int b = t >> 1, h = t & 1;
        float y[16];
        dequantize_half<F>(table, nb, (long long)id * blocks + b, h, y);
        store_half(out + row * dim + b * QK, run_a<F>(h), run_b<F>(h), y);
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
