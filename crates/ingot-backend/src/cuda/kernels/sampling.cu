// Token selection on the device, so a step sends back token ids instead of logits.

// A row is read by one block; to keep enough loads in flight from one SM, each thread
// issues ROW_UNROLL loads before using them.
#define ROW_UNROLL 16

// Calls f(i, x[i], valid) for the row's elements, each thread in increasing i. Every thread
// of the block makes the same calls (`valid` false past the end), so f may use warp
// collectives.
template <typename F>
__device__ __forceinline__ void for_row(const float* x, int vocab, F f) {
    for (int base = 0; base < vocab; base += blockDim.x * ROW_UNROLL) {
        float v[ROW_UNROLL];
#pragma unroll
        for (int u = 0; u < ROW_UNROLL; ++u) {
            const int i = base + u * blockDim.x + threadIdx.x;
            v[u] = i < vocab ? x[i] : 0.0f;
        }
#pragma unroll
        for (int u = 0; u < ROW_UNROLL; ++u) {
            const int i = base + u * blockDim.x + threadIdx.x;
            f(i, v[u], i < vocab);
        }
    }
}

// The row's largest value and its first index (torch.argmax's choice), in every thread.
__device__ __forceinline__ void block_argmax(const float* x, int vocab, float& best, int& idx) {
    __shared__ float s_val[32];
    __shared__ int s_idx[32];
    best = NEG_INF;
    idx = 0x7fffffff;
    for_row(x, vocab, [&](int i, float v, bool valid) {
        if (valid && (v > best || idx == 0x7fffffff)) {
            best = v;
            idx = i;
        }
    });
    warp_argmax(best, idx);
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    __syncthreads();
    if (lane == 0) {
        s_val[warp] = best;
        s_idx[warp] = idx;
    }
    __syncthreads();
    const int warps = blockDim.x >> 5;
    best = lane < warps ? s_val[lane] : NEG_INF;
    idx = lane < warps ? s_idx[lane] : 0x7fffffff;
    warp_argmax(best, idx);
}

// One block per row.
extern "C" __global__ void argmax_rows(const float* logits, int vocab, int* out) {
    await_previous_kernel();
    float best;
    int idx;
    block_argmax(logits + (long long)blockIdx.x * vocab, vocab, best, idx);
    if (threadIdx.x == 0) out[blockIdx.x] = idx;
}

// Drawing a token as crate::sampling::sample_row does: the host's reference and this kernel
// pick the same token for the same uniform draw. Thresholds are keys of the relative
// probabilities found by radix select (integer counts, or mass in 2^-40 fixed point summed
// with warp reductions), so every sum is exact and the result does not depend on the order
// of additions.

typedef unsigned long long u64;

struct SampleRow {
    float temperature;
    u32 top_k;
    float top_p;
    float min_p;
    float uniform;
    u32 edit_start;
    u32 edit_end;
    u32 mask;  // 1 + the row's bitmask in `masks`, or 0
};

struct LogitEdit {
    u32 token;
    float bias;
    float repetition;
    float subtract;
};

#define MASS_SCALE 1099511627776.0f

__device__ __forceinline__ u32 order_key(float x) {
    const u32 b = __float_as_uint(x);
    return (b & 0x80000000u) ? ~b : (b | 0x80000000u);
}

// Probabilities relative to the most likely token are in [0, 1]: their keys order them,
// and their mass in 2^-40 units stays below 2^41.
__device__ __forceinline__ u64 mass_of(float prob) { return (u64)(prob * MASS_SCALE); }

// floor(total * frac) for frac in [0, 1], exact (crate::sampling::scaled): frac = m 2^-shift
// with m < 2^24, and the 128-bit product shifted down.
__device__ __forceinline__ u64 scaled(u64 total, float frac) {
    if (frac >= 1.0f) return total;
    if (!(frac > 0.0f)) return 0;
    const u32 bits = __float_as_uint(frac);
    const u32 e = bits >> 23;
    const u64 m = e == 0 ? (bits & 0x7fffffu) : ((bits & 0x7fffffu) | 0x800000u);
    const u32 shift = e == 0 ? 149 : 150 - e;
    const u64 lo = total * m, hi = __umul64hi(total, m);
    if (shift >= 128) return 0;
    if (shift >= 64) return hi >> (shift - 64);
    return (lo >> shift) | (hi << (64 - shift));
}

