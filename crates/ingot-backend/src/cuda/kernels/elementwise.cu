// Row-wise and element-wise ops of a transformer step. Every kernel reads and writes the
// activation type T and computes in f32; rounding to T happens where HF transformers
// rounds (after the normalization, before the norm weight), so bf16 runs track it.

// Rows whose id is outside first..first + rows (the part of the vocabulary `table` holds)
// are left as they are.
template <typename T>
__device__ void embedding(const T* table, const int* ids, int first, int rows, int dim, T* out) {
    const long long row = blockIdx.x;
    const int id = ids[row] - first;
    if (id < 0 || id >= rows) return;
    const T* src = table + (long long)id * dim;
    for (int i = threadIdx.x; i < dim; i += blockDim.x) out[row * dim + i] = src[i];
}

template <typename T>
__device__ void rms_norm(const T* x, const float* w, float eps, int dim, T* out) {
    const long long row = blockIdx.x;
    const T* xr = x + row * dim;
    float ss = 0.0f;
    for (int i = threadIdx.x; i < dim; i += blockDim.x) {
        const float v = to_f32(xr[i]);
        ss += v * v;
    }
    const float inv = rsqrtf(block_sum(ss) / dim + eps);
    for (int i = threadIdx.x; i < dim; i += blockDim.x)
        out[row * dim + i] = from_f32<T>(round_to<T>(to_f32(xr[i]) * inv) * w[i]);
}

// Values of a row each thread of an add_rms_norm block holds in registers: rows of up to
// NORM_VALUES * 1024 elements are read once, with every load of a thread issued together
// (the kernel is bounded to 1024 threads so that they fit its register budget).
#define NORM_VALUES 4

// residual += x (rounded to T, as a T residual stream keeps it), then the norm of the sum.
template <typename T>
__device__ void add_rms_norm(T* residual, const T* x, const float* w, float eps, int dim, T* out) {
    const long long row = blockIdx.x;
    T* r = residual + row * dim;
    const T* xr = x + row * dim;
    T* o = out + row * dim;
    float ss = 0.0f;
    if (dim <= NORM_VALUES * (int)blockDim.x) {
        float v[NORM_VALUES];
#pragma unroll
        for (int u = 0; u < NORM_VALUES; u++) {
            const int i = threadIdx.x + u * blockDim.x;
            v[u] = i < dim ? round_to<T>(to_f32(r[i]) + to_f32(xr[i])) : 0.0f;
        }
#pragma unroll
        for (int u = 0; u < NORM_VALUES; u++) {
            const int i = threadIdx.x + u * blockDim.x;
            if (i < dim) r[i] = from_f32<T>(v[u]);
            ss += v[u] * v[u];
        }
        const float inv = rsqrtf(block_sum(ss) / dim + eps);
#pragma unroll
        for (int u = 0; u < NORM_VALUES; u++) {
            const int i = threadIdx.x + u * blockDim.x;
            if (i < dim) o[i] = from_f32<T>(round_to<T>(v[u] * inv) * w[i]);
        }
        return;
    }
    for (int i = threadIdx.x; i < dim; i += blockDim.x) {
        const float v = round_to<T>(to_f32(r[i]) + to_f32(xr[i]));
        r[i] = from_f32<T>(v);
        ss += v * v;
    }
    // Each thread reads back only what it wrote, so no barrier is needed before the reads.
    const float inv = rsqrtf(block_sum(ss) / dim + eps);
    for (int i = threadIdx.x; i < dim; i += blockDim.x)
        o[i] = from_f32<T>(round_to<T>(to_f32(r[i]) * inv) * w[i]);
}

template <typename T>
__device__ void add_assign(T* acc, const T* x, long long n) {
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n;
         i += (long long)gridDim.x * blockDim.x)
        acc[i] = from_f32<T>(to_f32(acc[i]) + to_f32(x[i]));
}

