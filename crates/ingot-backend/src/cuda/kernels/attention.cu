// Paged attention over a flattened batch. Sequence s owns token rows
// query_start_loc[s]..query_start_loc[s+1], the last tokens of its context of seq_lens[s]
// tokens; keys and values are read from the cache through its block table.
//
// split_kv_attention + split_kv_reduce: one query token per grid row, each KV head read
// once for its group of query heads, the context cut into at most `num_splits` parts that
// run in parallel (flash-decoding) and are merged by the reduce kernel. A token's split
// depends only on its own context length, so results do not depend on the batch.
// split_kv_mma does the same work on tensor cores for 16-bit caches.
//
// prefill_attention: 64 query tokens x one head per block on tensor cores (mma.sync
// m16n8k16, f32 accumulation), online softmax in f32, causal over the paged context.

// GMAX and MMA_HEADS, the query heads a block of split_kv_attention and of split_kv_mma
// serves, are defined by the host (cuda/mod.rs), which sizes the grids by them.
#define SPLIT_ALIGN 16
#define WARPS 4

template <int BYTES> struct Raw;
template <> struct Raw<2> { typedef u16 t; };
template <> struct Raw<4> { typedef u32 t; };
template <> struct Raw<8> { typedef uint2 t; };
template <> struct Raw<16> { typedef uint4 t; };

// N consecutive elements (N * sizeof(C) bytes, aligned to that) as f32.
template <typename C, int N>
__device__ __forceinline__ void load_f32(const C* p, float* out) {
    typedef typename Raw<sizeof(C) * N>::t R;
    const R r = *reinterpret_cast<const R*>(p);
    const C* e = reinterpret_cast<const C*>(&r);
#pragma unroll
    for (int i = 0; i < N; i++) out[i] = to_f32(e[i]);
}

// Tokens per split for a context of `ctx` tokens: a multiple of SPLIT_ALIGN, at least
// `min_part`, so that at most `num_splits` splits cover the context.
__device__ __forceinline__ int split_len(int ctx, int num_splits, int min_part) {
    int part = (ctx + num_splits - 1) / num_splits;
    part = (part + SPLIT_ALIGN - 1) / SPLIT_ALIGN * SPLIT_ALIGN;
    return part > min_part ? part : min_part;
}

// Context length seen by flattened token `token`, and its sequence.
__device__ __forceinline__ int token_context(const int* query_start_loc, const int* seq_lens,
                                             int num_seqs, int token, int* seq) {
    const int s = seq_of_token(query_start_loc, num_seqs, token);
    *seq = s;
    const int q_len = query_start_loc[s + 1] - query_start_loc[s];
    return seq_lens[s] - q_len + (token - query_start_loc[s]) + 1;
}

// Query heads h0..h0+G of KV head kvh that a split-KV block serves, for grid.x = num_kv_heads
// * head groups of up to HEADS.
struct HeadGroup {
    int kvh, h0, G;
};

template <int HEADS>
__device__ __forceinline__ HeadGroup head_group(int num_heads, int num_kv_heads) {
    const int group = num_heads / num_kv_heads;
    const int groups_per_kv = (group + HEADS - 1) / HEADS;
    HeadGroup h;
    h.kvh = blockIdx.x / groups_per_kv;
    h.h0 = h.kvh * group + (blockIdx.x % groups_per_kv) * HEADS;
    h.G = min(HEADS, h.kvh * group + group - h.h0);
    return h;
}

// Keys [start, end) of split `split` of flattened token `token` (grid.y = its row), which
// belongs to sequence `seq`; empty past the context.
struct SplitKeys {
    int token, seq, split, start, end;
};

__device__ __forceinline__ SplitKeys split_keys(const int* query_start_loc, const int* seq_lens,
                                                int num_seqs, int token_offset, int num_splits,
                                                int min_part) {
    SplitKeys k;
    k.token = token_offset + blockIdx.y;
    const int ctx = token_context(query_start_loc, seq_lens, num_seqs, k.token, &k.seq);
    const int part = split_len(ctx, num_splits, min_part);
    k.split = blockIdx.z;
    k.start = k.split * part;
    k.end = min(ctx, k.start + part);
    return k;
}

