// Products of 5 to 16 rows on Hopper: out = x · wᵀ (+ out where `accumulate`), f32 sums.
// cuBLASLt's kernels for these shapes cannot start before the kernel ahead of them ends
// (they take no part in programmatic dependent launch). Here the weights and the input
// reach shared memory by TMA tensor copies (one copy a 64-wide k slab of TMA_BN weight rows
// or of the 16 input rows, 128-byte swizzled) into a ring of TMA_STAGES stages, each guarded
// by a full and an empty mbarrier. One lane issues the copies, and requests its first
// stages of weights before it waits for the kernel ahead, as no kernel writes weights.
// TMA_WARPS consumer warps (TMA_KW along k, the rest along the m16 tiles) multiply from the
// stages and release each stage on their own, so no block-wide barrier sits in the stream.
// One block an SM loops over tiles of TMA_BN weight rows, each over the whole of k, and
// writes the tile's outputs itself: no k split, so no partial sums for another kernel to
// add, and every output is the same sum in the same order whatever the row count. Narrow
// tiles give every SM work without a split: H100, 16 rows at Llama-3.1-8B shapes,
// scripts/gpu/tma_gemm.cu, a layer's four products back to back with programmatic launch in
// 154.7 µs with 32-row tiles and no split, 157.2 with 64-row tiles and k split (its partial
// sums not added), 170.9 through cuBLAS.
//
// The SiLU·mul variant (SILU) runs the gate/up product of a gated MLP whose RMSNorm weights
// are folded into the matrix, on the residual's un-normalized rows: a tile holds TMA_BN / 2
// gate rows and the up rows of the same columns, and the warps of the first m16 tile also
// add up the squares of the input they read, so the tile ends with each row's 1 / rms and
// writes silu(gate / rms) * (up / rms) straight away, each normalized product rounded as
// the activation dtype would hold it (as `silu_mul_normed` does).
//
// Lane (g, t) takes the 16-byte pieces 2t and 2t + 1 of a slab (k 16t .. 16t + 15) from
// rows g and g + 8 of each m16 tile and of the input: piece q of row r sits at piece
// q ^ (r % 8), so the 8 lanes of one phase of a 128-bit shared load (rows g and g + 1) meet
// no bank twice. The m16n8k16 products take those k in that order for both operands, as a
// dot product may.

// A CUtensorMap: 128 opaque bytes, encoded on the host.
struct __align__(64) TensorMap {
    unsigned long long bits[16];
};

#if __CUDA_ARCH__ >= 900
__device__ __forceinline__ void mbar_init(u32 bar, u32 count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(bar), "r"(count));
}
__device__ __forceinline__ void mbar_expect(u32 bar, u32 bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bar), "r"(bytes)
                 : "memory");
}
__device__ __forceinline__ void mbar_arrive(u32 bar) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(bar) : "memory");
}
__device__ __forceinline__ void mbar_wait(u32 bar, u32 parity) {
    u32 done = 0;
    while (!done) {
        asm volatile(
            "{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2; "
            "selp.u32 %0, 1, 0, p; }"
            : "=r"(done)
            : "r"(bar), "r"(parity)
            : "memory");
    }
}
__device__ __forceinline__ void tensor_copy(u32 dst, const TensorMap* map, int k, int row, u32 bar) {
    asm volatile(
        "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, "
        "{%2, %3}], [%4];" ::"r"(dst),
        "l"(map), "r"(k), "r"(row), "r"(bar)
        : "memory");
}

// The sum of squares of the 8 values of a 16-byte piece.
template <typename T>
__device__ __forceinline__ float squares(uint4 v) {
    const u32 w[4] = {v.x, v.y, v.z, v.w};
    float s = 0.0f;
#pragma unroll
    for (int i = 0; i < 4; i++) {
        const float2 f = unpack2<T>(w[i]);
        s += f.x * f.x + f.y * f.y;
    }
    return s;
}

