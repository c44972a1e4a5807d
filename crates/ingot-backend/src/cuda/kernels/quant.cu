// Block formats kept on the device, repacked at upload (below): GGUF's Q8_0, Q4_0 and Q4_1
// (32 values a block behind an f16 scale, and Q4_1's f16 minimum), Q4_K and Q6_K (256
// values a block with 6- or 8-bit scales of 32- or 16-value sub-blocks), and ingot's FP8
// (`quant/fp8.rs`: 128 e4m3 values behind an f32 scale). Values are
// dequantized to f32 in registers as `quant/mod.rs` dequantizes them, and every sum is f32;
// activations are f16 (the block scales' type). The exception is quant_gemv_q8 (one row of
// Q4_K or Q6_K): integer sums of int8 products, scaled and summed in f32.

enum { Q8_0 = 0, Q4_0 = 1, Q4_1 = 2, Q4_K = 3, Q6_K = 4, FP8 = 5 };

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
//   FP8: quants are the 128 e4m3 bytes; scales the f32 scale.
template <int F> struct Block;
template <> struct Block<Q8_0> { static constexpr int QK = 32, QS = 32, SC = 2, PARTS = 2, VALS = 16; };
template <> struct Block<Q4_0> { static constexpr int QK = 32, QS = 16, SC = 2, PARTS = 2, VALS = 16; };
template <> struct Block<Q4_1> { static constexpr int QK = 32, QS = 16, SC = 4, PARTS = 2, VALS = 16; };
template <> struct Block<Q4_K> { static constexpr int QK = 256, QS = 128, SC = 16, PARTS = 8, VALS = 32; };
template <> struct Block<Q6_K> { static constexpr int QK = 256, QS = 192, SC = 18, PARTS = 8, VALS = 32; };
template <> struct Block<FP8> { static constexpr int QK = 128, QS = 128, SC = 4, PARTS = 8, VALS = 16; };

__device__ __forceinline__ float half_bits(u16 h) {
    f16 v;
    v.bits = h;
    return to_f32(v);
}

// e4m3 bytes 0 and 1 (lo) or 2 and 3 (hi) of `word` as an f16 pair, each 2^-8 of its value:
// the sign stays the top bit and exponent and mantissa move into f16's, whose exponent bias
// is 8 more (e4m3's subnormals land on f16's, which the same shift keeps exact). The 2^8 is
// taken with the scale.
__device__ __forceinline__ u32 e4m3x2_lo(u32 word) {
    const u32 b = __byte_perm(word, 0, 0x1404);
    return (b & 0x80008000u) | ((b & 0x7f007f00u) >> 1);
}
__device__ __forceinline__ u32 e4m3x2_hi(u32 word) {
    const u32 b = __byte_perm(word, 0, 0x3424);
    return (b & 0x80008000u) | ((b & 0x7f007f00u) >> 1);
}
#define E4M3_UNSHIFT 256.0f

// Where in its block the two runs of part p start.
template <int F> __device__ __forceinline__ int run_a(int p) {
    if (F == Q8_0 || F == FP8) return 16 * p;
    if (F == Q4_K) return 64 * (p >> 1) + 16 * (p & 1);
    if (F == Q6_K) return 128 * (p >> 2) + 32 * ((p >> 1) & 1) + 16 * (p & 1);
    return 8 * p;
}
template <int F> __device__ __forceinline__ int run_b(int p) {
    if (F == Q8_0 || F == FP8) return 16 * p + 8;
    if (F == Q4_K) return run_a<F>(p) + 32;
    if (F == Q6_K) return run_a<F>(p) + 64;
    return 16 + 8 * p;
}

__device__ __forceinline__ u32 word_of(const uint4& v, int i) {
    return i == 0 ? v.x : i == 1 ? v.y : i == 2 ? v.z : v.w;
}

// The 6-bit scales and mins of sub-blocks j and j + 1 (j even) of a Q4_K block, as
// quant/mod.rs's scale_min_k4 reads them, from the block's scale bytes held in registers
// (words y, z and w of sc; `high` is j >= 4). Sub-block i's bytes stand at the same place
// in fixed words (byte i & 3 of y, z and w), so each value is a shift and a mask, without
// branches or word selects: where the caller knows `high` at compile time only its form is
// computed (quant_mma's pieces), else both and a select (ncu, H200: the branchy decode of
// one j at a time was about a quarter of quant_mma's instructions).
__device__ __forceinline__ void scale_min_k4_pair(bool high, int j, const uint4& sc, int (&s)[2],
                                                  int (&m)[2]) {
#pragma unroll
    for (int i = 0; i < 2; i++) {
        const int at = 8 * ((j + i) & 3);
        const u32 y = sc.y >> at, z = sc.z >> at, w = sc.w >> at;
        s[i] = high ? (int)((w & 15) | (((y >> 6) & 3) << 4)) : (int)(y & 63);
        m[i] = high ? (int)(((w >> 4) & 15) | (((z >> 6) & 3) << 4)) : (int)(z & 63);
    }
}

// Part p of block g as loaded: the quant and scale words its values need, kept raw so that a
// kernel can issue the loads of several rows before it dequantizes any (quant_gemv).
//   q: the part's quants (Q4_0, Q4_1: q.x and q.y); qh: Q6_K's high bits.
//   sc: Q8_0, Q4_0 the f16 d in sc.x; Q4_1 d and m in sc.x; Q4_K the block's 16 scale bytes;
//   Q6_K d in sc.x and the two sub-block scales (signed bytes) in sc.y and sc.z; FP8 the f32
//   scale's bits in sc.x.
struct RawPart {
    uint4 q, qh, sc;
};