// Grid: (num_kv_heads * head groups of up to GMAX, rows, num_splits); WARPS warps.
// The block streams its split's keys and values through shared memory in tiles of 64
// bytes' worth of keys per row (cp.async, two stages, so one tile loads while the last
// is used); warp w owns query heads w, w + WARPS, … of the group and keeps their online
// softmax. Writes per (row, head, split) the unnormalized output, the maximum and the sum.
template <typename T, typename C, int D>
__device__ void split_kv_attention(const T* qkv, const int* query_start_loc, const int* seq_lens,
                                   const int* block_tables, int max_blocks, int num_seqs,
                                   int token_offset, const C* k_cache, const C* v_cache,
                                   int block_size, int num_heads, int num_kv_heads, int row_len,
                                   float scale, int num_splits, int min_part, float* ws_o,
                                   float* ws_ml) {
    constexpr int EPV = 16 / sizeof(C);  // cache elements per 16-byte copy
    constexpr int BK = 64 / sizeof(C);   // keys per tile: 32 for 16-bit caches, 16 for f32
    constexpr int ROW = D + EPV;         // padded smem row: conflict-free 16-byte reads
    constexpr int VEC = D / 32;          // output dims per lane
    constexpr int HPW = GMAX / WARPS;    // query heads per warp, at most
    __shared__ __align__(16) C ks[2][BK * ROW];
    __shared__ __align__(16) C vs[2][BK * ROW];
    __shared__ float qs[GMAX][D];

    const HeadGroup hg = head_group<GMAX>(num_heads, num_kv_heads);
    const SplitKeys sk = split_keys(query_start_loc, seq_lens, num_seqs, token_offset, num_splits,
                                    min_part);
    if (sk.start >= sk.end) return;
    const int kvh = hg.kvh, h0 = hg.h0, G = hg.G, row = blockIdx.y, token = sk.token, s = sk.seq;
    const int split = sk.split, start = sk.start, end = sk.end;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;

    for (int i = threadIdx.x; i < G * D; i += blockDim.x) {
        const int g = i / D, d = i - g * D;
        qs[g][d] = to_f32(qkv[(long long)token * row_len + (long long)(h0 + g) * D + d]) * scale;
    }
    const int* table = block_tables + (long long)s * max_blocks;
    const int tiles = (end - start + BK - 1) / BK;
    auto issue = [&](int tile, int stage) {
        const int base = start + tile * BK;
        for (int c = threadIdx.x; c < BK * (D / EPV); c += blockDim.x) {
            const int j = c / (D / EPV), e = (c - j * (D / EPV)) * EPV;
            const int t = base + j;
            const bool valid = t < end;
            const int at = valid ? t : start;
            const long long slot = (long long)table[at / block_size] * block_size + at % block_size;
            const long long off = (slot * num_kv_heads + kvh) * D + e;
            cp_async16(&ks[stage][j * ROW + e], k_cache + off, valid);
            cp_async16(&vs[stage][j * ROW + e], v_cache + off, valid);
        }
        cp_async_commit();
    };

    float m[HPW], l[HPW], acc[HPW][VEC];
#pragma unroll
    for (int h = 0; h < HPW; h++) {
        m[h] = NEG_INF;
        l[h] = 0.0f;
#pragma unroll
        for (int v = 0; v < VEC; v++) acc[h][v] = 0.0f;
    }
    issue(0, 0);
    for (int tile = 0; tile < tiles; tile++) {
        const int stage = tile & 1;
        if (tile + 1 < tiles) {
            issue(tile + 1, stage ^ 1);
            cp_async_wait<1>();
        } else {
            cp_async_wait<0>();
        }
        __syncthreads();
        const int base = start + tile * BK;
        const C* kt = ks[stage];
        const C* vt = vs[stage];
#pragma unroll
        for (int h = 0; h < HPW; h++) {
            const int g = warp + h * WARPS;
            if (g >= G) break;
            float sc = NEG_INF;
            if (lane < BK && base + lane < end) {
                float dot = 0.0f;
                const C* kr = kt + lane * ROW;
#pragma unroll
                for (int e = 0; e < D; e += EPV) {
                    float kv[EPV];
                    load_f32<C, EPV>(kr + e, kv);
#pragma unroll
                    for (int u = 0; u < EPV; u++) dot += qs[g][e + u] * kv[u];
                }
                sc = dot;
            }
            // The tile's first key is always in range, so the maximum is finite.
            const float m_new = fmaxf(m[h], warp_max(sc));
            const float alpha = expf(m[h] - m_new);
            const float p = expf(sc - m_new);
            l[h] = l[h] * alpha + warp_sum(p);
#pragma unroll
            for (int v = 0; v < VEC; v++) acc[h][v] *= alpha;
#pragma unroll 8
            for (int j = 0; j < BK; j++) {
                const float pj = __shfl_sync(0xffffffffu, p, j);
                float vv[VEC];
                load_f32<C, VEC>(vt + j * ROW + lane * VEC, vv);
#pragma unroll
                for (int v = 0; v < VEC; v++) acc[h][v] += pj * vv[v];
            }
            m[h] = m_new;
        }
        __syncthreads();
    }
#pragma unroll
    for (int h = 0; h < HPW; h++) {
        const int g = warp + h * WARPS;
        if (g >= G) break;
        const long long at = ((long long)row * num_heads + h0 + g) * num_splits + split;
#pragma unroll
        for (int v = 0; v < VEC; v++) ws_o[at * D + lane * VEC + v] = acc[h][v];
        if (lane == 0) {
            ws_ml[at * 2] = m[h];
            ws_ml[at * 2 + 1] = l[h];
        }
    }
}