__device__ __forceinline__ u64 warp_sum_u64(u64 v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

__device__ __forceinline__ u64 block_sum_u64(u64 v, u64* scratch) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    v = warp_sum_u64(v);
    __syncthreads();
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    return warp_sum_u64(lane < (int)(blockDim.x >> 5) ? scratch[lane] : 0);
}

#define SAMPLE_WARPS 16
#define NO_BIN 0xffffffffu

// The key at which the weight of the row's elements with key >= floor, taken from the
// largest key down, first reaches `target` (>= 1 and at most the total): one 8-bit digit
// of the key per pass. `x` holds relative probabilities; the weight is 1 per element, or
// its mass. Logits crowd
// into a few digits, so lanes of a warp that share one add their weights with one redux
// and their leader writes the warp's own histogram: no atomics, no contention.
template <bool MASS>
__device__ u32 radix_select(const float* x, int vocab, u32 floor, u64 target,
                            u64 (*hist)[256], u32* s_digit, u64* s_left) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    u32 prefix = 0, mask = 0;
    u64 left = target;
    for (int shift = 24; shift >= 0; shift -= 8) {
        for (int b = threadIdx.x; b < SAMPLE_WARPS * 256; b += blockDim.x) hist[b >> 8][b & 255] = 0;
        __syncthreads();
        for_row(x, vocab, [&](int, float v, bool valid) {
            u32 bin = NO_BIN;
            u64 w = 0;
            const u32 key = order_key(v);
            if (valid && key >= floor && (key & mask) == prefix) {
                bin = (key >> shift) & 255;
                w = MASS ? mass_of(v) : 1ull;
            }
            // After the first digit few elements match the prefix: most warps skip.
            if (!__any_sync(0xffffffffu, bin != NO_BIN)) return;
            const u32 peers = __match_any_sync(0xffffffffu, bin);
            // Mass is below 2^41: two 21-bit halves sum over a warp without overflow.
            const u32 lo = __reduce_add_sync(peers, (u32)(w & 0x1fffff));
            const u32 hi = MASS ? __reduce_add_sync(peers, (u32)(w >> 21)) : 0;
            if (bin != NO_BIN && lane == __ffs(peers) - 1) {
                hist[warp][bin] += (u64)lo + ((u64)hi << 21);
            }
            // The next leader of this bin may be another lane: order the write before it.
            __syncwarp();
        });
        __syncthreads();
        if (threadIdx.x < 256) {
            u64 sum = 0;
            for (int w = 0; w < SAMPLE_WARPS; ++w) sum += hist[w][threadIdx.x];
            hist[0][threadIdx.x] = sum;
        }
        __syncthreads();
        if (threadIdx.x == 0) {
            u64 above = 0;
            int b = 255;
            for (; b > 0; --b) {
                if (above + hist[0][b] >= left) break;
                above += hist[0][b];
            }
            *s_digit = b;
            *s_left = left - above;
        }
        __syncthreads();
        prefix |= *s_digit << shift;
        mask |= 255u << shift;
        left = *s_left;
        __syncthreads();
    }
    return prefix;
}

