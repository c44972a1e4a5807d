// Matrix-vector products for decode steps of a few rows: out[r, j] = Σ_k x[r, k] · w[j, k]
// for r < M (1 to 4). One warp per output column j reads w's row j once in 16-byte loads
// (the bytes that bound a decode step) and all M rows of x beside it; f32 accumulation.
// Each output is summed in the same order whatever M is.

template <typename T>
__device__ __forceinline__ void unpack8(const uint4& v, float* f) {
    const T* e = reinterpret_cast<const T*>(&v);
#pragma unroll
    for (int i = 0; i < 8; i++) f[i] = to_f32(e[i]);
}

// Grid: ceil(n / 8) blocks of 8 warps. k is a multiple of 8 and every row 16-byte aligned.
template <typename T, typename O, int M>
__device__ void gemv(const T* x, const T* w, int n, int k, O* out, long long ld) {
    const int lane = threadIdx.x & 31;
    const int j = blockIdx.x * 8 + (threadIdx.x >> 5);
    if (j >= n) return;
    const T* wr = w + (long long)j * k;
    float acc[M];
#pragma unroll
    for (int r = 0; r < M; r++) acc[r] = 0.0f;
#pragma unroll 4
    for (int kk = lane * 8; kk < k; kk += 256) {
        float wf[8];
        unpack8<T>(*reinterpret_cast<const uint4*>(wr + kk), wf);
#pragma unroll
        for (int r = 0; r < M; r++) {
            float xf[8];
            unpack8<T>(*reinterpret_cast<const uint4*>(x + (long long)r * k + kk), xf);
#pragma unroll
            for (int i = 0; i < 8; i++) acc[r] += wf[i] * xf[i];
        }
    }
#pragma unroll
    for (int r = 0; r < M; r++) {
        const float v = warp_sum(acc[r]);
        if (lane == 0) out[r * ld + j] = from_f32<O>(v);
    }
}

#define GEMV(T, S, O, SO, M)                                                                       \
    extern "C" __global__ void __launch_bounds__(256) gemv_##S##_##SO##_m##M(                      \
        const T* x, const T* w, int n, int k, O* out, long long ld) {                              \
        gemv<T, O, M>(x, w, n, k, out, ld);                                                        \
    }

#define GEMV_ALL(T, S, O, SO) GEMV(T, S, O, SO, 1) GEMV(T, S, O, SO, 2) GEMV(T, S, O, SO, 3) GEMV(T, S, O, SO, 4)

GEMV_ALL(f16, f16, f16, f16)
GEMV_ALL(f16, f16, float, f32)
GEMV_ALL(bf16, bf16, bf16, bf16)
GEMV_ALL(bf16, bf16, float, f32)