template <typename T>
__device__ void silu_mul(const T* gate_up, long long rows, int ffn, T* out) {
    const long long n = rows * ffn;
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n;
         i += (long long)gridDim.x * blockDim.x) {
        const long long r = i / ffn;
        const int j = (int)(i - r * ffn);
        const float g = to_f32(gate_up[r * 2 * ffn + j]);
        const float u = to_f32(gate_up[r * 2 * ffn + ffn + j]);
        out[i] = from_f32<T>(g / (1.0f + expf(-g)) * u);
    }
}

// silu_mul for gate/up rows computed from an un-normalized x, the weights of x's RMSNorm
// folded into the gate/up matrix: each value is first scaled by 1 / rms of x's row and
// rounded to T, the value the product of the normalized row would have stored. Grid:
// (ffn / (SILU_VALUES * blockDim.x) rounded up, rows); SILU_VALUES is defined by the host.
template <typename T>
__device__ void silu_mul_normed(const T* gate_up, int ffn, const T* x, int dim, float eps,
                                T* out) {
    const long long row = blockIdx.y;
    const float inv = row_inv_rms(x + row * dim, dim, eps);
    const T* gr = gate_up + row * 2 * ffn;
    const int j0 = blockIdx.x * SILU_VALUES * blockDim.x + threadIdx.x;
    float g[SILU_VALUES], u[SILU_VALUES];
#pragma unroll
    for (int v = 0; v < SILU_VALUES; v++) {
        const int j = j0 + v * blockDim.x;
        g[v] = j < ffn ? to_f32(gr[j]) : 0.0f;
        u[v] = j < ffn ? to_f32(gr[ffn + j]) : 0.0f;
    }
#pragma unroll
    for (int v = 0; v < SILU_VALUES; v++) {
        const int j = j0 + v * blockDim.x;
        const float a = round_to<T>(g[v] * inv), b = round_to<T>(u[v] * inv);
        if (j < ffn) out[row * ffn + j] = from_f32<T>(a / (1.0f + expf(-a)) * b);
    }
}

// One warp per (row, head) over the query and key heads.
template <typename T>
__device__ void qk_norm(T* qkv, int num_heads, int num_kv_heads, int head_dim, int row_len,
                        const float* qw, const float* kw, float eps) {
    const long long row = blockIdx.x;
    const int head = blockIdx.y;
    T* x = qkv + row * row_len + (long long)head * head_dim;
    const float* w = head < num_heads ? qw : kw;
    float ss = 0.0f;
    for (int i = threadIdx.x; i < head_dim; i += 32) {
        const float v = to_f32(x[i]);
        ss += v * v;
    }
    const float inv = rsqrtf(warp_sum(ss) / head_dim + eps);
    for (int i = threadIdx.x; i < head_dim; i += 32)
        x[i] = from_f32<T>(round_to<T>(to_f32(x[i]) * inv) * w[i]);
}

// a·c + b·s with each product and the sum rounded as the CPU reference rounds them (no
// fused multiply-add), so both rope kernels give the same bits whatever the compiler fuses.
__device__ __forceinline__ float rotate(float a, float c, float b, float s) {
    return __fadd_rn(__fmul_rn(a, c), __fmul_rn(b, s));
}

// NeoX rotation of the first `heads` heads of each row (queries then keys) in place.
template <typename T>
__device__ void rope(T* qkv, const int* positions, const float* cos_sin, int heads, int head_dim,
                     int rotary_dim, int row_len) {
    const long long row = blockIdx.x;
    const int half = rotary_dim / 2;
    const float* cs = cos_sin + (long long)positions[row] * rotary_dim;
    for (int i = threadIdx.x; i < heads * half; i += blockDim.x) {
        const int h = i / half, j = i - h * half;
        T* x = qkv + row * row_len + (long long)h * head_dim;
        const float a = to_f32(x[j]), b = to_f32(x[j + half]);
        const float c = cs[j], s = cs[half + j];
        x[j] = from_f32<T>(rotate(a, c, -b, s));
        x[j + half] = from_f32<T>(rotate(b, c, a, s));
    }
}

