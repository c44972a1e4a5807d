// Prefill attention on matrix units (cooperative matrices), for 16-bit caches and head_dim
// <= 128 a multiple of 16: attention.wgsl's `prefill` (one workgroup per tile of Q_TILE
// query rows of one sequence and a query head, the context in tiles of PC_KEYS keys,
// an online softmax in f32 per row), with S = Q·Kᵀ and O += P·V as products of F x F
// fragments on f16 inputs with f32 sums. Q and P are rounded to f16; the keys and values
// are 16-bit already.
//
// Four subgroups of COOP_SG threads share the fragments of each product. O lives in
// workgroup memory between tiles, where the threads scale its rows by the softmax's
// correction before the next P·V adds to it.
override COOP_SG: u32 = 32u;
override PC_THREADS: u32 = 4u * COOP_SG;
const PC_SUBGROUPS: u32 = 4u;
const PC_KEYS: u32 = 32u;
const PC_DIM: u32 = 128u;
// Rows of the f16 tiles stand 8 halves past their length, so the fragment loads of
// consecutive rows start in different banks.
const PC_QK_PAD: u32 = PC_DIM + 8u;
const PC_P_PAD: u32 = PC_KEYS + 8u;
var<workgroup> pc_q: array<f16, 2176>; // Q_TILE * PC_QK_PAD
// The key tile, then (once S is out) the value tile: [key][dim].
var<workgroup> pc_kv: array<f16, 4352>; // PC_KEYS * PC_QK_PAD
var<workgroup> pc_s: array<f32, 512>; // Q_TILE * PC_KEYS
var<workgroup> pc_p: array<f16, 640>; // Q_TILE * PC_P_PAD
var<workgroup> pc_o: array<f32, 2048>; // Q_TILE * PC_DIM

alias PcA = coop_matFxF<f16, A>;
alias PcB = coop_matFxF<f16, B>;
alias PcC = coop_matFxF<f32, C>;

// Keys t0 .. t0 + nt of `seq`'s kv head from the key (or value) cache into pc_kv as f16,
// zero past nt.
fn pc_stage(lid: u32, seq: u32, kvh: u32, t0: u32, nt: u32, values: bool) {
    let pieces = p.head_dim / 8u;
    for (var i = lid; i < PC_KEYS * pieces; i += PC_THREADS) {
        let j = i / pieces;
        let e = i % pieces;
        var w = W8(vec4<f32>(), vec4<f32>());
        if (j < nt) {
            let g = cache_index(seq, t0 + j, kvh) / 8u + e;
            if (values) {
                w = vc_at8(g);
            } else {
                w = kc_at8(g);
            }
        }
        let o = j * PC_QK_PAD + 8u * e;
        pc_kv[o] = f16(w.lo.x);
        pc_kv[o + 1u] = f16(w.lo.y);
        pc_kv[o + 2u] = f16(w.lo.z);
        pc_kv[o + 3u] = f16(w.lo.w);
        pc_kv[o + 4u] = f16(w.hi.x);
        pc_kv[o + 5u] = f16(w.hi.y);
        pc_kv[o + 6u] = f16(w.hi.z);
        pc_kv[o + 7u] = f16(w.hi.w);
    }
}

