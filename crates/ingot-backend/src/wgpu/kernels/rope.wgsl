// NeoX rotary embedding of the query and key heads of fused QKV rows, and the write of
// each token's key and value heads to its cache slot: apart, or in one pass.

struct P { rows: u32, q_heads: u32, kv_heads: u32, head_dim: u32, rot: u32, row_len: u32 }

@group(0) @binding(0) var<uniform> p: P;
@group(0) @binding(1) var<storage, read> positions: array<i32>;
@group(0) @binding(2) var<storage, read> cos_sin: array<f32>;
@group(0) @binding(3) var<storage, read_write> qkv: array<f32>;
@group(0) @binding(4) var<storage, read> slots: array<i32>;
@group(0) @binding(7) var<storage, read> qkv_in: array<f32>;

// One thread per (row, head, i < rot / 2): rotates the pair (i, i + rot / 2).
@compute @workgroup_size(256)
fn rope(@builtin(workgroup_id) wg: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
        @builtin(local_invocation_index) lid: u32) {
    let half = p.rot / 2u;
    let heads = p.q_heads + p.kv_heads;
    let t = (wg.y * nwg.x + wg.x) * WG + lid;
    if (t >= p.rows * heads * half) {
        return;
    }
    let i = t % half;
    let h = (t / half) % heads;
    let row = t / (half * heads);
    let cs = u32(positions[row]) * p.rot;
    let c = cos_sin[cs + i];
    let s = cos_sin[cs + half + i];
    let base = row * p.row_len + h * p.head_dim;
    let a = qkv[base + i];
    let b = qkv[base + i + half];
    qkv[base + i] = a * c - b * s;
    qkv[base + i + half] = b * c + a * s;
}

// One thread per (row, pair of elements of the key and value heads); slot -1 is skipped
// (padding rows). Pairs keep the writes of 16-bit caches whole words.
@compute @workgroup_size(256)
fn kv_write(@builtin(workgroup_id) wg: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
            @builtin(local_invocation_index) lid: u32) {
    let kv_len = p.kv_heads * p.head_dim;
    let pairs = kv_len / 2u;
    let t = (wg.y * nwg.x + wg.x) * WG + lid;
    if (t >= p.rows * pairs) {
        return;
    }
    let row = t / pairs;
    let e = 2u * (t - row * pairs);
    let slot = slots[row];
    if (slot < 0) {
        return;
    }
    let src = row * p.row_len + p.q_heads * p.head_dim + e;
    let dst = u32(slot) * kv_len + e;
    kc_set2(dst, qkv_in[src], qkv_in[src + 1u]);
    vc_set2(dst, qkv_in[src + kv_len], qkv_in[src + kv_len + 1u]);
}

// rope then kv_write in one pass, for rot a multiple of 4: one thread per (row, query, key
// or value head, pair 2j of the head). A thread with 2j < rot / 2 rotates the pairs
// (2j, 2j + rot / 2) and (2j + 1, 2j + 1 + rot / 2), four elements no other thread
// touches, so that key heads reach the cache in whole pairs; key pairs past rot are
// copied, value pairs copied.
@compute @workgroup_size(256)
fn rope_kv_write(@builtin(workgroup_id) wg: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
                 @builtin(local_invocation_index) lid: u32) {
    let pairs = p.head_dim / 2u;
    let heads = p.q_heads + 2u * p.kv_heads;
    let t = (wg.y * nwg.x + wg.x) * WG + lid;
    if (t >= p.rows * heads * pairs) {
        return;
    }
    let e = 2u * (t % pairs);
    let h = (t / pairs) % heads;
    let row = t / (pairs * heads);
    let slot = slots[row];
    let base = row * p.row_len + h * p.head_dim;
    let kv_len = p.kv_heads * p.head_dim;
    if (h >= p.q_heads + p.kv_heads) {
        if (slot >= 0) {
            let dst = u32(slot) * kv_len + (h - p.q_heads - p.kv_heads) * p.head_dim + e;
            vc_set2(dst, qkv[base + e], qkv[base + e + 1u]);
        }
        return;
    }
    let key = h >= p.q_heads && slot >= 0;
    let dst = u32(slot) * kv_len + (h - p.q_heads) * p.head_dim + e;
    let half = p.rot / 2u;
    if (e < half) {
        let cs = u32(positions[row]) * p.rot;
        let c = vec2<f32>(cos_sin[cs + e], cos_sin[cs + e + 1u]);
        let s = vec2<f32>(cos_sin[cs + half + e], cos_sin[cs + half + e + 1u]);
        let a = vec2<f32>(qkv[base + e], qkv[base + e + 1u]);
        let b = vec2<f32>(qkv[base + half + e], qkv[base + half + e + 1u]);
        let ra = a * c - b * s;
        let rb = b * c + a * s;
        qkv[base + e] = ra.x;
        qkv[base + e + 1u] = ra.y;
        qkv[base + half + e] = rb.x;
        qkv[base + half + e + 1u] = rb.y;
        if (key) {
            kc_set2(dst, ra.x, ra.y);
            kc_set2(dst + half, rb.x, rb.y);
        }
    } else if (e >= p.rot && key) {
        kc_set2(dst, qkv[base + e], qkv[base + e + 1u]);
    }
}
