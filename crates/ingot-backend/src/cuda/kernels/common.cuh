// Shared by every kernel source: element types and their f32 conversions, warp and block
// reductions. No CUDA headers are included, so NVRTC needs no include path: bf16 and f16
// are kept as raw bits and converted with PTX instructions (sm_80 and later).

typedef unsigned short u16;
typedef unsigned int u32;

struct bf16 { u16 bits; };
struct f16 { u16 bits; };

__device__ __forceinline__ float to_f32(float x) { return x; }
__device__ __forceinline__ float to_f32(bf16 x) { return __uint_as_float(((u32)x.bits) << 16); }
__device__ __forceinline__ float to_f32(f16 x) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(x.bits));
    return f;
}

template <typename T> __device__ __forceinline__ T from_f32(float x);
template <> __device__ __forceinline__ float from_f32<float>(float x) { return x; }
template <> __device__ __forceinline__ bf16 from_f32<bf16>(float x) {
    bf16 r;
    asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(r.bits) : "f"(x));
    return r;
}
template <> __device__ __forceinline__ f16 from_f32<f16>(float x) {
    f16 r;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(r.bits) : "f"(x));
    return r;
}

// The 8 16-bit elements of a 16-byte vector, as f32.
template <typename T>
__device__ __forceinline__ void unpack8(const uint4& v, float* f) {
    const T* e = reinterpret_cast<const T*>(&v);
#pragma unroll
    for (int i = 0; i < 8; i++) f[i] = to_f32(e[i]);
}

// Rounds through T and back: the value a store to a T buffer keeps.
template <typename T> __device__ __forceinline__ float round_to(float x) {
    return to_f32(from_f32<T>(x));
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

// The larger value across the warp, the lower index on ties, in every lane.
__device__ __forceinline__ void warp_argmax(float& best, int& idx) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        const float v = __shfl_xor_sync(0xffffffffu, best, o);
        const int j = __shfl_xor_sync(0xffffffffu, idx, o);
        if (v > best || (v == best && j < idx)) {
            best = v;
            idx = j;
        }
    }
}

// Sum over the block (blockDim.x a multiple of 32, at most 1024), returned to every
// thread. The order of additions depends only on blockDim, so results are reproducible.
__device__ __forceinline__ float block_sum(float v) {
    __shared__ float partial[32];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    v = warp_sum(v);
    __syncthreads();
    if (lane == 0) partial[warp] = v;
    __syncthreads();
    const int warps = blockDim.x >> 5;
    float t = lane < warps ? partial[lane] : 0.0f;
    return warp_sum(t);
}

// 1 / rms(x) of a row of `dim` elements (an RMSNorm's scale), returned to every thread of
// the block (blockDim.x as for block_sum). 16-byte loads where the row allows, so a thread's
// loads are few and issued together.
template <typename T>
__device__ __forceinline__ float row_inv_rms(const T* x, int dim, float eps) {
    constexpr int V = 16 / sizeof(T);
    float ss = 0.0f;
    if (dim % V == 0 && ((unsigned long long)x & 15) == 0) {
#pragma unroll 4
        for (int i = threadIdx.x * V; i < dim; i += blockDim.x * V) {
            const uint4 r = *reinterpret_cast<const uint4*>(x + i);
            const T* e = reinterpret_cast<const T*>(&r);
#pragma unroll
            for (int v = 0; v < V; v++) ss += to_f32(e[v]) * to_f32(e[v]);
        }
    } else {
        for (int i = threadIdx.x; i < dim; i += blockDim.x) ss += to_f32(x[i]) * to_f32(x[i]);
    }
    return rsqrtf(block_sum(ss) / dim + eps);
}

// Sequence owning flattened token row `token`: the largest s with query_start_loc[s] <= token.
__device__ __forceinline__ int seq_of_token(const int* query_start_loc, int num_seqs, int token) {
    int lo = 0, hi = num_seqs - 1;
    while (lo < hi) {
        const int mid = (lo + hi + 1) >> 1;
        if (query_start_loc[mid] <= token) lo = mid; else hi = mid - 1;
    }
    return lo;
}