// One block of SAMPLE_WARPS warps per row: edits, the structured-output mask (bit t of a
// row's bitmask allows token t), then the argmax (temperature 0) or a draw among the tokens
// top-k, top-p and min-p keep, walking them in id order. The row of `logits` is left
// holding the edited, masked logits (temperature 0) or the relative probabilities.
extern "C" __global__ void sample_rows(float* logits, int vocab, const SampleRow* rows,
                                       const LogitEdit* edits, const u32* masks, int* out) {
    await_previous_kernel();
    __shared__ u64 hist[SAMPLE_WARPS][256];
    __shared__ u64 scratch[32];
    __shared__ u32 s_digit;
    __shared__ u64 s_left;
    float* x = logits + (long long)blockIdx.x * vocab;
    const SampleRow p = rows[blockIdx.x];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;

    for (u32 e = p.edit_start + threadIdx.x; e < p.edit_end; e += blockDim.x) {
        const LogitEdit ed = edits[e];
        float v = x[ed.token] + ed.bias;
        v = v > 0.0f ? v / ed.repetition : v * ed.repetition;
        x[ed.token] = v - ed.subtract;
    }
    __syncthreads();
    if (p.mask > 0) {
        // The 32 lanes of a warp read one word: one broadcast load per 32 tokens.
        const u32* m = masks + (long long)(p.mask - 1) * ((vocab + 31) >> 5);
        for (int i = threadIdx.x; i < vocab; i += blockDim.x) {
            if (!((m[i >> 5] >> (i & 31)) & 1u)) x[i] = NEG_INF;
        }
        __syncthreads();
    }

    float max;
    int argmax;
    block_argmax(x, vocab, max, argmax);
    if (p.temperature == 0.0f) {
        if (threadIdx.x == 0) out[blockIdx.x] = argmax;
        return;
    }
    // The row becomes probabilities relative to its maximum: one exponential per token,
    // and every later pass reads them.
    const float inv_t = 1.0f / p.temperature;
    for_row(x, vocab, [&](int i, float v, bool valid) {
        if (valid) x[i] = expf((v - max) * inv_t);
    });
    __syncthreads();

    u32 threshold = 0;
    if (p.top_k > 0 && p.top_k < (u32)vocab) {
        threshold = radix_select<false>(x, vocab, 0, p.top_k, hist, &s_digit, &s_left);
    }
    if (p.top_p < 1.0f) {
        u64 total = 0, kept = 0;
        for_row(x, vocab, [&](int, float v, bool valid) {
            const u64 m = valid ? mass_of(v) : 0;
            total += m;
            if (order_key(v) >= threshold) kept += m;
        });
        total = block_sum_u64(total, scratch);
        kept = block_sum_u64(kept, scratch);
        u64 target = scaled(total, p.top_p);
        if (target < 1) target = 1;
        if (kept >= target) {
            threshold = radix_select<true>(x, vocab, threshold, target, hist, &s_digit, &s_left);
        }
    }

    // Each thread owns a contiguous run of ids, so an exclusive scan of the runs' masses
    // orders the kept tokens by id.
    const int run = (vocab + blockDim.x - 1) / blockDim.x;
    const int lo = min((int)threadIdx.x * run, vocab), hi = min(lo + run, vocab);
    u64 mine = 0;
    for (int i = lo; i < hi; ++i) {
        const float v = x[i];
        if (order_key(v) >= threshold && v >= p.min_p) mine += mass_of(v);
    }
    u64 incl = mine;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
        const u64 up = __shfl_up_sync(0xffffffffu, incl, o);
        if (lane >= o) incl += up;
    }
    __syncthreads();
    if (lane == 31) scratch[warp] = incl;
    __syncthreads();
    if (warp == 0) {
        const int warps = blockDim.x >> 5;
        u64 w = lane < warps ? scratch[lane] : 0;
#pragma unroll
        for (int o = 1; o < 32; o <<= 1) {
            const u64 up = __shfl_up_sync(0xffffffffu, w, o);
            if (lane >= o) w += up;
        }
        if (lane < warps) scratch[lane] = w;
    }
    __syncthreads();
    const u64 total = scratch[(blockDim.x >> 5) - 1];
    const u64 before = (warp > 0 ? scratch[warp - 1] : 0) + incl - mine;
    if (total == 0) {
        if (threadIdx.x == 0) out[blockIdx.x] = argmax;
        return;
    }
    u64 target = scaled(total, p.uniform);
    if (target > total - 1) target = total - 1;
    if (before <= target && target < before + mine) {
        u64 acc = before;
        for (int i = lo; i < hi; ++i) {
            const float v = x[i];
            if (order_key(v) >= threshold && v >= p.min_p) {
                acc += mass_of(v);
                if (acc > target) {
                    out[blockIdx.x] = i;
                    break;
                }
            }
        }
    }
}