template <typename T, typename O, bool SILU>
__device__ void tma_product(const TensorMap* wmap, const TensorMap* xmap, O* out, long long ld,
                            int accumulate, int n, int k, int m, float eps) {
    extern __shared__ __align__(1024) unsigned char smem_raw[];
    // The 128-byte swizzle repeats every 1024 bytes, from a 1024-byte boundary.
    unsigned char* smem = reinterpret_cast<unsigned char*>(
        (reinterpret_cast<unsigned long long>(smem_raw) + 1023) & ~1023ull);
    constexpr int SLABS = TMA_BK / 64, WSLAB = TMA_BN * 128, XSLAB = TMA_ROWS * 128;
    constexpr int STAGE = SLABS * (WSLAB + XSLAB), STAGE_BYTES = (TMA_BN + TMA_ROWS) * TMA_BK * 2;
    constexpr int MT = TMA_BN / 16 / (TMA_WARPS / TMA_KW);
    unsigned long long* full = reinterpret_cast<unsigned long long*>(smem + TMA_STAGES * STAGE);
    unsigned long long* empty = full + TMA_STAGES;
    float* sums = reinterpret_cast<float*>(empty + TMA_STAGES);  // [TMA_KW][TMA_ROWS][TMA_BN]
    float* squared = sums + TMA_KW * TMA_ROWS * TMA_BN;            // [TMA_KW][TMA_ROWS]
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int steps = k / TMA_BK, tiles = n / TMA_BN;
    if (threadIdx.x == 0) {
        for (int s = 0; s < TMA_STAGES; s++) {
            mbar_init(smem_address(&full[s]), 1);
            mbar_init(smem_address(&empty[s]), TMA_WARPS);
        }
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    }
    __syncthreads();
    if (warp == TMA_WARPS) {
        if (lane != 0) return;
        auto copy = [&](int slot, int tile, int kk, bool weights) {
            unsigned char* stage = smem + slot * STAGE;
            const u32 bar = smem_address(&full[slot]);
#pragma unroll
            for (int sl = 0; sl < SLABS; sl++) {
                if (weights && SILU) {
                    const int j0 = tile * (TMA_BN / 2);
                    const u32 w = smem_address(stage + sl * WSLAB);
                    tensor_copy(w, wmap, kk + sl * 64, j0, bar);
                    tensor_copy(w + TMA_BN / 2 * 128, wmap, kk + sl * 64, n / 2 + j0, bar);
                } else if (weights)
                    tensor_copy(smem_address(stage + sl * WSLAB), wmap, kk + sl * 64,
                                tile * TMA_BN, bar);
                else
                    tensor_copy(smem_address(stage + SLABS * WSLAB + sl * XSLAB), xmap, kk + sl * 64,
                                0, bar);
            }
        };
        const int pre = min(TMA_STAGES, steps);
        for (int s = 0; s < pre; s++) {
            mbar_expect(smem_address(&full[s]), STAGE_BYTES);
            copy(s, blockIdx.x, s * TMA_BK, true);
        }
        await_previous_kernel();
        for (int s = 0; s < pre; s++) copy(s, blockIdx.x, s * TMA_BK, false);
        int it = pre;
        for (int tile = blockIdx.x; tile < tiles; tile += gridDim.x) {
            for (int s = tile == (int)blockIdx.x ? pre : 0; s < steps; s++, it++) {
                const int slot = it % TMA_STAGES, round = it / TMA_STAGES;
                if (it >= TMA_STAGES) mbar_wait(smem_address(&empty[slot]), (round & 1) ^ 1);
                mbar_expect(smem_address(&full[slot]), STAGE_BYTES);
                copy(slot, tile, s * TMA_BK, true);
                copy(slot, tile, s * TMA_BK, false);
            }
        }
        return;
    }
    // The outputs may be what the kernel ahead reads or writes (the residual).
    await_previous_kernel();
    const int g = lane >> 2, t = lane & 3, kw = warp % TMA_KW, mt0 = warp / TMA_KW * MT;
    int it = 0;
    // The first m16 tile's warps between them read each input value once a tile.
    const bool squaring = SILU && mt0 == 0;
    for (int tile = blockIdx.x; tile < tiles; tile += gridDim.x) {
        float acc[MT][2][4], ssa = 0.0f, ssb = 0.0f;
#pragma unroll
        for (int i = 0; i < MT; i++)
#pragma unroll
            for (int h = 0; h < 2; h++)
#pragma unroll
                for (int e = 0; e < 4; e++) acc[i][h][e] = 0.0f;
        for (int s = 0; s < steps; s++, it++) {
            const int slot = it % TMA_STAGES, round = it / TMA_STAGES;
            mbar_wait(smem_address(&full[slot]), round & 1);
            const unsigned char* stage = smem + slot * STAGE;
#pragma unroll
            for (int cs = kw; cs < TMA_BK / 32; cs += TMA_KW) {
                const int sl = cs / 2, piece = ((2 * t + cs % 2) ^ g) * 16;
                const unsigned char* xs = stage + SLABS * WSLAB + sl * XSLAB;
                const uint4 xa = *reinterpret_cast<const uint4*>(xs + g * 128 + piece);
                const uint4 xb = *reinterpret_cast<const uint4*>(xs + (g + 8) * 128 + piece);
                if (squaring) {
                    ssa += squares<T>(xa);
                    ssb += squares<T>(xb);
                }
                const unsigned char* ws = stage + sl * WSLAB;
#pragma unroll
                for (int i = 0; i < MT; i++) {
                    const int r = (mt0 + i) * 16 + g;
                    const uint4 a = *reinterpret_cast<const uint4*>(ws + r * 128 + piece);
                    const uint4 b = *reinterpret_cast<const uint4*>(ws + (r + 8) * 128 + piece);
                    const u32 lo[4] = {a.x, b.x, a.y, b.y}, hi[4] = {a.z, b.z, a.w, b.w};
                    mma16816<T>(acc[i][0], lo, xa.x, xa.y);
                    mma16816<T>(acc[i][0], hi, xa.z, xa.w);
                    mma16816<T>(acc[i][1], lo, xb.x, xb.y);
                    mma16816<T>(acc[i][1], hi, xb.z, xb.w);
                }
            }
            __syncwarp();
            if (lane == 0) mbar_arrive(smem_address(&empty[slot]));
        }
        // acc[i][h]: weight rows (mt0 + i) * 16 + g (+ 8), input rows 8h + 2t (+ 1).
#pragma unroll
        for (int i = 0; i < MT; i++)
#pragma unroll
            for (int h = 0; h < 2; h++) {
                float* p = sums + (kw * TMA_ROWS + 8 * h + 2 * t) * TMA_BN + (mt0 + i) * 16 + g;
                p[0] = acc[i][h][0];
                p[TMA_BN] = acc[i][h][1];
                p[8] = acc[i][h][2];
                p[TMA_BN + 8] = acc[i][h][3];
            }
        if (squaring) {
            // Lanes t = 0..3 of a row read its pieces 2t and 2t + 1.
            for (int d = 1; d < 4; d <<= 1) {
                ssa += __shfl_xor_sync(0xffffffffu, ssa, d);
                ssb += __shfl_xor_sync(0xffffffffu, ssb, d);
            }
            if (t == 0) {
                squared[kw * TMA_ROWS + g] = ssa;
                squared[kw * TMA_ROWS + g + 8] = ssb;
            }
        }
        asm volatile("bar.sync 1, %0;" ::"n"(32 * TMA_WARPS));
        if (SILU) {
            constexpr int H = TMA_BN / 2;
            for (int i = threadIdx.x; i < m * H; i += 32 * TMA_WARPS) {
                const int r = i / H, c = i % H;
                float gate = 0.0f, up = 0.0f, ss = 0.0f;
#pragma unroll
                for (int q = 0; q < TMA_KW; q++) {
                    gate += sums[(q * TMA_ROWS + r) * TMA_BN + c];
                    up += sums[(q * TMA_ROWS + r) * TMA_BN + H + c];
                    ss += squared[q * TMA_ROWS + r];
                }
                const float inv = rsqrtf(ss / k + eps);
                const float a = round_to<O>(gate * inv), b = round_to<O>(up * inv);
                out[r * ld + tile * H + c] = from_f32<O>(a / (1.0f + expf(-a)) * b);
            }
        } else {
            for (int i = threadIdx.x; i < m * TMA_BN; i += 32 * TMA_WARPS) {
                float v = 0.0f;
#pragma unroll
                for (int q = 0; q < TMA_KW; q++) v += sums[q * TMA_ROWS * TMA_BN + i];
                O* o = out + i / TMA_BN * ld + tile * TMA_BN + i % TMA_BN;
                if (accumulate) v += to_f32(*o);
                *o = from_f32<O>(v);
            }
        }
        asm volatile("bar.sync 1, %0;" ::"n"(32 * TMA_WARPS));
    }
}
#endif