// The shared-memory address of generic pointer p (for cp.async, ldmatrix, TMA, mbarriers).
__device__ __forceinline__ u32 smem_address(const void* p) {
    u32 a;
    asm("{ .reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t; }" : "=r"(a) : "l"(p));
    return a;
}

// 16 bytes from global to shared memory without passing through registers; zeros when
// `valid` is false (nothing is read then).
__device__ __forceinline__ void cp_async16(void* smem, const void* gmem, bool valid) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(smem_address(smem)),
                 "l"(gmem), "r"(valid ? 16 : 0));
}
// 8 bytes, through L1 (cp.async takes only 16 bytes past it), for copies that cannot be
// whole 16-byte pieces.
__device__ __forceinline__ void cp_async8(void* smem, const void* gmem, bool valid) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 8, %2;" ::"r"(smem_address(smem)),
                 "l"(gmem), "r"(valid ? 8 : 0));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;"); }
template <int N> __device__ __forceinline__ void cp_async_wait() {
    asm volatile("cp.async.wait_group %0;" ::"n"(N));
}

// Tensor-core helpers (mma.sync, sm_80 and later), shared by attention and the products.
template <typename T> __device__ __forceinline__ u32 pack2(float lo, float hi);
template <> __device__ __forceinline__ u32 pack2<bf16>(float lo, float hi) {
    u32 r;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
}
template <> __device__ __forceinline__ u32 pack2<f16>(float lo, float hi) {
    u32 r;
    asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
}

// The two elements pack2 stored, as f32.
template <typename T> __device__ __forceinline__ float2 unpack2(u32 v);
template <> __device__ __forceinline__ float2 unpack2<bf16>(u32 v) {
    return make_float2(__uint_as_float(v << 16), __uint_as_float(v & 0xffff0000u));
}
template <> __device__ __forceinline__ float2 unpack2<f16>(u32 v) {
    f16 lo, hi;
    lo.bits = (u16)(v & 0xffffu);
    hi.bits = (u16)(v >> 16);
    return make_float2(to_f32(lo), to_f32(hi));
}

// c += a (16x16, row) * b (16x8, col), f32 accumulators.
template <typename T> __device__ __forceinline__ void mma16816(float* c, const u32* a, u32 b0, u32 b1);
template <> __device__ __forceinline__ void mma16816<bf16>(float* c, const u32* a, u32 b0, u32 b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
template <> __device__ __forceinline__ void mma16816<f16>(float* c, const u32* a, u32 b0, u32 b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

#define NEG_INF __int_as_float(0xff800000)

// Programmatic dependent launch (sm_90 and later): the backend lets each kernel start while
// the kernel before it in the stream finishes, so a launch's latency hides behind that
// kernel's last blocks. Every kernel calls this before it reads or writes anything another
// kernel touches: it returns once the previous kernel has finished and its writes are
// visible (each kernel waits for the one before, so for all before), then lets the next
// kernel launch: its blocks take free slots and wait here in turn. Letting it launch at the
// start measured better than after a GEMV's main loop (H100, Llama-8B shapes, B=1 decode
// 172.1 against 171.4 tok/s). Earlier architectures serialize kernels in the stream; there
// this is empty.
__device__ __forceinline__ void await_previous_kernel() {
#if __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

// 16 bytes of weights, read once: loaded past L1 (`L1::no_allocate`), so that the input
// rows every block of the product reads stay there instead of being pushed out by the
// weight stream (H100, Llama-8B shapes, same machine, three runs each: B=1 decode 174.7 /
// 174.4 / 174.8 tok/s against 172.2 / 172.8 / 172.7 with cached loads).
__device__ __forceinline__ uint4 load_streamed(const void* p) {
    uint4 v;
    asm("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
        : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
        : "l"(p));
    return v;
}

// 16 bytes of an input that many warps read: through the read-only path, cached in L1. The
// plain load of a uint4 that unpack8 takes apart was split by the compiler into eight
// 2-byte loads (ncu, H200, moe_row_gate_up).
__device__ __forceinline__ uint4 load_input(const void* p) {
    uint4 v;
    asm("ld.global.nc.v4.u32 {%0, %1, %2, %3}, [%4];"
        : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
        : "l"(p));
    return v;
}