template <int F>
__device__ __forceinline__ RawPart load_part(const unsigned char* w, long long nb, long long g,
                                             int p) {
    const unsigned char* quants = w + g * Block<F>::QS;
    const unsigned char* s = w + nb * Block<F>::QS + g * Block<F>::SC;
    RawPart r{};
    if (F == Q8_0) {
        r.q = load_streamed(quants + 16 * p);
        r.sc.x = *reinterpret_cast<const u16*>(s);
    } else if (F == FP8) {
        r.q = load_streamed(quants + 16 * p);
        r.sc.x = *reinterpret_cast<const u32*>(s);
    } else if (F == Q4_0 || F == Q4_1) {
        const uint2 q = *reinterpret_cast<const uint2*>(quants + 8 * p);
        r.q.x = q.x;
        r.q.y = q.y;
        r.sc.x = F == Q4_1 ? *reinterpret_cast<const u32*>(s) : *reinterpret_cast<const u16*>(s);
    } else if (F == Q4_K) {
        r.sc = *reinterpret_cast<const uint4*>(s);
        r.q = load_streamed(quants + 32 * (p >> 1) + 16 * (p & 1));
    } else {
        const int half = p >> 2, j = (p >> 1) & 1, h = p & 1;
        r.sc.x = *reinterpret_cast<const u16*>(s + 16);
        r.sc.y = (u32)s[8 * half + h + 2 * j];
        r.sc.z = (u32)s[8 * half + h + 4 + 2 * j];
        r.q = load_streamed(quants + 64 * half + 32 * j + 16 * h);
        r.qh = load_streamed(quants + 128 + 32 * half + 16 * h);
    }
    return r;
}

// The scales and minimums of the two Q4_K sub-blocks part p's runs lie in (run_a's, then
// run_b's): d · scale and dmin · min.
__device__ __forceinline__ void q4_k_part_scales(const RawPart& r, int p, float& d1, float& mm1,
                                                 float& d2, float& mm2) {
    const float d = half_bits(r.sc.x & 0xffff), dmin = half_bits(r.sc.x >> 16);
    const int c = p >> 1;
    int sc[2], mn[2];
    scale_min_k4_pair(c >= 2, 2 * c, r.sc, sc, mn);
    d1 = d * (float)sc[0];
    mm1 = dmin * (float)mn[0];
    d2 = d * (float)sc[1];
    mm2 = dmin * (float)mn[1];
}