// Keys and values of each token to its cache slot; a negative slot keeps nothing.
template <typename T, typename C>
__device__ void kv_write(const T* qkv, const int* slots, int q_len, int kv_len, int row_len,
                         C* k_cache, C* v_cache) {
    const long long row = blockIdx.x;
    const long long slot = slots[row];
    if (slot < 0) return;
    const T* k = qkv + row * row_len + q_len;
    for (int i = threadIdx.x; i < kv_len; i += blockDim.x) {
        k_cache[slot * kv_len + i] = from_f32<C>(to_f32(k[i]));
        v_cache[slot * kv_len + i] = from_f32<C>(to_f32(k[kv_len + i]));
    }
}

// rope then kv_write for one row per block: the rotated keys and the values to the cache.
// The kernel for prefill rows, where the rows give the parallelism. With `norm_x`, the qkv
// row is the product of an un-normalized row of norm_x (dim wide), the weights of its
// RMSNorm folded into the QKV matrix: it is first scaled by 1 / rms of that row and rounded
// to T, the row the normalized product would have stored.
template <typename T, typename C>
__device__ void rope_kv_write(T* qkv, const int* positions, const float* cos_sin, int num_heads,
                              int num_kv_heads, int head_dim, int rotary_dim, const int* slots,
                              C* k_cache, C* v_cache, const T* norm_x, int dim, float eps) {
    const int row_len = (num_heads + 2 * num_kv_heads) * head_dim;
    if (norm_x) {
        const long long row = blockIdx.x;
        const float inv = row_inv_rms(norm_x + row * dim, dim, eps);
        T* x = qkv + row * row_len;
        for (int i = threadIdx.x; i < row_len; i += blockDim.x)
            x[i] = from_f32<T>(to_f32(x[i]) * inv);
        __syncthreads();
    }
    rope<T>(qkv, positions, cos_sin, num_heads + num_kv_heads, head_dim, rotary_dim, row_len);
    __syncthreads();
    kv_write<T, C>(qkv, slots, num_heads * head_dim, num_kv_heads * head_dim, row_len, k_cache,
                   v_cache);
}

// The same for decode rows, one block per (row, head) of the row's query, key and value heads
// (grid.y), one thread per element of the head: a query head is rotated in place, a key head
// rotated in place and written to its cache slot, a value head written to its slot. Each
// thread's loads are issued together, so a decode row costs one round of memory latency
// rather than one per element a thread of the per-row kernel walks (B=1 at Llama-8B shapes
// on the H100: 9.2 µs a layer per row, cold, in the per-row kernel). `norm_x` as for
// rope_kv_write. With `qw` (and `kw`), each query (key) head first goes through qk_norm's
// per-head RMSNorm with those weights, summed as qk_norm sums it, so the bits are those of
// qk_norm then this kernel, one launch fewer.
template <typename T, typename C>
__device__ void rope_kv_write_heads(T* qkv, const int* positions, const float* cos_sin, int num_heads,
                              int num_kv_heads, int head_dim, int rotary_dim, const int* slots,
                              C* k_cache, C* v_cache, const T* norm_x, int dim, float eps,
                              const float* qw, const float* kw, float qk_eps) {
    __shared__ float head_inv;
    const long long row = blockIdx.x;
    const int h = blockIdx.y, i = threadIdx.x;
    const int kv_len = num_kv_heads * head_dim;
    T* x = qkv + row * (num_heads * head_dim + 2 * kv_len) + (long long)h * head_dim;
    const bool rotated = h < num_heads + num_kv_heads && i < rotary_dim;
    const float inv = norm_x ? row_inv_rms(norm_x + row * dim, dim, eps) : 1.0f;
    const float* qk_w = h < num_heads ? qw : h < num_heads + num_kv_heads ? kw : nullptr;
    // Element e of the head as the product leaves it (normed where norm_x).
    auto scaled = [&](int e) { return round_to<T>(to_f32(x[e]) * inv); };
    if (qk_w) {
        if (i < 32) {
            float ss = 0.0f;
            for (int e = i; e < head_dim; e += 32) ss += scaled(e) * scaled(e);
            const float sum = warp_sum(ss);
            if (i == 0) head_inv = rsqrtf(sum / head_dim + qk_eps);
        }
        __syncthreads();
    }
    // Element e of the head as the ops before the rotation leave it.
    auto input = [&](int e) {
        const float u = scaled(e);
        return qk_w ? round_to<T>(round_to<T>(u * head_inv) * qk_w[e]) : u;
    };
    float v = 0.0f;
    if (i < head_dim) {
        v = input(i);
        if (rotated) {
            // The pair (j, j + half): x[j] = a c - b s, x[j + half] = b c + a s.
            const int half = rotary_dim / 2, j = i < half ? i : i - half;
            const float* cs = cos_sin + (long long)positions[row] * rotary_dim;
            const float c = cs[j], s = cs[half + j];
            const float other = input(i < half ? i + half : i - half);
            v = rotate(v, c, i < half ? -other : other, s);
        }
    }
    // Every thread has read its pair before any rotated value is stored.
    __syncthreads();
    if (i >= head_dim) return;
    if (rotated || norm_x || qk_w) x[i] = from_f32<T>(v);
    const long long slot = slots[row];
    if (h < num_heads || slot < 0) return;
    // The cache takes the value as the row holds it (rounded to T).
    const float held = to_f32(from_f32<T>(v));
    if (h < num_heads + num_kv_heads)
        k_cache[slot * kv_len + (long long)(h - num_heads) * head_dim + i] = from_f32<C>(held);
    else
        v_cache[slot * kv_len + (long long)(h - num_heads - num_kv_heads) * head_dim + i] =
            from_f32<C>(held);
}