// Grid: (num_heads, rows); a block of at least one warp. Merges the splits of each
// (row, head) into the output. num_splits is at most 32: the first warp weighs one split
// per lane, and every output element is then one pass over the splits' partial outputs.
template <typename T>
__device__ void split_kv_reduce(const int* query_start_loc, const int* seq_lens, int num_seqs,
                                int token_offset, int num_heads, int head_dim, int num_splits,
                                int min_part, const float* ws_o, const float* ws_ml, T* out) {
    __shared__ float weight[32];
    const int head = blockIdx.x, row = blockIdx.y;
    const int token = token_offset + row;
    int s;
    const int ctx = token_context(query_start_loc, seq_lens, num_seqs, token, &s);
    const int part = split_len(ctx, num_splits, min_part);
    const int n = (ctx + part - 1) / part;
    const long long base = ((long long)row * num_heads + head) * num_splits;
    if (threadIdx.x < 32) {
        const int p = threadIdx.x;
        const float m = p < n ? ws_ml[(base + p) * 2] : NEG_INF;
        const float mmax = warp_max(m);
        const float f = p < n ? expf(m - mmax) : 0.0f;
        const float sum = warp_sum(p < n ? ws_ml[(base + p) * 2 + 1] * f : 0.0f);
        weight[p] = f / sum;
    }
    __syncthreads();
    T* o = out + (long long)token * num_heads * head_dim + (long long)head * head_dim;
    for (int d = threadIdx.x; d < head_dim; d += blockDim.x) {
        float v = 0.0f;
#pragma unroll 4
        for (int p = 0; p < n; p++) v += ws_o[(base + p) * head_dim + d] * weight[p];
        o[d] = from_f32<T>(v);
    }
}

// ---- tensor-core prefill ----

#define BQ 64
#define BK 64

__device__ __forceinline__ u32 ld32(const void* p) { return *reinterpret_cast<const u32*>(p); }

// One online-softmax step over an m16 x 8N tile of scores in mma C fragments (a lane holds
// rows g, elements 0 and 1, and g + 8, elements 2 and 3; masked scores are NEG_INF): turns
// the scores into probabilities against the rows' new maxima, updates the maxima m and sums
// l, and rescales the output fragments acc by what the old maxima need.
template <int N, int DN>
__device__ __forceinline__ void online_softmax(float (&sc)[N][4], float& m0, float& m1,
                                               float& l0, float& l1, float (&acc)[DN][4]) {
    float mx0 = NEG_INF, mx1 = NEG_INF;
#pragma unroll
    for (int n = 0; n < N; n++) {
        mx0 = fmaxf(mx0, fmaxf(sc[n][0], sc[n][1]));
        mx1 = fmaxf(mx1, fmaxf(sc[n][2], sc[n][3]));
    }
    mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, 1));
    mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, 2));
    mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, 1));
    mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, 2));
    const float n0 = fmaxf(m0, mx0), n1 = fmaxf(m1, mx1);
    // A row that sees no key yet (prefill's padding rows past the sequence) keeps a zero base.
    const float b0 = n0 == NEG_INF ? 0.0f : n0, b1 = n1 == NEG_INF ? 0.0f : n1;
    const float a0 = expf(m0 - b0), a1 = expf(m1 - b1);
    float rs0 = 0.0f, rs1 = 0.0f;
#pragma unroll
    for (int n = 0; n < N; n++) {
#pragma unroll
        for (int e = 0; e < 2; e++) {
            sc[n][e] = expf(sc[n][e] - b0);
            sc[n][2 + e] = expf(sc[n][2 + e] - b1);
            rs0 += sc[n][e];
            rs1 += sc[n][2 + e];
        }
    }
    rs0 += __shfl_xor_sync(0xffffffffu, rs0, 1);
    rs0 += __shfl_xor_sync(0xffffffffu, rs0, 2);
    rs1 += __shfl_xor_sync(0xffffffffu, rs1, 1);
    rs1 += __shfl_xor_sync(0xffffffffu, rs1, 2);
    l0 = l0 * a0 + rs0;
    l1 = l1 * a1 + rs1;
    m0 = n0;
    m1 = n1;