@compute @workgroup_size(PC_THREADS)
fn prefill_coop(@builtin(workgroup_id) wg: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
                @builtin(local_invocation_index) lid: u32,
                @builtin(subgroup_id) sg: u32) {
    // The tile's rows as `prefill` finds them, written out again: behind a function, naga
    // takes the early returns as non-uniform control flow, which cooperative ops forbid.
    let idx = wg.y * nwg.x + wg.x;
    let h = idx % p.q_heads;
    let qt = (idx / p.q_heads) % p.q_tiles;
    let seq = idx / (p.q_heads * p.q_tiles);
    if (seq >= p.num_seqs) {
        return;
    }
    let start = u32(query_start_loc[seq]);
    let q_len = u32(query_start_loc[seq + 1u]) - start;
    if (qt * Q_TILE >= q_len) {
        return;
    }
    let r0 = start + qt * Q_TILE;
    let nr = min(Q_TILE, q_len - qt * Q_TILE);
    // Row i sees keys up to its own position: ctx + qt * Q_TILE + i.
    let first_pos = u32(seq_lens[seq]) - q_len + qt * Q_TILE;
    let max_keys = first_pos + nr;
    let kvh = h / (p.q_heads / p.kv_heads);
    let hd = p.head_dim;
    for (var i = lid; i < Q_TILE * hd; i += PC_THREADS) {
        let r = i / hd;
        let d = i % hd;
        var v = 0.0;
        if (r < nr) {
            v = qkv[(r0 + r) * p.row_len + h * hd + d];
        }
        pc_q[r * PC_QK_PAD + d] = f16(v);
        pc_o[r * PC_DIM + d] = 0.0;
    }
    if (lid < Q_TILE) {
        head_max[lid] = NEG_BIG;
        head_sum[lid] = 0.0;
    }
    // Fragments of S (Q_TILE x PC_KEYS) and of O (Q_TILE x head_dim), row-major.
    let s_cols = PC_KEYS / F;
    let s_frags = (Q_TILE / F) * s_cols;
    let o_cols = hd / F;
    let o_frags = (Q_TILE / F) * o_cols;
    for (var t0 = 0u; t0 < max_keys; t0 += PC_KEYS) {
        let nt = min(PC_KEYS, max_keys - t0);
        pc_stage(lid, seq, kvh, t0, nt, false);
        workgroupBarrier();
        for (var f = sg; f < s_frags; f += PC_SUBGROUPS) {
            let fr = f / s_cols;
            let fc = f % s_cols;
            var s = PcC();
            for (var kk = 0u; kk < hd; kk += F) {
                let a = coopLoadT<PcA>(&pc_q[fr * F * PC_QK_PAD + kk], PC_QK_PAD);
                let b = coopLoad<PcB>(&pc_kv[fc * F * PC_QK_PAD + kk], PC_QK_PAD);
                s = coopMultiplyAdd(a, b, s);
            }
            coopStoreT(s, &pc_s[fr * F * PC_KEYS + fc * F], PC_KEYS);
        }
        workgroupBarrier();
        // Row i's maximum and correction; masked keys (past the row's position or the
        // tile) and rows past nr are left out.
        if (lid < Q_TILE) {
            let i = lid;
            var mx = head_max[i];
            for (var j = 0u; j < nt; j++) {
                if (i < nr && t0 + j <= first_pos + i) {
                    mx = max(mx, pc_s[i * PC_KEYS + j] * p.scale);
                }
            }
            head_corr[i] = exp(head_max[i] - mx);
            head_max[i] = mx;
        }
        workgroupBarrier();
        // The probabilities as f16 (0 where masked), a thread an element, and O's rows
        // scaled by their correction.
        for (var e = lid; e < Q_TILE * PC_KEYS; e += PC_THREADS) {
            let i = e / PC_KEYS;
            let j = e % PC_KEYS;
            var pr = 0.0;
            if (i < nr && j < nt && t0 + j <= first_pos + i) {
                pr = exp(pc_s[e] * p.scale - head_max[i]);
            }
            pc_p[i * PC_P_PAD + j] = f16(pr);
        }
        for (var i = lid; i < Q_TILE * hd; i += PC_THREADS) {
            pc_o[(i / hd) * PC_DIM + i % hd] *= head_corr[i / hd];
        }
        pc_stage(lid, seq, kvh, t0, nt, true);
        workgroupBarrier();
        // The sums of the rounded probabilities P·V takes, beside the products.
        if (lid < Q_TILE) {
            var sum = 0.0;
            for (var j = 0u; j < PC_KEYS; j++) {
                sum += f32(pc_p[lid * PC_P_PAD + j]);
            }
            head_sum[lid] = head_sum[lid] * head_corr[lid] + sum;
        }
        for (var f = sg; f < o_frags; f += PC_SUBGROUPS) {
            let fr = f / o_cols;
            let fc = f % o_cols;
            let at = fr * F * PC_DIM + fc * F;
            var o = coopLoadT<PcC>(&pc_o[at], PC_DIM);
            for (var kk = 0u; kk < PC_KEYS; kk += F) {
                let a = coopLoadT<PcA>(&pc_p[fr * F * PC_P_PAD + kk], PC_P_PAD);
                let b = coopLoadT<PcB>(&pc_kv[kk * PC_QK_PAD + fc * F], PC_QK_PAD);
                o = coopMultiplyAdd(a, b, o);
            }
            coopStoreT(o, &pc_o[at], PC_DIM);
        }
        workgroupBarrier();
    }
    for (var i = lid; i < nr * hd; i += PC_THREADS) {
        let r = i / hd;
        out[((r0 + r) * p.q_heads + h) * hd + i % hd] = pc_o[r * PC_DIM + i % hd] / head_sum[r];
    }
}