template <typename T>
__device__ void gather_rows(const T* x, const int* indices, int dim, T* out) {
    const long long row = blockIdx.x;
    const T* src = x + (long long)indices[row] * dim;
    for (int i = threadIdx.x; i < dim; i += blockDim.x) out[row * dim + i] = src[i];
}

// out[s, j] = sum of x[r, j] over rows r in qsl[s]..qsl[s+1], in row order, in f32.
template <typename T>
__device__ void segment_sum(const T* x, const int* qsl, int dim, float* out) {
    const long long s = blockIdx.x;
    const int begin = qsl[s], end = qsl[s + 1];
    for (int j = threadIdx.x; j < dim; j += blockDim.x) {
        float acc = 0.0f;
        for (int r = begin; r < end; ++r) acc += to_f32(x[(long long)r * dim + j]);
        out[s * dim + j] = acc;
    }
}

// out[i, j] += bias[j] over columns [0, n) of rows `ld` apart (the matmul's bias when no
// cuBLASLt epilogue takes it).
template <typename T>
__device__ void bias_add(T* out, const float* bias, int n, long long ld) {
    const long long row = blockIdx.x;
    for (int j = threadIdx.x; j < n; j += blockDim.x)
        out[row * ld + j] = from_f32<T>(to_f32(out[row * ld + j]) + bias[j]);
}