#pragma unroll
    for (int dn = 0; dn < DN; dn++) {
        acc[dn][0] *= a0;
        acc[dn][1] *= a0;
        acc[dn][2] *= a1;
        acc[dn][3] *= a1;
    }
}

// ---- tensor-core split-KV decode ----

#define MMA_KEYS 16  // keys per step of one warp

// Four 8x8 16-bit matrices: lanes 8i..8i+7 give the row addresses of matrix i, and lane
// 4g + t4 receives row g, elements 2t4 and 2t4 + 1 of each (of its transpose with .trans).
__device__ __forceinline__ void ldmatrix_x4(u32* r, const void* p) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(smem_address(p)));
}
__device__ __forceinline__ void ldmatrix_x4_trans(u32* r, const void* p) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(smem_address(p)));
}
// An 8x8 16-bit matrix held as ldmatrix leaves it (lane 4g + t4: row g, elements 2t4 and
// 2t4 + 1), transposed in the same layout.
__device__ __forceinline__ u32 movmatrix_trans(u32 x) {
    u32 r;
    asm volatile("movmatrix.sync.aligned.m8n8.trans.b16 %0, %1;" : "=r"(r) : "r"(x));
    return r;
}

// split_kv_attention for 16-bit caches on tensor cores. The keys are the m16 rows and the
// query heads of the group the n8 columns of each product (heads past the group are
// zero): S^T = K Q^T, then O^T += V^T P^T, so a group of up to 8 heads wastes at most half
// of the tensor-core work, and the keys and values reach the products through ldmatrix
// alone. Same grid, splits and outputs as split_kv_attention, with MMA_HEADS heads a block;
// a block is one warp: it streams its keys 16 at a time through a two-stage ring of shared
// memory with no block barrier, and small batches spread over as many SMs as they have
// splits. Scores and softmax stay in f32; the probabilities enter the PV product as two
// 16-bit parts (see below). A query in f32 activations is rounded to C for QK^T.
// H100, ncu, B=16 decode at Llama-3.1-8B shapes (1024-token prompts): 31.8 us a layer, against
// 33.0 with the group's heads as the m16 rows (QK^T and PV of twice the tensor-core work).
template <typename T, typename C, int D>
__device__ void split_kv_mma(const T* qkv, const int* query_start_loc, const int* seq_lens,
                             const int* block_tables, int max_blocks, int num_seqs,
                             int token_offset, const C* k_cache, const C* v_cache, int block_size,
                             int num_heads, int num_kv_heads, int row_len, float scale,
                             int num_splits, int min_part, float* ws_o, float* ws_ml) {
    constexpr int ROW = D + 8;  // padded smem row: conflict-free fragment loads
    constexpr int STAGE = 2 * MMA_KEYS * ROW;  // keys, then values
    __shared__ __align__(16) u16 ring[2 * STAGE];
    const int lane = threadIdx.x;
    const int g = lane >> 2, t4 = lane & 3;

    // The query as the B fragments of S^T = K Q^T (lane 4g + t4: head g, dims 2t4, 2t4 + 1
    // and those + 8 of each 16), requested before the split's metadata, on which they do
    // not depend.
    const HeadGroup hg = head_group<MMA_HEADS>(num_heads, num_kv_heads);
    const int kvh = hg.kvh, h0 = hg.h0, G = hg.G, row = blockIdx.y, token = token_offset + row;
    u32 qb[D / 16][2];
    {
        const T* q = qkv + (long long)token * row_len + (long long)(h0 + g) * D + 2 * t4;
#pragma unroll
        for (int kc = 0; kc < D / 16; kc++) {
#pragma unroll
            for (int i = 0; i < 2; i++) {
                float f[2] = {0.0f, 0.0f};
                if (g < G) load_f32<T, 2>(q + kc * 16 + i * 8, f);
                qb[kc][i] = pack2<C>(f[0], f[1]);
            }
        }
    }

    const SplitKeys sk = split_keys(query_start_loc, seq_lens, num_seqs, token_offset, num_splits,
                                    min_part);
    if (sk.start >= sk.end) return;
    const int s = sk.seq, split = sk.split, start = sk.start, end = sk.end;

    const int* table = block_tables + (long long)s * max_blocks;
    const int tiles = (end - start + MMA_KEYS - 1) / MMA_KEYS;
    // Lane l (and l + 16) finds where key l of a step is; -1 past the split's end. Looked
    // up a step ahead of its use, so the table's latency hides behind a step's work.
    auto key_offset = [&](int tile) -> long long {
        const int t = start + tile * MMA_KEYS + (lane & 15);
        return t < end ? (((long long)table[t / block_size] * block_size + t % block_size) *
                              num_kv_heads + kvh) * D
                       : -1;
    };
    auto issue = [&](int tile, long long key_off) {
        u16* ks = ring + (tile & 1) * STAGE;
        u16* vs = ks + MMA_KEYS * ROW;
#pragma unroll
        for (int i = 0; i < MMA_KEYS * (D / 8) / 32; i++) {
            const int c = lane + 32 * i;
            const int j = c / (D / 8), e = (c - j * (D / 8)) * 8;
            const long long off = __shfl_sync(0xffffffffu, key_off, j);
            const bool valid = off >= 0;
            cp_async16(&ks[j * ROW + e], k_cache + (valid ? off + e : 0), valid);
            cp_async16(&vs[j * ROW + e], v_cache + (valid ? off + e : 0), valid);
        }
        cp_async_commit();
    };
    issue(0, key_offset(0));
    if (tiles > 1) issue(1, key_offset(1));
    long long next = tiles > 2 ? key_offset(2) : -1;

    // O^T: lane 4g + t4 holds dims 16i + g and 16i + g + 8 of heads 2t4 and 2t4 + 1.
    float acc[D / 16][4];
#pragma unroll
    for (int i = 0; i < D / 16; i++) acc[i][0] = acc[i][1] = acc[i][2] = acc[i][3] = 0.0f;
    // Running maxima and sums of heads 2t4 (a) and 2t4 + 1 (b).
    float ma = NEG_INF, mb = NEG_INF, la = 0.0f, lb = 0.0f;

    // ldmatrix row addresses. K as the A operand (keys x dims): matrix i is keys
    // 8(i & 1).., dims 8(i >> 1)..; V^T as the A operand (dims x keys), transposed on the
    // way: matrix i is keys 8(i >> 1).., dims 8(i & 1)...
    const int mi = lane >> 3, r8 = lane & 7;
    const int k_row = ((mi & 1) * 8 + r8) * ROW + (mi >> 1) * 8;
    const int v_row = ((mi >> 1) * 8 + r8) * ROW + (mi & 1) * 8;

    for (int tile = 0; tile < tiles; tile++) {
        if (tile + 1 < tiles) cp_async_wait<1>(); else cp_async_wait<0>();
        __syncwarp();
        const int k0 = start + tile * MMA_KEYS;
        const u16* ks = ring + (tile & 1) * STAGE;
        const u16* vs = ks + MMA_KEYS * ROW;
        // S^T: lane 4g + t4 holds keys g (0, 1) and g + 8 (2, 3) of heads 2t4, 2t4 + 1.
        float sc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
        for (int kc = 0; kc < D / 16; kc++) {
            u32 a[4];
            ldmatrix_x4(a, ks + k_row + kc * 16);
            mma16816<C>(sc, a, qb[kc][0], qb[kc][1]);
        }
        // Key k0 is in range, so every head's maximum is finite.
        const bool v0 = k0 + g < end, v1 = k0 + g + 8 < end;
        sc[0] = v0 ? sc[0] * scale : NEG_INF;
        sc[1] = v0 ? sc[1] * scale : NEG_INF;
        sc[2] = v1 ? sc[2] * scale : NEG_INF;
        sc[3] = v1 ? sc[3] * scale : NEG_INF;
        float xa = fmaxf(sc[0], sc[2]), xb = fmaxf(sc[1], sc[3]);
#pragma unroll
        for (int o = 4; o < 32; o <<= 1) {
            xa = fmaxf(xa, __shfl_xor_sync(0xffffffffu, xa, o));
            xb = fmaxf(xb, __shfl_xor_sync(0xffffffffu, xb, o));
        }
        const float na = fmaxf(ma, xa), nb = fmaxf(mb, xb);
        const float aa = expf(ma - na), ab = expf(mb - nb);
        sc[0] = expf(sc[0] - na);
        sc[1] = expf(sc[1] - nb);
        sc[2] = expf(sc[2] - na);
        sc[3] = expf(sc[3] - nb);
        float ra = sc[0] + sc[2], rb = sc[1] + sc[3];
#pragma unroll
        for (int o = 4; o < 32; o <<= 1) {
            ra += __shfl_xor_sync(0xffffffffu, ra, o);
            rb += __shfl_xor_sync(0xffffffffu, rb, o);
        }
        la = la * aa + ra;
        lb = lb * ab + rb;
        ma = na;
        mb = nb;
#pragma unroll
        for (int i = 0; i < D / 16; i++) {
            acc[i][0] *= aa;
            acc[i][1] *= ab;
            acc[i][2] *= aa;
            acc[i][3] *= ab;
        }
        // P^T as the B fragments of O^T += V^T P^T: the score fragment of keys g (g + 8) is
        // the 8x8 matrix (keys, heads) in ldmatrix's layout, and its transpose is the B
        // fragment (lane 4g + t4: head g, keys 2t4, 2t4 + 1). The probabilities go in as a
        // 16-bit pair hi + lo: their sum carries p to about 16 bits of mantissa, so PV loses
        // no more than the f32 CUDA-core kernel does.
        u32 ph[2], pl[2];
#pragma unroll
        for (int i = 0; i < 2; i++) {
            const float x = sc[2 * i], y = sc[2 * i + 1];
            const u32 hi = pack2<C>(x, y);
            const float2 r = unpack2<C>(hi);
            ph[i] = movmatrix_trans(hi);
            pl[i] = movmatrix_trans(pack2<C>(x - r.x, y - r.y));
        }
#pragma unroll
        for (int i = 0; i < D / 16; i++) {
            u32 a[4];
            ldmatrix_x4_trans(a, vs + v_row + i * 16);
            mma16816<C>(acc[i], a, ph[0], ph[1]);
            mma16816<C>(acc[i], a, pl[0], pl[1]);
        }
        __syncwarp();
        if (tile + 2 < tiles) {
            issue(tile + 2, next);
            if (tile + 3 < tiles) next = key_offset(tile + 3);
        }
    }

    // Columns 2t4 and 2t4 + 1 are heads h0 + 2t4 and h0 + 2t4 + 1 where those exist.
#pragma unroll
    for (int e = 0; e < 2; e++) {
        const int r = 2 * t4 + e;
        if (r >= G) continue;
        const long long at = ((long long)row * num_heads + h0 + r) * num_splits + split;
        float* o = ws_o + at * D + g;
#pragma unroll
        for (int i = 0; i < D / 16; i++) {
            o[i * 16] = acc[i][e];
            o[i * 16 + 8] = acc[i][2 + e];
        }
        if (g == 0) {
            ws_ml[at * 2] = e ? mb : ma;
            ws_ml[at * 2 + 1] = e ? lb : la;
        }
    }
}

