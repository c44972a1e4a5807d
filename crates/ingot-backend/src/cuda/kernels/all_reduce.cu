// The one-shot all-reduce of a tensor-parallel group over peer memory (`peer_all_reduce.rs`):
// every rank reads every rank's buffer over NVLink, sums each element in rank order in f32,
// and writes the sum into its own buffer in place. Blocks of the same index on all ranks
// meet twice through flags in each other's signal memory: once the buffers are ready
// (carrying each rank's buffer address, so no staging copy is needed) and once all of them
// have been read (so no rank overwrites a buffer a peer still reads). Each rank spins only
// on its own memory; its peers' stores come to it.

// Layout of a rank's signal memory; AR_MAX_BLOCKS and AR_MAX_RANKS come from the host.
struct ArSignal {
    u32 start[AR_MAX_BLOCKS][AR_MAX_RANKS];
    u32 end[AR_MAX_BLOCKS][AR_MAX_RANKS];
    // Calls made so far by each block of this rank: the flag of the next call.
    u32 calls[AR_MAX_BLOCKS];
    unsigned long long source[AR_MAX_BLOCKS][AR_MAX_RANKS];
};

// Every rank's signal memory, in rank order (by value as a kernel parameter).
struct ArPeers {
    ArSignal* signal[AR_MAX_RANKS];
};

__device__ __forceinline__ void store_release_sys(u32* p, u32 v) {
    asm volatile("st.release.sys.global.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}

__device__ __forceinline__ u32 load_acquire_sys(const u32* p) {
    u32 v;
    asm volatile("ld.acquire.sys.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
    return v;
}

// Waits for `flag` in `slot`; false once the group's abort flag (host memory, read
// over PCIe, so only every 1024 polls) is set.
__device__ __forceinline__ bool await_flag(const u32* slot, u32 flag, const volatile u32* abort) {
    for (u32 polls = 1; load_acquire_sys(slot) != flag; polls++)
        if ((polls & 1023) == 0 && *abort != 0) return false;
    return true;
}

template <typename T>
__device__ void one_shot_all_reduce(ArPeers peers, int rank, int world, T* buf,
                                    long long vectors, const volatile u32* abort) {
    constexpr int E = 16 / sizeof(T);
    __shared__ const uint4* sources[AR_MAX_RANKS];
    __shared__ u32 flag_s;
    __shared__ int stopped;
    ArSignal* self = peers.signal[rank];
    const int b = blockIdx.x;
    if (threadIdx.x == 0) {
        flag_s = self->calls[b] + 1;
        self->calls[b] = flag_s;
        stopped = 0;
    }
    __syncthreads();
    const u32 flag = flag_s;
    if (threadIdx.x < world) {
        const int peer = threadIdx.x;
        ArSignal* theirs = peers.signal[peer];
        asm volatile("st.relaxed.sys.global.u64 [%0], %1;" ::"l"(&theirs->source[b][rank]),
                     "l"((unsigned long long)buf)
                     : "memory");
        store_release_sys(&theirs->start[b][rank], flag);
        if (!await_flag(&self->start[b][peer], flag, abort)) stopped = 1;
        unsigned long long p;
        asm volatile("ld.relaxed.sys.global.u64 %0, [%1];"
                     : "=l"(p)
                     : "l"(&self->source[b][peer])
                     : "memory");
        sources[peer] = reinterpret_cast<const uint4*>(p);
    }
    __syncthreads();
    if (stopped) return;
    // The same vectors on every rank for block b: b's meeting at the end covers them.
    const long long stride = (long long)gridDim.x * blockDim.x;
    const long long first = (long long)b * blockDim.x + threadIdx.x;
    uint4 sum[AR_VECTORS];
#pragma unroll
    for (int k = 0; k < AR_VECTORS; k++) {
        const long long v = first + k * stride;
        if (v >= vectors) break;
        float acc[E];
#pragma unroll
        for (int e = 0; e < E; e++) acc[e] = 0.f;
#pragma unroll
        for (int r = 0; r < AR_MAX_RANKS; r++) {
            if (r >= world) break;
            const uint4 x = __ldcg(sources[r] + v);
            const T* xs = reinterpret_cast<const T*>(&x);
#pragma unroll
            for (int e = 0; e < E; e++) acc[e] += to_f32(xs[e]);
        }
        T* out = reinterpret_cast<T*>(&sum[k]);
#pragma unroll
        for (int e = 0; e < E; e++) out[e] = from_f32<T>(acc[e]);
    }
    __syncthreads();
    if (threadIdx.x < world) {
        const int peer = threadIdx.x;
        store_release_sys(&peers.signal[peer]->end[b][rank], flag);
        if (!await_flag(&self->end[b][peer], flag, abort)) stopped = 1;
    }
    __syncthreads();
    if (stopped) return;
    uint4* mine = reinterpret_cast<uint4*>(buf);
#pragma unroll
    for (int k = 0; k < AR_VECTORS; k++) {
        const long long v = first + k * stride;
        if (v >= vectors) break;
        mine[v] = sum[k];
    }
}

#define ALL_REDUCE(T, S)                                                                           \
    extern "C" __global__ void __launch_bounds__(AR_THREADS)                                      \
        all_reduce_one_shot_##S(ArPeers peers, int rank, int world, T* buf, long long vectors,     \
                                const volatile u32* abort) {                                       \
        await_previous_kernel();                                                                   \
        one_shot_all_reduce<T>(peers, rank, world, buf, vectors, abort);                           \
    }

ALL_REDUCE(float, f32)
ALL_REDUCE(f16, f16)
ALL_REDUCE(bf16, bf16)
