// Causal attention of every query row over its sequence's paged context, one workgroup
// per (row, query head). The context is read in chunks of WG keys: each thread scores one
// key, the chunk's probabilities go through workgroup memory, and thread d < head_dim
// accumulates output element d; an online softmax in f32 carries the running maximum and
// sum from chunk to chunk. Keys up to the row's own position are seen (causal); the new
// tokens' keys and values are already in the cache (kv_write runs first).

struct P {
    rows: u32, num_seqs: u32, q_heads: u32, kv_heads: u32, head_dim: u32, row_len: u32,
    block_size: u32, max_blocks: u32, scale: f32, max_splits: u32, q_tiles: u32,
}

@group(0) @binding(0) var<uniform> p: P;
@group(0) @binding(1) var<storage, read> qkv: array<f32>;
@group(0) @binding(2) var<storage, read> query_start_loc: array<i32>;
@group(0) @binding(3) var<storage, read> seq_lens: array<i32>;
@group(0) @binding(4) var<storage, read> block_tables: array<i32>;
@group(0) @binding(7) var<storage, read_write> out: array<f32>;
// Per (seq, query head, split): the split's running maximum, sum and unnormalized output.
@group(0) @binding(8) var<storage, read_write> parts: array<f32>;

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

// Decode steps (one query row per sequence) go through `decode`, split along the context
// (flash-decoding): one workgroup per (sequence, KV head, split) reads each key and value
// of its part of the context once for the whole query group, 16 bytes per load (head_dim
// a multiple of 8), in tiles staged in workgroup memory; `decode_reduce` merges the splits. A split covers at least MIN_PART keys, so the
// splits of a sequence depend on its length alone: a sequence is computed the same in
// any batch.
const MIN_PART: u32 = 32u;
// Rows of a key tile are padded by one vec4 so that threads scoring different keys read
// different banks. The host sizes `decode`'s tiles (TN keys, TILE_VECS vectors) to the
// adapter's workgroup memory; `prefill` takes 32 keys of head_dim <= 128.
override TILE_VECS: u32 = 1056u;
var<workgroup> qs: array<vec4<f32>, 512>;
var<workgroup> tile: array<vec4<f32>, TILE_VECS>;
// The values of `decode`'s tile, loaded with its keys.
var<workgroup> vtile: array<vec4<f32>, TILE_VECS>;
var<workgroup> sc: array<f32, 512>;
// Per query vector of the workgroup (a head of the group in `decode`, a row in `prefill`).
var<workgroup> head_max: array<f32, 16>;
var<workgroup> head_sum: array<f32, 16>;
var<workgroup> head_corr: array<f32, 16>;

// Piece i of the tile (8 elements; head_dim / 8 pieces per key) into its row.
fn put_piece(i: u32, w: W8) {
    let pieces = p.head_dim / 8u;
    let b = (i / pieces) * (p.head_dim / 4u + 1u) + (i % pieces) * 2u;
    tile[b] = w.lo;
    tile[b + 1u] = w.hi;
}

// Output elements per thread in `decode`: group * head_dim / WG, rounded up (at most 8).
override OUTS: u32 = 8u;
// Keys per tile of `decode` (32 for head_dim <= 128, 16 up to 256, half or a quarter of
// that where workgroup memory is short: shader::decode_tiles). A constant, so that its
// loops over a tile's scores have a fixed count the compiler unrolls, issuing their
// workgroup-memory loads together; a partial last tile is padded with zero keys and
// values, which add nothing (scores past the split are masked, probabilities are 0).
override TN: u32 = 32u;

// Piece i of the value tile of `decode`, laid out as `put_piece` lays out keys.
fn put_value_piece(i: u32, w: W8) {
    let pieces = p.head_dim / 8u;
    let b = (i / pieces) * (p.head_dim / 4u + 1u) + (i % pieces) * 2u;
    vtile[b] = w.lo;
    vtile[b + 1u] = w.hi;
}

// The online softmax steps of `decode` and `prefill`: one thread per query vector
// (< `vectors`), over a tile's `nt` scores in `sc` (rows of `tn`). This one moves the
// running maximum and sets the factor the vector's earlier sum and outputs take.
fn update_max(lid: u32, vectors: u32, nt: u32, tn: u32) {
    if (lid < vectors) {
        var mx = head_max[lid];
        for (var j = 0u; j < nt; j++) {
            mx = max(mx, sc[lid * tn + j]);
        }
        head_corr[lid] = exp(head_max[lid] - mx);
        head_max[lid] = mx;
    }
}

// The running sum, once `sc` holds the tile's probabilities.
fn update_sum(lid: u32, vectors: u32, nt: u32, tn: u32) {
    if (lid < vectors) {
        var sum = 0.0;
        for (var j = 0u; j < nt; j++) {
            sum += sc[lid * tn + j];
        }
        head_sum[lid] = head_sum[lid] * head_corr[lid] + sum;
    }
}