// Grid: (num_tokens / BQ + num_seqs, num_heads); 4 warps, each owning 16 query rows.
// Block b serves sequence s with qsl[s] / BQ + s <= b < qsl[s+1] / BQ + s + 1, which
// covers every sequence's query tiles; surplus blocks return at once.
template <typename T, int D>
__device__ void prefill_attention(const T* qkv, const int* qsl, const int* seq_lens,
                                  const int* block_tables, int max_blocks, int num_seqs,
                                  const T* k_cache, const T* v_cache, int block_size,
                                  int num_heads, int num_kv_heads, int row_len, float scale,
                                  T* out) {
    constexpr int KP = D + 8;   // padded smem rows keep the fragment loads conflict-free
    constexpr int VP = BK + 8;
    __shared__ __align__(16) u16 ks[BK * KP];
    __shared__ __align__(16) u16 vts[D * VP];

    const int tile = blockIdx.x, head = blockIdx.y;
    const int kvh = head / (num_heads / num_kv_heads);
    int lo = 0, hi = num_seqs - 1;
    while (lo < hi) {
        const int mid = (lo + hi + 1) >> 1;
        if (qsl[mid] / BQ + mid <= tile) lo = mid; else hi = mid - 1;
    }
    const int s = lo;
    const int q_start = qsl[s], q_len = qsl[s + 1] - q_start;
    const int q0 = (tile - (q_start / BQ + s)) * BQ;
    if (q0 >= q_len) return;
    const int seq_len = seq_lens[s];
    const int ctx0 = seq_len - q_len;  // position of the sequence's first query token
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int g = lane >> 2, t4 = lane & 3;
    const int r0 = q0 + warp * 16 + g, r1 = r0 + 8;

    u32 qa[D / 16][4];
    const T* qb = qkv + (long long)q_start * row_len + (long long)head * D;
#pragma unroll
    for (int kc = 0; kc < D / 16; kc++) {
        const int c = kc * 16 + 2 * t4;
        qa[kc][0] = r0 < q_len ? ld32(qb + (long long)r0 * row_len + c) : 0u;
        qa[kc][1] = r1 < q_len ? ld32(qb + (long long)r1 * row_len + c) : 0u;
        qa[kc][2] = r0 < q_len ? ld32(qb + (long long)r0 * row_len + c + 8) : 0u;
        qa[kc][3] = r1 < q_len ? ld32(qb + (long long)r1 * row_len + c + 8) : 0u;
    }
    float acc[D / 8][4];
#pragma unroll
    for (int dn = 0; dn < D / 8; dn++) acc[dn][0] = acc[dn][1] = acc[dn][2] = acc[dn][3] = 0.0f;
    float m0 = NEG_INF, m1 = NEG_INF, l0 = 0.0f, l1 = 0.0f;
    const int p0 = ctx0 + r0, p1 = ctx0 + r1;
    const int kv_end = min(seq_len, ctx0 + q0 + BQ);
    const int* table = block_tables + (long long)s * max_blocks;
    const long long slot_stride = (long long)num_kv_heads * D;

    for (int k0 = 0; k0 < kv_end; k0 += BK) {
        __syncthreads();
        for (int c = threadIdx.x; c < BK * D / 8; c += blockDim.x) {
            const int j = c / (D / 8), d8 = (c - j * (D / 8)) * 8;
            const int pos = k0 + j;
            uint4 kv = make_uint4(0, 0, 0, 0), vv = make_uint4(0, 0, 0, 0);
            if (pos < kv_end) {
                const long long slot =
                    (long long)table[pos / block_size] * block_size + pos % block_size;
                const long long off = slot * slot_stride + (long long)kvh * D + d8;
                kv = *reinterpret_cast<const uint4*>(k_cache + off);
                vv = *reinterpret_cast<const uint4*>(v_cache + off);
            }
            *reinterpret_cast<uint4*>(&ks[j * KP + d8]) = kv;
            const u16* ve = reinterpret_cast<const u16*>(&vv);
#pragma unroll
            for (int e = 0; e < 8; e++) vts[(d8 + e) * VP + j] = ve[e];
        }
        __syncthreads();

        float sc[BK / 8][4];
#pragma unroll
        for (int n = 0; n < BK / 8; n++) {
            sc[n][0] = sc[n][1] = sc[n][2] = sc[n][3] = 0.0f;
            const u16* kr = &ks[(n * 8 + g) * KP + 2 * t4];
#pragma unroll
            for (int kc = 0; kc < D / 16; kc++)
                mma16816<T>(sc[n], qa[kc], ld32(kr + kc * 16), ld32(kr + kc * 16 + 8));
        }
#pragma unroll
        for (int n = 0; n < BK / 8; n++) {
#pragma unroll
            for (int e = 0; e < 2; e++) {
                const int key = k0 + n * 8 + 2 * t4 + e;
                sc[n][e] = (key <= p0 && key < kv_end) ? sc[n][e] * scale : NEG_INF;
                sc[n][2 + e] = (key <= p1 && key < kv_end) ? sc[n][2 + e] * scale : NEG_INF;
            }
        }
        online_softmax(sc, m0, m1, l0, l1, acc);
        u32 pa[BK / 16][4];
#pragma unroll
        for (int kk = 0; kk < BK / 16; kk++) {
            pa[kk][0] = pack2<T>(sc[2 * kk][0], sc[2 * kk][1]);
            pa[kk][1] = pack2<T>(sc[2 * kk][2], sc[2 * kk][3]);
            pa[kk][2] = pack2<T>(sc[2 * kk + 1][0], sc[2 * kk + 1][1]);
            pa[kk][3] = pack2<T>(sc[2 * kk + 1][2], sc[2 * kk + 1][3]);
        }
#pragma unroll
        for (int dn = 0; dn < D / 8; dn++) {
            const u16* vr = &vts[(dn * 8 + g) * VP + 2 * t4];
#pragma unroll
            for (int kk = 0; kk < BK / 16; kk++)
                mma16816<T>(acc[dn], pa[kk], ld32(vr + kk * 16), ld32(vr + kk * 16 + 8));
        }
    }
    const long long out_ld = (long long)num_heads * D;
    T* ob = out + (long long)q_start * out_ld + (long long)head * D;
    const float i0 = l0 > 0.0f ? 1.0f / l0 : 0.0f, i1 = l1 > 0.0f ? 1.0f / l1 : 0.0f;
#pragma unroll
    for (int dn = 0; dn < D / 8; dn++) {
#pragma unroll
        for (int e = 0; e < 2; e++) {
            const int col = dn * 8 + 2 * t4 + e;
            if (r0 < q_len) ob[(long long)r0 * out_ld + col] = from_f32<T>(acc[dn][e] * i0);
            if (r1 < q_len) ob[(long long)r1 * out_ld + col] = from_f32<T>(acc[dn][2 + e] * i1);
        }
    }
}

