// Causal attention of every query row over its sequence's paged context, one workgroup
// per (row, query head). The context is read in chunks of WG keys: each thread scores one
// key, the chunk's probabilities go through workgroup memory, and thread d < head_dim
// accumulates output element d; an online softmax in f32 carries the running maximum and
// sum from chunk to chunk. Keys up to the row's own position are seen (causal); the new
// tokens' keys and values are already in the cache (kv_write runs first).

struct P {
    rows: u32, num_seqs: u32, q_heads: u32, kv_heads: u32, head_dim: u32, row_len: u32,
    block_size: u32, max_blocks: u32, scale: f32,
}

@group(0) @binding(0) var<uniform> p: P;
@group(0) @binding(1) var<storage, read> qkv: array<f32>;
@group(0) @binding(2) var<storage, read> query_start_loc: array<i32>;
@group(0) @binding(3) var<storage, read> seq_lens: array<i32>;
@group(0) @binding(4) var<storage, read> block_tables: array<i32>;
@group(0) @binding(7) var<storage, read_write> out: array<f32>;

var<workgroup> q: array<f32, WG>;
var<workgroup> probs: array<f32, WG>;

// The sequence owning `row`: the largest s with query_start_loc[s] <= row.
fn seq_of(row: u32) -> u32 {
    var lo = 0u;
    var hi = p.num_seqs - 1u;
    while (lo < hi) {
        let mid = (lo + hi + 1u) / 2u;
        if (u32(query_start_loc[mid]) <= row) {
            lo = mid;
        } else {
            hi = mid - 1u;
        }
    }
    return lo;
}

// Index in the cache of element 0 of head `kvh` of the seq's token `t`.
fn cache_index(seq: u32, t: u32, kvh: u32) -> u32 {
    let block = u32(block_tables[seq * p.max_blocks + t / p.block_size]);
    return ((block * p.block_size + t % p.block_size) * p.kv_heads + kvh) * p.head_dim;
}

@compute @workgroup_size(256)
fn attention(@builtin(workgroup_id) wg: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
             @builtin(local_invocation_index) lid: u32 $SG_ARG) {
    $SG_INIT
    let idx = wg.y * nwg.x + wg.x;
    if (idx >= p.rows * p.q_heads) {
        return;
    }
    let row = idx / p.q_heads;
    let h = idx % p.q_heads;
    let kvh = h / (p.q_heads / p.kv_heads);
    let seq = seq_of(row);
    let start = u32(query_start_loc[seq]);
    let q_len = u32(query_start_loc[seq + 1u]) - start;
    let keys = u32(seq_lens[seq]) - q_len + (row - start) + 1u;
    if (lid < p.head_dim) {
        q[lid] = qkv[row * p.row_len + h * p.head_dim + lid];
    }
    workgroupBarrier();
    var m = NEG_BIG;
    var l = 0.0;
    var acc = 0.0;
    for (var t0 = 0u; t0 < keys; t0 += WG) {
        let t = t0 + lid;
        var score = NEG_BIG;
        if (t < keys) {
            let base = cache_index(seq, t, kvh);
            var d = 0.0;
            for (var e = 0u; e < p.head_dim; e++) {
                d += q[e] * kc_at(base + e);
            }
            score = d * p.scale;
        }
        let m_new = max(m, wg_max(score, lid));
        var pr = 0.0;
        if (t < keys) {
            pr = exp(score - m_new);
        }
        let corr = exp(m - m_new);
        l = l * corr + wg_sum(pr, lid);
        probs[lid] = pr;
        workgroupBarrier();
        if (lid < p.head_dim) {
            var a = acc * corr;
            let n = min(WG, keys - t0);
            for (var j = 0u; j < n; j++) {
                a += probs[j] * vc_at(cache_index(seq, t0 + j, kvh) + lid);
            }
            acc = a;
        }
        m = m_new;
        workgroupBarrier();
    }
    if (lid < p.head_dim) {
        out[(row * p.q_heads + h) * p.head_dim + lid] = acc / l;
    }
}