fn splits_of(keys: u32) -> u32 {
    return max(1u, min(p.max_splits, (keys + MIN_PART - 1u) / MIN_PART));
}

// Keys per split: whole tiles of 32.
fn part_of(keys: u32) -> u32 {
    let n = splits_of(keys);
    return ((keys + n - 1u) / n + 31u) / 32u * 32u;
}

fn parts_index(seq: u32, h: u32, split: u32) -> u32 {
    return ((seq * p.q_heads + h) * p.max_splits + split) * (p.head_dim + 2u);
}

@compute @workgroup_size(256)
fn decode(@builtin(workgroup_id) wg: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
          @builtin(local_invocation_index) lid: u32) {
    let idx = wg.y * nwg.x + wg.x;
    let split = idx % p.max_splits;
    let kvh = (idx / p.max_splits) % p.kv_heads;
    let seq = idx / (p.max_splits * p.kv_heads);
    if (seq >= p.num_seqs) {
        return;
    }
    let keys = u32(seq_lens[seq]);
    let part = part_of(keys);
    let t_begin = split * part;
    if (t_begin >= keys) {
        return;
    }
    let t_end = min(keys, t_begin + part);
    let hd = p.head_dim;
    let hd4 = hd / 4u;
    let stride = hd4 + 1u;
    let pieces = hd / 8u;
    let group = p.q_heads / p.kv_heads;
    // The group's query heads are consecutive in the row: h = kvh * group + g.
    for (var i = lid; i < group * hd4; i += WG) {
        let at = seq * p.row_len + kvh * group * hd + 4u * i;
        qs[i] = vec4<f32>(qkv[at], qkv[at + 1u], qkv[at + 2u], qkv[at + 3u]);
    }
    if (lid < group) {
        head_max[lid] = NEG_BIG;
        head_sum[lid] = 0.0;
    }
    // Output element o = lid + WG * q of the group's [group, head_dim] block. The
    // barrier after the first tile's loads also covers the query and head_* writes.
    var acc: array<f32, 8>;
    let g = lid / TN;
    let t = lid % TN;
    for (var t0 = t_begin; t0 < t_end; t0 += TN) {
        let nt = min(TN, t_end - t0);
        for (var i = lid; i < TN * pieces; i += WG) {
            var kp = W8(vec4<f32>(), vec4<f32>());
            var vp = kp;
            if (i < nt * pieces) {
                let at = cache_index(seq, t0 + i / pieces, kvh) / 8u + i % pieces;
                kp = kc_at8(at);
                vp = vc_at8(at);
            }
            put_piece(i, kp);
            put_value_piece(i, vp);
        }
        workgroupBarrier();
        if (g < group) {
            var s = NEG_BIG;
            if (t < nt) {
                var d = 0.0;
                for (var e = 0u; e < hd4; e++) {
                    d += dot(qs[g * hd4 + e], tile[t * stride + e]);
                }
                s = d * p.scale;
            }
            sc[lid] = s;
        }
        workgroupBarrier();
        update_max(lid, group, TN, TN);
        workgroupBarrier();
        if (g < group) {
            var pr = 0.0;
            if (t < nt) {
                pr = exp(sc[lid] - head_max[g]);
            }
            sc[lid] = pr;
        }
        workgroupBarrier();
        update_sum(lid, group, TN, TN);
        for (var q = 0u; q < OUTS; q++) {
            let o = lid + q * WG;
            if (o < group * hd) {
                let gg = o / hd;
                let d = o % hd;
                var a = acc[q] * head_corr[gg];
                for (var j = 0u; j < TN; j++) {
                    a += sc[gg * TN + j] * vtile[j * stride + d / 4u][d % 4u];
                }
                acc[q] = a;
            }
        }
        workgroupBarrier();
    }
    let whole = splits_of(keys) == 1u;
    for (var q = 0u; q < OUTS; q++) {
        let o = lid + q * WG;
        if (o < group * hd) {
            let h = kvh * group + o / hd;
            let d = o % hd;
            if (whole) {
                out[(seq * p.q_heads + h) * hd + d] = acc[q] / head_sum[o / hd];
            } else {
                parts[parts_index(seq, h, split) + 2u + d] = acc[q];
            }
        }
    }
    if (!whole && lid < group) {
        let at = parts_index(seq, kvh * group + lid, split);
        parts[at] = head_max[lid];
        parts[at + 1u] = head_sum[lid];
    }
}

// Merges the splits of `decode`: one workgroup per (sequence, query head). The splits'
// maxima and sums are read once, in parallel, into workgroup memory.
var<workgroup> split_max: array<f32, 64>;
var<workgroup> split_sum: array<f32, 64>;