#define SPLIT_KV(T, S, C, SC, D)                                                                   \
    extern "C" __global__ void __launch_bounds__(WARPS * 32)                                       \
        split_kv_attention_##S##_##SC##_d##D(                                                      \
            const T* qkv, const int* qsl, const int* sl, const int* bt, int mb, int ns, int off,   \
            const C* kc, const C* vc, int bs, int nh, int nkv, int rl, float scale, int splits,    \
            int min_part, float* ws_o, float* ws_ml) {                                             \
        await_previous_kernel();                                                                   \
        split_kv_attention<T, C, D>(qkv, qsl, sl, bt, mb, ns, off, kc, vc, bs, nh, nkv, rl, scale, \
                                    splits, min_part, ws_o, ws_ml);                                \
    }

#define SPLIT_KV_ALL(T, S, C, SC) \
    SPLIT_KV(T, S, C, SC, 32)     \
    SPLIT_KV(T, S, C, SC, 64)     \
    SPLIT_KV(T, S, C, SC, 128)

#define SPLIT_KV_MMA(T, S, C, SC, D)                                                               \
    extern "C" __global__ void __launch_bounds__(32) split_kv_mma_##S##_##SC##_d##D(                \
        const T* qkv, const int* qsl, const int* sl, const int* bt, int mb, int ns, int off,       \
        const C* kc, const C* vc, int bs, int nh, int nkv, int rl, float scale, int splits,        \
        int min_part, float* ws_o, float* ws_ml) {                                                 \
        await_previous_kernel();                                                                   \
        split_kv_mma<T, C, D>(qkv, qsl, sl, bt, mb, ns, off, kc, vc, bs, nh, nkv, rl, scale,       \
                              splits, min_part, ws_o, ws_ml);                                      \
    }

