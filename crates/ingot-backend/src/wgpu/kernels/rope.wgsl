// NeoX rotary embedding of the query and key heads of fused QKV rows, and the write of
// each token's key and value heads to its cache slot.

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
