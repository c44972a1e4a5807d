// Matrix-vector products for decode steps of a few rows: out[r, j] = Σ_k x[r, k] · w[j, k]
// (+ bias[j], f32, added before the one rounding to O) for r < M (1 to 4), optionally with
// x = silu(gate) * up computed as it is read (the MLP's down projection), or with x taken
// through an RMSNorm whose weights are folded into w (NORM: the row's sum of squares is
// gathered from the same reads, and the sums are scaled by 1 / rms(x) at the end), and
// optionally added to what `out` holds (the residual connection). A block of 256
// threads owns COLS output columns: every thread reads 16 bytes of each of the COLS weight
// rows per step along k (so many independent loads are in flight), the partial sums meet
// in shared memory. Weights, the bytes that bound a
// decode step, are read once; f32 accumulation in an order that does not depend on M.
// One row (a single decode) takes two columns per block: more, smaller blocks even out the
// last wave (H100, Llama-8B shapes, same machine: B=1 decode 164.8 tok/s against 162.7 with
// four columns and 161.3 with one). More rows keep four, as each block also reads x. The
// down projection with SiLU takes SILU_COLS_M1 columns at one row: each of its blocks
// recomputes silu(gate) * up for the whole row, so fewer, wider blocks do less of that
// (same machine, B=1: 165.9 tok/s with two, 169.2 with four, 169.9 with eight).

#define THREADS 256
#define SILU_COLS_M1 8

// 8 elements of row r of the input at column kk. With SILU the input holds rows of
// [gate | up], 2k wide, and the value is silu(gate) * up rounded to T, as silu_mul writes it.
template <typename T, bool SILU>
__device__ __forceinline__ void load_x(const T* x, int k, int r, int kk, float* xf) {
    if (SILU) {
        float g[8], u[8];
        const T* row = x + (long long)r * 2 * k + kk;
        unpack8<T>(*reinterpret_cast<const uint4*>(row), g);
        unpack8<T>(*reinterpret_cast<const uint4*>(row + k), u);
#pragma unroll
        for (int i = 0; i < 8; i++) xf[i] = round_to<T>(g[i] / (1.0f + expf(-g[i])) * u[i]);
    } else {
        unpack8<T>(*reinterpret_cast<const uint4*>(x + (long long)r * k + kk), xf);
    }
}

// Grid: ceil(n / COLS) blocks. k is a multiple of 8 and x and w are 16-byte aligned; bias
// may be null; `accumulate` adds the result to `out`; `eps` is the folded norm's.
template <typename T, typename O, int M, bool SILU, bool NORM, int COLS>
__device__ void gemv(const T* x, const T* w, const float* bias, int n, int k, O* out,
                     long long ld, int accumulate, float eps) {
    __shared__ float partial[THREADS / 32][M][COLS];
    __shared__ float squares[THREADS / 32][M];
    float ss[M];
    const int j0 = blockIdx.x * COLS;
    const int rows = min(COLS, n - j0);
    float acc[M][COLS];
#pragma unroll
    for (int r = 0; r < M; r++)
#pragma unroll
        for (int c = 0; c < COLS; c++) acc[r][c] = 0.0f;
#pragma unroll
    for (int r = 0; r < M; r++) ss[r] = 0.0f;
    // Four steps along k unrolled, so that their loads are issued together (B=1 decode, same
    // machine: 175.9 / 175.5 / 175.2 tok/s against 173.3 / 174.6 / 173.2 with two).
#pragma unroll 4
    for (int kk = threadIdx.x * 8; kk < k; kk += THREADS * 8) {
        uint4 wv[COLS];
#pragma unroll
        for (int c = 0; c < COLS; c++)
            wv[c] = c < rows ? load_streamed(w + (long long)(j0 + c) * k + kk)
                             : make_uint4(0, 0, 0, 0);
#pragma unroll
        for (int r = 0; r < M; r++) {
            float xf[8];
            load_x<T, SILU>(x, k, r, kk, xf);
            if (NORM) {
#pragma unroll
                for (int i = 0; i < 8; i++) ss[r] += xf[i] * xf[i];
            }
#pragma unroll
            for (int c = 0; c < COLS; c++) {
                float wf[8];
                unpack8<T>(wv[c], wf);
#pragma unroll
                for (int i = 0; i < 8; i++) acc[r][c] += wf[i] * xf[i];
            }
        }
    }
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
#pragma unroll
    for (int r = 0; r < M; r++)
#pragma unroll
        for (int c = 0; c < COLS; c++) {
            const float v = warp_sum(acc[r][c]);
            if (lane == 0) partial[warp][r][c] = v;
        }
    if (NORM) {
#pragma unroll
        for (int r = 0; r < M; r++) {
            const float v = warp_sum(ss[r]);
            if (lane == 0) squares[warp][r] = v;
        }
    }
    __syncthreads();
    if (threadIdx.x < M * COLS) {
        const int r = threadIdx.x / COLS, c = threadIdx.x % COLS;
        if (c < rows) {
            float v = 0.0f;
#pragma unroll
            for (int q = 0; q < THREADS / 32; q++) v += partial[q][r][c];
            if (NORM) {
                float sum = 0.0f;
#pragma unroll
                for (int q = 0; q < THREADS / 32; q++) sum += squares[q][r];
                v *= rsqrtf(sum / k + eps);
            }
            if (bias) v += bias[j0 + c];
            O* o = out + r * ld + j0 + c;
            if (accumulate) v += to_f32(*o);
            *o = from_f32<O>(v);
        }
    }
}

#define GEMV_KERNEL(NAME, T, S, O, SO, M, SILU, NORM, COLS)                                      \
    extern "C" __global__ void __launch_bounds__(THREADS) NAME##_##S##_##SO##_m##M(                \
        const T* x, const T* w, const float* bias, int n, int k, O* out, long long ld,           \
        int accumulate, float eps) {                                                               \
        await_previous_kernel();                                                                   \
        gemv<T, O, M, SILU, NORM, COLS>(x, w, bias, n, k, out, ld, accumulate, eps);               \
    }

#define GEMV(T, S, O, SO, M)                                                                       \
    GEMV_KERNEL(gemv, T, S, O, SO, M, false, false, (M == 1 ? 2 : 4))                              \
    GEMV_KERNEL(gemv_norm, T, S, O, SO, M, false, true, (M == 1 ? 2 : 4))                          \
    GEMV_KERNEL(gemv_silu, T, S, O, SO, M, true, false, (M == 1 ? SILU_COLS_M1 : 4))

#define GEMV_ALL(T, S, O, SO) GEMV(T, S, O, SO, 1) GEMV(T, S, O, SO, 2) GEMV(T, S, O, SO, 3) GEMV(T, S, O, SO, 4)

GEMV_ALL(f16, f16, f16, f16)
GEMV_ALL(f16, f16, float, f32)
GEMV_ALL(bf16, bf16, bf16, bf16)
GEMV_ALL(bf16, bf16, float, f32)