#define SPLIT_KV_MMA_ALL(T, S, C, SC) \
    SPLIT_KV_MMA(T, S, C, SC, 32)     \
    SPLIT_KV_MMA(T, S, C, SC, 64)     \
    SPLIT_KV_MMA(T, S, C, SC, 128)

#define REDUCE(T, S)                                                                               \
    extern "C" __global__ void split_kv_reduce_##S(const int* qsl, const int* sl, int ns, int off, \
                                                   int nh, int hd, int splits, int min_part,       \
                                                   const float* ws_o, const float* ws_ml, T* out) { \
        await_previous_kernel();                                                                   \
        split_kv_reduce<T>(qsl, sl, ns, off, nh, hd, splits, min_part, ws_o, ws_ml, out);          \
    }

#define PREFILL(T, S, D)                                                                           \
    extern "C" __global__ void __launch_bounds__(128) prefill_attention_##S##_d##D(                \
        const T* qkv, const int* qsl, const int* sl, const int* bt, int mb, int ns, const T* kc,   \
        const T* vc, int bs, int nh, int nkv, int rl, float scale, T* out) {                       \
        await_previous_kernel();                                                                   \
        prefill_attention<T, D>(qkv, qsl, sl, bt, mb, ns, kc, vc, bs, nh, nkv, rl, scale, out);    \
    }