@compute @workgroup_size(256)
fn decode_reduce(@builtin(workgroup_id) wg: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
                 @builtin(local_invocation_index) lid: u32) {
    let idx = wg.y * nwg.x + wg.x;
    let seq = idx / p.q_heads;
    let h = idx % p.q_heads;
    if (seq >= p.num_seqs) {
        return;
    }
    let keys = u32(seq_lens[seq]);
    if (splits_of(keys) == 1u) {
        return;
    }
    let used = (keys + part_of(keys) - 1u) / part_of(keys);
    if (lid < used) {
        let at = parts_index(seq, h, lid);
        split_max[lid] = parts[at];
        split_sum[lid] = parts[at + 1u];
    }
    workgroupBarrier();
    if (lid >= p.head_dim) {
        return;
    }
    var mx = NEG_BIG;
    for (var s = 0u; s < used; s++) {
        mx = max(mx, split_max[s]);
    }
    var sum = 0.0;
    var a = 0.0;
    for (var s = 0u; s < used; s++) {
        let c = exp(split_max[s] - mx);
        sum += split_sum[s] * c;
        a += parts[parts_index(seq, h, s) + 2u + lid] * c;
    }
    out[(seq * p.q_heads + h) * p.head_dim + lid] = a / sum;
}

// Prefill and mixed steps with head_dim <= 128 (a multiple of 8) go through `prefill`:
// one workgroup per (tile of 16 query rows of one sequence, query head) reads the
// context in tiles of 32 keys staged in workgroup memory, shared by the 16 rows, with an
// online softmax per row (flash attention, in f32 without matrix units).
const Q_TILE: u32 = 16u;

@compute @workgroup_size(256)
fn prefill(@builtin(workgroup_id) wg: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
           @builtin(local_invocation_index) lid: u32) {
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
    let hd4 = hd / 4u;
    let stride = hd4 + 1u;
    let pieces = hd / 8u;
    let tn = 32u;
    for (var i = lid; i < nr * hd4; i += WG) {
        let at = (r0 + i / hd4) * p.row_len + h * hd + 4u * (i % hd4);
        qs[i] = vec4<f32>(qkv[at], qkv[at + 1u], qkv[at + 2u], qkv[at + 3u]);
    }
    if (lid < Q_TILE) {
        head_max[lid] = NEG_BIG;
        head_sum[lid] = 0.0;
    }
    // Output element o = lid + WG * q of the tile's [Q_TILE, head_dim] block.
    var acc: array<f32, 8>;
    workgroupBarrier();
    for (var t0 = 0u; t0 < max_keys; t0 += tn) {
        let nt = min(tn, max_keys - t0);
        for (var i = lid; i < nt * pieces; i += WG) {
            put_piece(i, kc_at8(cache_index(seq, t0 + i / pieces, kvh) / 8u + i % pieces));
        }
        workgroupBarrier();
        // Scores: thread lid takes row lid / 16 and keys lid % 16 and lid % 16 + 16.
        let i = lid / 16u;
        for (var half = 0u; half < 2u; half++) {
            let j = lid % 16u + 16u * half;
            var s = NEG_BIG;
            if (i < nr && j < nt && t0 + j <= first_pos + i) {
                var d = 0.0;
                for (var e = 0u; e < hd4; e++) {
                    d += dot(qs[i * hd4 + e], tile[j * stride + e]);
                }
                s = d * p.scale;
            }
            sc[i * tn + j] = s;
        }
        workgroupBarrier();
        update_max(lid, nr, nt, tn);
        workgroupBarrier();
        for (var half = 0u; half < 2u; half++) {
            let j = lid % 16u + 16u * half;
            var pr = 0.0;
            if (i < nr && j < nt && t0 + j <= first_pos + i) {
                pr = exp(sc[i * tn + j] - head_max[i]);
            }
            sc[i * tn + j] = pr;
        }
        for (var v = lid; v < nt * pieces; v += WG) {
            put_piece(v, vc_at8(cache_index(seq, t0 + v / pieces, kvh) / 8u + v % pieces));
        }
        workgroupBarrier();
        update_sum(lid, nr, nt, tn);
        for (var q = 0u; q < 8u; q++) {
            let o = lid + q * WG;
            if (o < nr * hd) {
                let r = o / hd;
                let d = o % hd;
                var a = acc[q] * head_corr[r];
                for (var j = 0u; j < nt; j++) {
                    a += sc[r * tn + j] * tile[j * stride + d / 4u][d % 4u];
                }
                acc[q] = a;
            }
        }
        workgroupBarrier();
    }
    for (var q = 0u; q < 8u; q++) {
        let o = lid + q * WG;
        if (o < nr * hd) {
            out[((r0 + o / hd) * p.q_heads + h) * hd + o % hd] = acc[q] / head_sum[o / hd];
        }
    }
}