#define ELEMENTWISE(T, S)                                                                          \
    extern "C" __global__ void embedding_##S(const T* t, const int* ids, int first, int rows,     \
                                             int dim, T* out) {                                    \
        await_previous_kernel();                                                                   \
        embedding<T>(t, ids, first, rows, dim, out);                                               \
    }                                                                                              \
    extern "C" __global__ void rms_norm_##S(const T* x, const float* w, float eps, int dim,        \
                                            T* out) {                                              \
        await_previous_kernel();                                                                   \
        rms_norm<T>(x, w, eps, dim, out);                                                          \
    }                                                                                              \
    extern "C" __global__ void __launch_bounds__(1024)                                            \
        add_rms_norm_##S(T* r, const T* x, const float* w, float eps, int dim, T* out) {           \
        await_previous_kernel();                                                                   \
        add_rms_norm<T>(r, x, w, eps, dim, out);                                                   \
    }                                                                                              \
    extern "C" __global__ void add_assign_##S(T* acc, const T* x, long long n) {                   \
        await_previous_kernel();                                                                   \
        add_assign<T>(acc, x, n);                                                                  \
    }                                                                                              \
    extern "C" __global__ void silu_mul_##S(const T* gu, long long rows, int ffn, T* out) {        \
        await_previous_kernel();                                                                   \
        silu_mul<T>(gu, rows, ffn, out);                                                           \
    }                                                                                              \
    extern "C" __global__ void silu_mul_normed_##S(const T* gu, int ffn, const T* x, int dim,      \
                                                   float eps, T* out) {                            \
        await_previous_kernel();                                                                   \
        silu_mul_normed<T>(gu, ffn, x, dim, eps, out);                                             \
    }                                                                                              \
    extern "C" __global__ void qk_norm_##S(T* qkv, int nh, int nkv, int hd, int rl,                \
                                           const float* qw, const float* kw, float eps) {          \
        await_previous_kernel();                                                                   \
        qk_norm<T>(qkv, nh, nkv, hd, rl, qw, kw, eps);                                             \
    }                                                                                              \
    extern "C" __global__ void rope_##S(T* qkv, const int* pos, const float* cs, int heads,        \
                                        int hd, int rd, int rl) {                                  \
        await_previous_kernel();                                                                   \
        rope<T>(qkv, pos, cs, heads, hd, rd, rl);                                                  \
    }                                                                                              \
    extern "C" __global__ void gather_rows_##S(const T* x, const int* idx, int dim, T* out) {      \
        await_previous_kernel();                                                                   \
        gather_rows<T>(x, idx, dim, out);                                                          \
    }                                                                                              \
    extern "C" __global__ void segment_sum_##S(const T* x, const int* qsl, int dim, float* out) {  \
        await_previous_kernel();                                                                   \
        segment_sum<T>(x, qsl, dim, out);                                                          \
    }                                                                                              \
    extern "C" __global__ void bias_add_##S(T* out, const float* bias, int n, long long ld) {      \
        await_previous_kernel();                                                                   \
        bias_add<T>(out, bias, n, ld);                                                             \
    }

#define KV_WRITE(T, S, C, SC)                                                                      \
    extern "C" __global__ void kv_write_##S##_##SC(const T* qkv, const int* slots, int q_len,      \
                                                   int kv_len, int rl, C* kc, C* vc) {             \
        await_previous_kernel();                                                                   \
        kv_write<T, C>(qkv, slots, q_len, kv_len, rl, kc, vc);                                     \
    }                                                                                              \
    extern "C" __global__ void rope_kv_write_##S##_##SC(                                           \
        T* qkv, const int* pos, const float* cs, int nh, int nkv, int hd, int rd,                  \
        const int* slots, C* kc, C* vc, const T* nx, int dim, float eps) {                         \
        await_previous_kernel();                                                                   \
        rope_kv_write<T, C>(qkv, pos, cs, nh, nkv, hd, rd, slots, kc, vc, nx, dim, eps);           \
    }                                                                                              \
    extern "C" __global__ void rope_kv_write_heads_##S##_##SC(                                     \
        T* qkv, const int* pos, const float* cs, int nh, int nkv, int hd, int rd,                  \
        const int* slots, C* kc, C* vc, const T* nx, int dim, float eps, const float* qw,          \
        const float* kw, float qk_eps) {                                                           \
        await_previous_kernel();                                                                   \
        rope_kv_write_heads<T, C>(qkv, pos, cs, nh, nkv, hd, rd, slots, kc, vc, nx, dim, eps, qw,  \
                                  kw, qk_eps);                                                     \
    }

ELEMENTWISE(float, f32)
ELEMENTWISE(f16, f16)
ELEMENTWISE(bf16, bf16)
KV_WRITE(float, f32, float, f32)
KV_WRITE(float, f32, f16, f16)
KV_WRITE(float, f32, bf16, bf16)
KV_WRITE(f16, f16, float, f32)
KV_WRITE(f16, f16, f16, f16)
KV_WRITE(f16, f16, bf16, bf16)
KV_WRITE(bf16, bf16, float, f32)
KV_WRITE(bf16, bf16, f16, f16)
KV_WRITE(bf16, bf16, bf16, bf16)