SPLIT_KV_ALL(float, f32, float, f32)
SPLIT_KV_ALL(float, f32, f16, f16)
SPLIT_KV_ALL(float, f32, bf16, bf16)
SPLIT_KV_ALL(f16, f16, float, f32)
SPLIT_KV_ALL(f16, f16, f16, f16)
SPLIT_KV_ALL(f16, f16, bf16, bf16)
SPLIT_KV_ALL(bf16, bf16, float, f32)
SPLIT_KV_ALL(bf16, bf16, f16, f16)
SPLIT_KV_ALL(bf16, bf16, bf16, bf16)
SPLIT_KV_MMA_ALL(float, f32, f16, f16)
SPLIT_KV_MMA_ALL(float, f32, bf16, bf16)
SPLIT_KV_MMA_ALL(f16, f16, f16, f16)
SPLIT_KV_MMA_ALL(f16, f16, bf16, bf16)
SPLIT_KV_MMA_ALL(bf16, bf16, f16, f16)
SPLIT_KV_MMA_ALL(bf16, bf16, bf16, bf16)
REDUCE(float, f32)
REDUCE(f16, f16)
REDUCE(bf16, bf16)
PREFILL(f16, f16, 32)
PREFILL(f16, f16, 64)
PREFILL(f16, f16, 128)
PREFILL(bf16, bf16, 32)
PREFILL(bf16, bf16, 64)
PREFILL(bf16, bf16, 128)