// Grid: min(n / TMA_BN, SMs) blocks of TMA_WARPS + 1 warps, the dynamic shared memory the
// host computes (tma_product::SHARED_BYTES). n is a multiple of TMA_BN and k of TMA_BK; out
// rows are `ld` apart. The SiLU·mul kernels take n = 2 * ffn gate/up rows, a weight map of
// TMA_BN / 2-row boxes, write ffn columns and ignore `accumulate`; `eps` is their norm's.
// The kernel waits for the one before inside tma_product, after its first weight copies.
#if __CUDA_ARCH__ >= 900
#define TMA_PRODUCT_BODY(T, O, SILU)                                                               \
    tma_product<T, O, SILU>(&wmap, &xmap, out, ld, accumulate, n, k, m, eps);
#else
#define TMA_PRODUCT_BODY(T, O, SILU)
#endif
#define TMA_PRODUCT(T, O, SILU, S)                                                                 \
    extern "C" __global__ void __launch_bounds__(32 * (TMA_WARPS + 1), 1) tma_product_##S(        \
        const __grid_constant__ TensorMap wmap, const __grid_constant__ TensorMap xmap, O* out,    \
        long long ld, int accumulate, int n, int k, int m, float eps) {                            \
        TMA_PRODUCT_BODY(T, O, SILU)                                                               \
    }

TMA_PRODUCT(bf16, bf16, false, bf16_bf16)
TMA_PRODUCT(bf16, float, false, bf16_f32)
TMA_PRODUCT(f16, f16, false, f16_f16)
TMA_PRODUCT(f16, float, false, f16_f32)
TMA_PRODUCT(bf16, bf16, true, silu_bf16)
TMA_PRODUCT(f16, f16, true, silu_f16)