// Part p's VALS values from its raw words: y[0..VALS/2) of run_a and y[VALS/2..VALS) of run_b.
template <int F> __device__ __forceinline__ void dequantize_raw(const RawPart& r, int p, float* y) {
    if (F == Q8_0) {
        const float d = half_bits(r.sc.x);
        const u32 words[4] = {r.q.x, r.q.y, r.q.z, r.q.w};
#pragma unroll
        for (int i = 0; i < 16; i++)
            y[i] = d * (float)(signed char)((words[i >> 2] >> (8 * (i & 3))) & 0xff);
    } else if (F == FP8) {
        const float d = __uint_as_float(r.sc.x) * E4M3_UNSHIFT;
        const u32 words[4] = {r.q.x, r.q.y, r.q.z, r.q.w};
#pragma unroll
        for (int i = 0; i < 4; i++) {
            const u32 lo = e4m3x2_lo(words[i]), hi = e4m3x2_hi(words[i]);
            y[4 * i] = d * half_bits(lo & 0xffff);
            y[4 * i + 1] = d * half_bits(lo >> 16);
            y[4 * i + 2] = d * half_bits(hi & 0xffff);
            y[4 * i + 3] = d * half_bits(hi >> 16);
        }
    } else if (F == Q4_0 || F == Q4_1) {
        const float d = half_bits(r.sc.x & 0xffff);
        const float m = F == Q4_1 ? half_bits(r.sc.x >> 16) : 0.0f;
        const u32 words[2] = {r.q.x, r.q.y};
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
        float d1, mm1, d2, mm2;
        q4_k_part_scales(r, p, d1, mm1, d2, mm2);
        const u32 words[4] = {r.q.x, r.q.y, r.q.z, r.q.w};
#pragma unroll
        for (int i = 0; i < 16; i++) {
            const u32 byte = (words[i >> 2] >> (8 * (i & 3))) & 0xff;
            y[i] = d1 * (float)(byte & 0xf) - mm1;
            y[16 + i] = d2 * (float)(byte >> 4) - mm2;
        }
    } else {
        const int j = (p >> 1) & 1;
        const float d = half_bits(r.sc.x);
        const float d_a = d * (float)(signed char)r.sc.y;
        const float d_b = d * (float)(signed char)r.sc.z;
        const u32 lw[4] = {r.q.x, r.q.y, r.q.z, r.q.w}, hw[4] = {r.qh.x, r.qh.y, r.qh.z, r.qh.w};
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

template <int F>
__device__ __forceinline__ void dequantize_part(const unsigned char* w, long long nb, long long g,
                                                int p, float* y) {
    dequantize_raw<F>(load_part<F>(w, nb, g, p), p, y);
}

// Lane part p of block b of the ROWS weight rows from j0, loaded before any of them is
// used: one row at a time, a lane had only its 8 to 32 bytes in flight and waited on memory
// once a row (SASS, H200). Rows past n repeat row n - 1 and are not stored; a branch there
// let the compiler sink each row's loads back under it.
template <int F, int ROWS>
__device__ __forceinline__ void load_rows(RawPart (&raw)[ROWS], const unsigned char* w,
                                          long long nb, int j0, int n, int blocks, int b, int p) {
#pragma unroll
    for (int i = 0; i < ROWS; i++)
        raw[i] = load_part<F>(w, nb, (long long)min(j0 + i, n - 1) * blocks + b, p);
}

// quant_gemv's warps a block (the Rust side launches 32 * WARPS threads) and the blocks an SM
// should hold (launch bounds). A warp step covers 512 values of a 32-value format and 1,024
// of a K-quant, so 8 and 4 warps cover a row of 4,096 in one step: with 8, half of a
// K-quant block's warps waited at the barrier (ncu, H200, Llama-3.1-8B shapes). MIN is the
// register budget that keeps every row's loads in flight without spilling; Q6_K's three
// words a part take about 190 registers (124 bytes of spills at 128).
// Q8_ROWS are the weight rows of a quant_gemv_q8 block: every block quantizes the whole
// activation row first, so Q4_K takes eight rows (QUANT_Q8_ROWS; 128 registers, no spills)
// to spread that over twice the weights (H200, random Q4_K file at Llama-3.1-8B shapes, B=1
// decode: 382 tok/s against 350 with four). Q6_K keeps four: its parts take 148 registers
// at four rows already.
// ROWS are the weight rows of a quant_gemv block (QUANT_ROWS). FP8 takes small blocks
// (QUANT_FP8_WARPS and QUANT_FP8_ROWS, measured in quant.rs), 768 threads an SM at most.
template <int F> struct GemvShape {
    static constexpr int WARPS = 8, MIN = 3, Q8_ROWS = QUANT_ROWS, ROWS = QUANT_ROWS;
};
template <> struct GemvShape<Q4_K> {
    static constexpr int WARPS = 4, MIN = 4, Q8_ROWS = QUANT_Q8_ROWS, ROWS = QUANT_ROWS;
};
template <> struct GemvShape<Q6_K> {
    static constexpr int WARPS = 4, MIN = 2, Q8_ROWS = QUANT_ROWS, ROWS = QUANT_ROWS;
};
template <> struct GemvShape<FP8> {
    static constexpr int WARPS = QUANT_FP8_WARPS, MIN = 24 / QUANT_FP8_WARPS;
    static constexpr int Q8_ROWS = QUANT_ROWS, ROWS = QUANT_FP8_ROWS;
};

// The end of a one-row-product block: its warps' sums of ROWS weight rows meet in shared
// memory in warp order, then bias, accumulation and the store.
template <int WARPS, int M, int ROWS, typename O>
__device__ __forceinline__ void store_gemv_rows(float (&acc)[M][ROWS],
                                                float (&partial)[WARPS][M][ROWS], int j0,
                                                const float* bias, int n, O* out, long long ld,
                                                int accumulate) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
#pragma unroll
    for (int r = 0; r < M; r++)
#pragma unroll
        for (int i = 0; i < ROWS; i++) {
            const float v = warp_sum(acc[r][i]);
            if (lane == 0) partial[warp][r][i] = v;
        }
    __syncthreads();
    if (threadIdx.x < M * ROWS) {
        const int r = threadIdx.x / ROWS, i = threadIdx.x % ROWS, j = j0 + i;
        if (j < n) {
            float v = 0.0f;
#pragma unroll
            for (int q = 0; q < WARPS; q++) v += partial[q][r][i];
            if (bias) v += bias[j];
            O* o = out + r * ld + j;
            if (accumulate) v += to_f32(*o);
            *o = from_f32<O>(v);
        }
    }
}

// out[r, j] (+)= Σ_k x[r, k] · w[j, k] (+ bias[j]) for r < M and ROWS rows j of w per
// block: each x value read serves ROWS weight rows. Lanes take a part of a block each
// (32 / PARTS consecutive blocks per warp step), so a warp reads 256 to 512 contiguous bytes
// of quants and 512 to 2,048 contiguous bytes of x per row; the block's WARPS warps take
// every WARPS-th group of blocks along k, and their sums meet in shared memory in warp order.
// A row's sums are taken in the same order whatever M is, so a row's result does not depend
// on the other rows of its step.
template <int F, typename O, int M>
__device__ void quant_gemv(const f16* x, const unsigned char* w, long long nb, const float* bias,
                           int n, int k, O* out, long long ld, int accumulate) {
    constexpr int PARTS = Block<F>::PARTS, VALS = Block<F>::VALS, PER_WARP = 32 / PARTS;
    constexpr int V = VALS / 16;  // 16-byte pieces of x per run
    constexpr int WARPS = GemvShape<F>::WARPS, ROWS = GemvShape<F>::ROWS;
    __shared__ float partial[WARPS][M][ROWS];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, p = lane % PARTS;
    const int j0 = blockIdx.x * ROWS;
    const int blocks = k / Block<F>::QK;
    float acc[M][ROWS];
#pragma unroll
    for (int r = 0; r < M; r++)
#pragma unroll
        for (int i = 0; i < ROWS; i++) acc[r][i] = 0.0f;
#pragma unroll 2
    for (int b = warp * PER_WARP + lane / PARTS; b < blocks; b += WARPS * PER_WARP) {
        RawPart raw[ROWS];
        load_rows<F, ROWS>(raw, w, nb, j0, n, blocks, b, p);
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
        for (int i = 0; i < ROWS; i++) {
            float wf[VALS];
            dequantize_raw<F>(raw[i], p, wf);
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
    store_gemv_rows<WARPS, M, ROWS, O>(acc, partial, j0, bias, n, out, ld, accumulate);
}

// One-row products of K-quant blocks (Q4_K, Q6_K) on int8 dot products, as llama.cpp's MMVQ:
// the block quantizes the activation row into shared memory, 32 values to an f32 scale
// (max |x| / 127) and int8 values rounded to nearest (the CPU backend rounds its activations
// to int8 too, with a scale per 256 values for K-quants), then a lane's part of a block is
// 8 `dp4a` over its 32 quants and 8 over the part's x (the sums the minimums and Q6_K's
// offset of 32 need). Dequantizing to f32 cost about five
// instructions a weight, and the ALU pipe bound quant_gemv (ncu, H200, Q4_K). The first
// step's weight loads go out before the wait on the previous kernel: weights are constant.
// Shared memory: k bytes of quants, then k / 32 scales.
template <int F, typename O>
__device__ void quant_gemv_q8(const f16* x, const unsigned char* w, long long nb, const float* bias,
                              int n, int k, O* out, long long ld, int accumulate) {
    constexpr int PARTS = Block<F>::PARTS, PER_WARP = 32 / PARTS, WARPS = GemvShape<F>::WARPS;
    constexpr int ROWS = GemvShape<F>::Q8_ROWS;
    extern __shared__ __align__(16) unsigned char x_q8[];
    float* xd = reinterpret_cast<float*>(x_q8 + k);
    __shared__ float partial[WARPS][1][ROWS];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, p = lane % PARTS;
    const int j0 = blockIdx.x * ROWS;
    const int blocks = k / Block<F>::QK, b0 = warp * PER_WARP + lane / PARTS;
    RawPart raw[ROWS];
    load_rows<F, ROWS>(raw, w, nb, j0, n, blocks, min(b0, blocks - 1), p);
    await_previous_kernel();
    for (int g = threadIdx.x; g < k / 32; g += 32 * WARPS) {
        float v[32];
#pragma unroll
        for (int u = 0; u < 4; u++) unpack8<f16>(load_input(x + 32 * g + 8 * u), v + 8 * u);
        float amax = 0.0f;
#pragma unroll
        for (int i = 0; i < 32; i++) amax = fmaxf(amax, fabsf(v[i]));
        const float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
        u32 q[8];
#pragma unroll
        for (int t = 0; t < 8; t++) {
            q[t] = 0;
#pragma unroll
            for (int c = 0; c < 4; c++)
                q[t] |= (u32)(__float2int_rn(v[4 * t + c] * inv) & 0xff) << (8 * c);
        }
        uint4* dst = reinterpret_cast<uint4*>(x_q8 + 32 * g);
        dst[0] = make_uint4(q[0], q[1], q[2], q[3]);
        dst[1] = make_uint4(q[4], q[5], q[6], q[7]);
        xd[g] = amax / 127.0f;
    }
    __syncthreads();
    float acc[1][ROWS] = {};
    for (int b = b0; b < blocks; b += WARPS * PER_WARP) {
        if (b != b0) load_rows<F, ROWS>(raw, w, nb, j0, n, blocks, b, p);
        // The part's two runs of 16 x values, each inside one 32-value scale group.
        const int xa = b * Block<F>::QK + run_a<F>(p), xb = b * Block<F>::QK + run_b<F>(p);
        const uint4 qa = *reinterpret_cast<const uint4*>(x_q8 + xa);
        const uint4 qb = *reinterpret_cast<const uint4*>(x_q8 + xb);
        const u32 wa[4] = {qa.x, qa.y, qa.z, qa.w}, wb[4] = {qb.x, qb.y, qb.z, qb.w};
        const float da = xd[xa >> 5], db = xd[xb >> 5];
        int sa = 0, sb = 0;
#pragma unroll
        for (int t = 0; t < 4; t++) {
            sa = __dp4a(0x01010101, (int)wa[t], sa);
            sb = __dp4a(0x01010101, (int)wb[t], sb);
        }
#pragma unroll
        for (int i = 0; i < ROWS; i++) {
            const RawPart& r = raw[i];
            const u32 lw[4] = {r.q.x, r.q.y, r.q.z, r.q.w};
            int ia = 0, ib = 0;
            if (F == Q4_K) {
#pragma unroll
                for (int t = 0; t < 4; t++) {
                    ia = __dp4a((int)(lw[t] & 0x0f0f0f0fu), (int)wa[t], ia);
                    ib = __dp4a((int)((lw[t] >> 4) & 0x0f0f0f0fu), (int)wb[t], ib);
                }
                float d1, mm1, d2, mm2;
                q4_k_part_scales(r, p, d1, mm1, d2, mm2);
                acc[0][i] += da * (d1 * (float)ia - mm1 * (float)sa) +
                             db * (d2 * (float)ib - mm2 * (float)sb);
            } else {
                const int j = (p >> 1) & 1;
                const u32 hw[4] = {r.qh.x, r.qh.y, r.qh.z, r.qh.w};
#pragma unroll
                for (int t = 0; t < 4; t++) {
                    const u32 lo = lw[t] & 0x0f0f0f0fu, hi = (lw[t] >> 4) & 0x0f0f0f0fu;
                    const u32 ha = ((hw[t] >> (2 * j)) & 0x03030303u) << 4;
                    const u32 hb = ((hw[t] >> (2 * j + 4)) & 0x03030303u) << 4;
                    ia = __dp4a((int)(lo | ha), (int)wa[t], ia);
                    ib = __dp4a((int)(hi | hb), (int)wb[t], ib);
                }
                const float d = half_bits(r.sc.x);
                acc[0][i] += da * d * (float)(signed char)r.sc.y * (float)(ia - 32 * sa) +
                             db * d * (float)(signed char)r.sc.z * (float)(ib - 32 * sb);
            }
        }
    }
    store_gemv_rows<WARPS, 1, ROWS, O>(acc, partial, j0, bias, n, out, ld, accumulate);
}

// Products of 2 to 8 * NT rows on tensor cores, reading the blocks once. A block of
// QMMA_WARPS warps computes QMMA_ROWS = 16 * QMMA_WARPS weight rows, an m16 tile a warp, for
// all the rows of x, over the chunks of QMMA_CHUNK values of k that blockIdx.y takes (a
// split of k, so that matrices of few rows still fill the GPU). Chunk by chunk, the block
// copies x's values into shared memory (cp.async, the next chunk's while it multiplies this
// one) and every warp loads its rows' next pieces into registers. In a k-step of K_STEP
// values the four lanes t of a weight row read 16-byte pieces that lie side by side (Piece
// below), so a warp reads whole 64-byte runs of quants. Each piece is dequantized in
// registers, four values at a time (a quad), into m16n8k16 A fragments of f16 values (Scales
// says how they round). A lane's four values of a quad stand where the fragment wants k 2t,
// 2t + 1, 2t + 8 and 2t + 9, and the lane's x fragment takes the same four k, so every
// product is the dot product over k in some order. Shared memory holds x in that order
// (xs_slot), so a warp's fragment loads are 8 bytes a lane without bank conflicts. The
// splits' sums meet in a workspace that quant_mma_reduce adds in split order, and the
// split depends on the matrix's shape only: a row's result does not depend on the other
// rows of its step.
// A warp loads the next chunk's pieces while it multiplies one (PREFETCH), except Q6_K's,
// whose three words a piece would not fit the registers twice, and at 64 rows of x (NT 8),
// where the registers of the accumulators and two chunks' pieces left one block an SM
// (H200, random Llama-3.1-8B-shaped Q4_K file, B=64 decode: 5,179 tok/s without the
// prefetch against 4,102 with it; B=16 keeps it, 2,403 against 2,338). Two blocks an SM are
// asked of the compiler (Q6_K B=16: 2,824 against 2,611 tok/s).
template <int F> struct Mma;
template <> struct Mma<Q8_0> { static constexpr int K_STEP = 64, QUADS = 4; static constexpr bool PREFETCH = true; };
template <> struct Mma<Q4_0> { static constexpr int K_STEP = 128, QUADS = 8; static constexpr bool PREFETCH = true; };
template <> struct Mma<Q4_1> { static constexpr int K_STEP = 128, QUADS = 8; static constexpr bool PREFETCH = true; };
template <> struct Mma<Q4_K> { static constexpr int K_STEP = 128, QUADS = 8; static constexpr bool PREFETCH = true; };
template <> struct Mma<Q6_K> { static constexpr int K_STEP = 256, QUADS = 16; static constexpr bool PREFETCH = false; };
template <> struct Mma<FP8> { static constexpr int K_STEP = 64, QUADS = 4; static constexpr bool PREFETCH = true; };

// Lane t's share of one weight row in one k-step, as loaded: quant words and the raw scale
// bits they need (converted only when used, so the loads of the next k-step stay in flight
// while this one is multiplied).
//   Q8_0: half t % 2 of block 2s + t / 2; q[0] its 16 quants, sc.x its d.
//   FP8: bytes 64 (s % 2) + 16t of block s / 2; q[0] those 16 quants, sc.x the f32 scale.
//   Q4_0, Q4_1: block 4s + t; q[0] its 16 bytes, sc.x its d (and m).
//   Q4_K: piece p = 4 (s % 2) + t of block s / 2 (bytes 16p..16p + 15: group p / 2, half
//     p % 2); q[0] the piece, sc the block's 16 scale bytes, d the group's first sub-block.
//   Q6_K: block s, half t / 2, h = t % 2: q[0] and q[1] the ql bytes 64 half + 16h (+ 32),
//     q[2] the qh bytes 128 + 32 half + 16h; sc the sub-block scales 8 half + h + 2i
//     (i < 4), d the block's d.
struct Piece {
    uint4 q[3];
    uint4 sc;
    u32 d;
};

// Lane t's piece of k-step s of the row whose first block is row_block (of `blocks`). A
// 32-value format's piece past the row's end is its last block again: x is zero there, so
// it adds nothing, and the multiply loop needs no branch (a K-quant's k-steps never pass
// the end, as k is a multiple of 256).
template <int F>
__device__ __forceinline__ Piece load_piece(const unsigned char* w, long long nb, long long row_block,
                                            int blocks, int s, int t) {
    Piece pc;
    if (F == Q8_0) {
        const long long g = row_block + min(2 * s + t / 2, blocks - 1);
        pc.q[0] = load_streamed(w + g * 32 + 16 * (t % 2));
        pc.sc.x = *reinterpret_cast<const u16*>(w + nb * 32 + g * 2);
    } else if (F == FP8) {
        const long long g = row_block + min(s / 2, blocks - 1);
        pc.q[0] = load_streamed(w + g * 128 + 64 * (s % 2) + 16 * t);
        pc.sc.x = *reinterpret_cast<const u32*>(w + nb * 128 + g * 4);
    } else if (F == Q4_0 || F == Q4_1) {
        const long long g = row_block + min(4 * s + t, blocks - 1);
        pc.q[0] = load_streamed(w + g * 16);
        if (F == Q4_0)
            pc.sc.x = *reinterpret_cast<const u16*>(w + nb * 16 + g * 2);
        else
            pc.sc.x = *reinterpret_cast<const u32*>(w + nb * 16 + g * 4);
    } else if (F == Q4_K) {
        const long long g = row_block + s / 2;
        pc.q[0] = load_streamed(w + g * 128 + 16 * (4 * (s % 2) + t));
        pc.sc = *reinterpret_cast<const uint4*>(w + nb * 128 + g * 16);
        pc.d = 2 * ((4 * (s % 2) + t) / 2);
    } else {
        const long long g = row_block + s;
        const int half = t / 2, h = t % 2;
        const unsigned char* q = w + g * 192;
        pc.q[0] = load_streamed(q + 64 * half + 16 * h);
        pc.q[1] = load_streamed(q + 64 * half + 32 + 16 * h);
        pc.q[2] = load_streamed(q + 128 + 32 * half + 16 * h);
        const unsigned char* sc = w + nb * 192 + g * 18;
        pc.sc.x = sc[8 * half + h];
        pc.sc.y = sc[8 * half + h + 2];
        pc.sc.z = sc[8 * half + h + 4];
        pc.sc.w = sc[8 * half + h + 6];
        pc.d = *reinterpret_cast<const u16*>(sc + 16);
    }
    return pc;
}

// f16 pairs (f16x2): the dequantization below works on two values an instruction.
__device__ __forceinline__ u32 hsub2(u32 a, u32 b) {
    u32 d;
    asm("sub.rn.f16x2 %0, %1, %2;" : "=r"(d) : "r"(a), "r"(b));
    return d;
}
__device__ __forceinline__ u32 hmul2(u32 a, u32 b) {
    u32 d;
    asm("mul.rn.f16x2 %0, %1, %2;" : "=r"(d) : "r"(a), "r"(b));
    return d;
}
__device__ __forceinline__ u32 hfma2(u32 a, u32 b, u32 c) {
    u32 d;
    asm("fma.rn.f16x2 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(c));
    return d;
}
// Both halves of the f16 bits h.
__device__ __forceinline__ u32 splat(u32 h) { return (h & 0xffff) * 0x10001u; }
// f16 1024 + v in each half for the integer v < 1024 held in the half's low bits: exact.
#define MAGIC_1024 0x64006400u

// A piece's scales as f16 pairs (both halves alike), taken once a k-step:
//   Q8_0, Q4_0: a = d. Q4_1: a = d, b = m. Q4_K: a, b = d·sc and -dmin·m of the piece's
//   low-nibble sub-block, c, e those of its high-nibble one. Q6_K: a, b, c, e = d·sc of
//   sub-block scale i = j + 2 nib (as Piece orders them). FP8: a = 2^8 · scale, rounded to
//   f16.
// Q8_0's, Q4_0's and Q4_1's are the block's own f16 values, so their values come out as the
// f32 dequantization rounded to f16; Q4_K's and Q6_K's products of two scales are rounded to
// f16 first, a second rounding of at most 2^-11 of the value.
struct Scales {
    u32 a, b, c, e;
};

// `odd` is k-step s % 2: whether a Q4_K piece lies in the second half of its block.
template <int F> __device__ __forceinline__ Scales piece_scales(const Piece& pc, bool odd) {
    Scales r;
    if (F == Q8_0 || F == Q4_0) {
        r.a = splat(pc.sc.x);
    } else if (F == FP8) {
        const float d = __uint_as_float(pc.sc.x) * E4M3_UNSHIFT;
        r.a = pack2<f16>(d, d);
    } else if (F == Q4_1) {
        r.a = splat(pc.sc.x);
        r.b = splat(pc.sc.x >> 16);
    } else if (F == Q4_K) {
        const float d = half_bits(pc.sc.x & 0xffff), dmin = half_bits(pc.sc.x >> 16);
        int sc[2], mn[2];
        scale_min_k4_pair(odd, pc.d, pc.sc, sc, mn);
        r.a = pack2<f16>(d * (float)sc[0], d * (float)sc[0]);
        r.b = pack2<f16>(-dmin * (float)mn[0], -dmin * (float)mn[0]);
        r.c = pack2<f16>(d * (float)sc[1], d * (float)sc[1]);
        r.e = pack2<f16>(-dmin * (float)mn[1], -dmin * (float)mn[1]);
    } else {
        const float d = half_bits(pc.d);
        const u32 w[4] = {pc.sc.x, pc.sc.y, pc.sc.z, pc.sc.w};
        u32 h[4];
#pragma unroll
        for (int i = 0; i < 4; i++) {
            const float v = d * (float)(signed char)(w[i] & 0xff);
            h[i] = pack2<f16>(v, v);
        }
        r.a = h[0];
        r.b = h[1];
        r.c = h[2];
        r.e = h[3];
    }
    return r;
}

// Quad `qi` of a piece as two f16 pairs: values 0, 1 (lo) and 2, 3 (hi). The quants become
// f16 integers exactly (MAGIC_1024 less its offset), then take their scales.
template <int F>
__device__ __forceinline__ void quad_values(const Piece& pc, const Scales& sc, int qi, u32& lo,
                                            u32& hi) {
    if (F == Q8_0) {
        // Signed bytes as 128 + q, beside 0x64 as each half's high byte.
        const u32 word = word_of(pc.q[0], qi) ^ 0x80808080u;
        const u32 offset = 0x64806480u;  // 1024 + 128
        lo = hmul2(hsub2(__byte_perm(word, 0x64646464u, 0x4140), offset), sc.a);
        hi = hmul2(hsub2(__byte_perm(word, 0x64646464u, 0x4342), offset), sc.a);
    } else if (F == FP8) {
        const u32 word = word_of(pc.q[0], qi);
        lo = hmul2(e4m3x2_lo(word), sc.a);
        hi = hmul2(e4m3x2_hi(word), sc.a);
    } else if (F == Q4_0 || F == Q4_1 || F == Q4_K) {
        // Bytes 0, 2, 1, 3, so that a half holds bytes 0 and 1 (then 2 and 3) at 8 bits apart.
        const int nib = qi >> 2;
        const u32 word = __byte_perm(word_of(pc.q[0], qi & 3), 0, 0x3120) >> (4 * nib);
        const u32 q01 = (word & 0x000f000fu) | MAGIC_1024;
        const u32 q23 = ((word >> 8) & 0x000f000fu) | MAGIC_1024;
        if (F == Q4_0) {
            const u32 offset = 0x64086408u;  // 1024 + 8
            lo = hmul2(hsub2(q01, offset), sc.a);
            hi = hmul2(hsub2(q23, offset), sc.a);
        } else {
            const u32 d = F == Q4_1 || nib == 0 ? sc.a : sc.c;
            const u32 m = F == Q4_1 || nib == 0 ? sc.b : sc.e;
            lo = hfma2(hsub2(q01, MAGIC_1024), d, m);
            hi = hfma2(hsub2(q23, MAGIC_1024), d, m);
        }
    } else {
        const int j = qi >> 3, nib = (qi >> 2) & 1, wd = qi & 3;
        const u32 low = (word_of(pc.q[j], wd) >> (4 * nib)) & 0x0f0f0f0fu;
        const u32 high = (word_of(pc.q[2], wd) >> (2 * j + 4 * nib)) & 0x03030303u;
        const u32 q = low | (high << 4);
        const u32 offset = 0x64206420u;  // 1024 + 32
        const int i = j + 2 * nib;
        const u32 d = i == 0 ? sc.a : i == 1 ? sc.b : i == 2 ? sc.c : sc.e;
        lo = hmul2(hsub2(__byte_perm(q, 0x64646464u, 0x4140), offset), d);
        hi = hmul2(hsub2(__byte_perm(q, 0x64646464u, 0x4342), offset), d);
    }
}

// Where in its row (k) the first value of lane t's quad qi of k-step s stands.
template <int F> __device__ __forceinline__ int quad_k(int s, int t, int qi) {
    if (F == Q8_0 || F == FP8) return 64 * s + 16 * t + 4 * qi;
    if (F == Q4_0 || F == Q4_1) return 32 * (4 * s + t) + 16 * (qi >> 2) + 4 * (qi & 3);
    if (F == Q4_K) {
        const int p = 4 * (s % 2) + t;
        return 256 * (s / 2) + 64 * (p / 2) + 32 * (qi >> 2) + 16 * (p % 2) + 4 * (qi & 3);
    }
    const int j = qi >> 3, nib = (qi >> 2) & 1;
    return 256 * s + 128 * (t / 2) + 32 * j + 64 * nib + 16 * (t % 2) + 4 * (qi & 3);
}

// Where, in a chunk row of shared memory, lane t's four values of quad qi of the chunk's
// k-step sl stand: lanes t of one quad side by side, so a fragment load's 32 lanes read
// 8-byte slots of distinct banks.
template <int F> __device__ __forceinline__ int xs_slot(int sl, int qi, int t) {
    return 16 * (sl * Mma<F>::QUADS + qi) + 4 * t;
}

template <int F, typename O, int NT>
__device__ void quant_mma(const f16* x, const unsigned char* w, long long nb, const float* bias,
                          int m, int n, int k, O* out, long long ld, int accumulate, float* partial,
                          int chunks_per_split) {
    constexpr int QUADS = Mma<F>::QUADS, SPC = QMMA_CHUNK / Mma<F>::K_STEP;
    constexpr bool PREFETCH = Mma<F>::PREFETCH && NT <= 4;
    // A Q4_K piece's half of its block is k-step s % 2, which is the unrolled sl % 2.
    static_assert(F != Q4_K || SPC % 2 == 0, "Q4_K chunks hold whole blocks");
    extern __shared__ __align__(16) f16 xs[];  // [2][8 * NT][QMMA_XS_ROW]
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
    const int j0 = blockIdx.x * QMMA_ROWS + 16 * warp, blocks = k / Block<F>::QK;
    const int chunks = (k + QMMA_CHUNK - 1) / QMMA_CHUNK;
    const int c0 = blockIdx.y * chunks_per_split, c1 = min(chunks, c0 + chunks_per_split);
    // The first blocks of weight rows j0 + g (r = 0) and j0 + g + 8 (r = 1) of the warp's
    // m16 tile. Rows past n repeat row n - 1, whose sums are not stored: the multiply loop
    // then needs no branch, where one a row and quad cost a tenth of its instructions.
    long long row_block[2];
#pragma unroll
    for (int r = 0; r < 2; r++) row_block[r] = (long long)min(j0 + g + 8 * r, n - 1) * blocks;
    float acc[NT][4];
#pragma unroll
    for (int nt = 0; nt < NT; nt++)
#pragma unroll
        for (int e = 0; e < 4; e++) acc[nt][e] = 0.0f;
    auto load = [&](int c, Piece (*pcs)[2]) {
#pragma unroll
        for (int sl = 0; sl < SPC; sl++)
#pragma unroll
            for (int r = 0; r < 2; r++)
                pcs[sl][r] = load_piece<F>(w, nb, row_block[r], blocks, c * SPC + sl, t);
    };
    // x's chunk c into buffer b, zeros past m and k. A thread copies the same slot of four
    // values (8 bytes) of every ROW_STEP-th row, so where the slot comes from and goes to is
    // worked out once: per copy, that cost about 60 instructions (ncu, H200).
    constexpr int SLOTS = QMMA_CHUNK / 4, ROW_STEP = 32 * QMMA_WARPS / SLOTS;
    static_assert(32 * QMMA_WARPS % SLOTS == 0 && 8 % ROW_STEP == 0, "whole rows a pass");
    const int slot = threadIdx.x % SLOTS, row0 = threadIdx.x / SLOTS;
    const int slot_sl = (slot >> 2) / QUADS, slot_qi = (slot >> 2) % QUADS, slot_t = slot & 3;
    const int slot_k = quad_k<F>(slot_sl, slot_t, slot_qi);
    f16* slot_dst = xs + row0 * QMMA_XS_ROW + xs_slot<F>(slot_sl, slot_qi, slot_t);
    const f16* slot_src = x + (long long)row0 * k + slot_k;
    auto stage = [&](int c, int b) {
        const bool in_k = c * QMMA_CHUNK + slot_k < k;
#pragma unroll
        for (int i = 0; i < 8 * NT / ROW_STEP; i++) {
            const bool valid = in_k && row0 + ROW_STEP * i < m;
            const f16* src = slot_src + (long long)ROW_STEP * i * k + c * QMMA_CHUNK;
            cp_async8(slot_dst + (b * 8 * NT + ROW_STEP * i) * QMMA_XS_ROW, valid ? src : x, valid);
        }
        cp_async_commit();
    };
    Piece cur[SPC][2], next[SPC][2];
    if (c0 < c1) {
        stage(c0, 0);
        if (PREFETCH) load(c0, cur);
        cp_async_wait<0>();
        __syncthreads();
    }
    for (int c = c0; c < c1; c++) {
        const int b = (c - c0) & 1;
        if (c + 1 < c1) stage(c + 1, b ^ 1);
        if (!PREFETCH)
            load(c, cur);
        else if (c + 1 < c1)
            load(c + 1, next);
        const f16* xb = xs + b * 8 * NT * QMMA_XS_ROW;
#pragma unroll
        for (int sl = 0; sl < SPC; sl++) {
            Scales scales[2];
#pragma unroll
            for (int r = 0; r < 2; r++) scales[r] = piece_scales<F>(cur[sl][r], sl & 1);
#pragma unroll
            for (int qi = 0; qi < QUADS; qi++) {
                // Fragment registers: rows g then g + 8, k pairs lo then hi.
                u32 a[4];
#pragma unroll
                for (int r = 0; r < 2; r++)
                    quad_values<F>(cur[sl][r], scales[r], qi, a[r], a[2 + r]);
                const f16* xq = xb + g * QMMA_XS_ROW + xs_slot<F>(sl, qi, t);
#pragma unroll
                for (int nt = 0; nt < NT; nt++) {
                    const uint2 bf = *reinterpret_cast<const uint2*>(xq + 8 * nt * QMMA_XS_ROW);
                    mma16816<f16>(acc[nt], a, bf.x, bf.y);
                }
            }
        }
        if (PREFETCH) {
#pragma unroll
            for (int sl = 0; sl < SPC; sl++)
#pragma unroll
                for (int r = 0; r < 2; r++) cur[sl][r] = next[sl][r];
        }
        cp_async_wait<0>();
        __syncthreads();
    }
    // acc[nt]: weight rows j0 + g (+ 8 for e >= 2), x rows 8nt + 2t (+ 1 for odd e).
#pragma unroll
    for (int nt = 0; nt < NT; nt++)
#pragma unroll
        for (int e = 0; e < 4; e++) {
            const int row = 8 * nt + 2 * t + (e & 1), j = j0 + g + 8 * (e >> 1);
            if (row >= m || j >= n) continue;
            if (gridDim.y > 1) {
                partial[((long long)blockIdx.y * m + row) * n + j] = acc[nt][e];
                continue;
            }
            float v = acc[nt][e];
            if (bias) v += bias[j];
            O* o = out + row * ld + j;
            if (accumulate) v += to_f32(*o);
            *o = from_f32<O>(v);
        }
}

// The sum of quant_mma's `splits` partial products, in split order.
template <typename O>
__device__ void quant_mma_reduce(const float* partial, int splits, const float* bias, int m,
                                 int n, O* out, long long ld, int accumulate) {
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (long long)m * n) return;
    const int row = (int)(i / n), j = (int)(i % n);
    float v = 0.0f;
    for (int s = 0; s < splits; s++) v += partial[(long long)s * m * n + i];
    if (bias) v += bias[j];
    O* o = out + row * ld + j;
    if (accumulate) v += to_f32(*o);
    *o = from_f32<O>(v);
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

// Blocks first..first + count of w (a buffer of nb blocks) as f16 values: one thread a part
// of a block.
template <int F>
__device__ void quant_dequantize(const unsigned char* w, long long nb, long long first,
                                 long long count, f16* out) {
    const long long t = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    const long long g = t / Block<F>::PARTS;
    const int p = t % Block<F>::PARTS;
    if (g >= count) return;
    float y[Block<F>::VALS];
    dequantize_part<F>(w, nb, first + g, p, y);
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
    extern "C" __global__ void __launch_bounds__(32 * GemvShape<F>::WARPS, GemvShape<F>::MIN)      \
        quant_gemv_##S##_##SO##_m##M(                                                              \
        const f16* x, const unsigned char* w, long long nb, const float* bias, int n, int k,       \
        O* out, long long ld, int accumulate) {                                                    \
        await_previous_kernel();                                                                   \
        quant_gemv<F, O, M>(x, w, nb, bias, n, k, out, ld, accumulate);                            \
    }

#define QUANT_GEMV_Q8(F, S, O, SO)                                                                 \
    extern "C" __global__ void __launch_bounds__(32 * GemvShape<F>::WARPS, GemvShape<F>::MIN)      \
        quant_gemv_q8_##S##_##SO(const f16* x, const unsigned char* w, long long nb,               \
                                 const float* bias, int n, int k, O* out, long long ld,            \
                                 int accumulate) {                                                 \
        quant_gemv_q8<F, O>(x, w, nb, bias, n, k, out, ld, accumulate);                            \
    }

#define QUANT_MMA(F, S, O, SO, NT)                                                                 \
    extern "C" __global__ void __launch_bounds__(32 * QMMA_WARPS, 2) quant_mma_##S##_##SO##_n##NT(   \
        const f16* x, const unsigned char* w, long long nb, const float* bias, int m, int n,       \
        int k, O* out, long long ld, int accumulate, float* partial, int chunks_per_split) {       \
        await_previous_kernel();                                                                   \
        quant_mma<F, O, NT>(x, w, nb, bias, m, n, k, out, ld, accumulate, partial,                 \
                            chunks_per_split);                                                     \
    }

#define QUANT_MMA_ROWS(F, S, O, SO)                                                                \
    QUANT_MMA(F, S, O, SO, 1) QUANT_MMA(F, S, O, SO, 2) QUANT_MMA(F, S, O, SO, 4)                  \
    QUANT_MMA(F, S, O, SO, 8)

#define QUANT(F, S)                                                                                \
    QUANT_GEMV(F, S, f16, f16, 1)                                                                  \
    QUANT_GEMV(F, S, float, f32, 1)                                                                \
    QUANT_MMA_ROWS(F, S, f16, f16)                                                                 \
    QUANT_MMA_ROWS(F, S, float, f32)                                                               \
    extern "C" __global__ void quant_dequantize_##S(const unsigned char* w, long long nb,          \
                                                    long long first, long long count, f16* out) {  \
        await_previous_kernel();                                                                   \
        quant_dequantize<F>(w, nb, first, count, out);                                             \
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
QUANT(FP8, fp8)
extern "C" __global__ void quant_mma_reduce_f16(const float* partial, int splits,
                                                const float* bias, int m, int n, f16* out,
                                                long long ld, int accumulate) {
    await_previous_kernel();
    quant_mma_reduce<f16>(partial, splits, bias, m, n, out, ld, accumulate);
}
extern "C" __global__ void quant_mma_reduce_f32(const float* partial, int splits,
                                                const float* bias, int m, int n, float* out,
                                                long long ld, int accumulate) {
    await_previous_kernel();
    quant_mma_reduce<float>(partial, splits, bias, m, n, out, ld, accumulate);
}
QUANT_GEMV_Q8(Q4_K, q4_k, f16, f16)
QUANT_GEMV_Q8(Q4_K, q4_k, float, f32)
QUANT_GEMV_Q8(Q6_K, q6_k, f16, f16)
QUANT_GEMV_Q8(Q6_K, q6_k, float, f32)
