
// The QKV product of decode steps with NeoX RoPE and the KV write in its epilogue (after
// matmul.wgsl, whose wide_sums it runs): a thread's two columns are elements i and
// i + head_dim / 2 of one head, the pair the rotation mixes, so the workgroup holds whole
// pairs. Query and key heads are rotated (rotary_dim = head_dim), every head is written to
// the qkv rows (ld apart), key and value heads also to their cache slots (slot -1: none),
// two consecutive elements at a time so that 16-bit caches get whole words. The sums,
// scale and bias are those of gemv_wide, the rotation that of rope_kv_write.

@group(0) @binding(7) var<storage, read> positions: array<i32>;
@group(0) @binding(8) var<storage, read> cos_sin: array<f32>;
@group(0) @binding(9) var<storage, read> slots: array<i32>;

// Column c of row r: its lane sums, scaled (NORM_X), plus its bias.
fn rope_column(column_set: u32, r: u32, c: u32, j: u32, per: u32) -> f32 {
    let at = (column_set * WIDE_COLS * p.m + r * WIDE_COLS + c) * per;
    var t = 0.0;
    for (var i = 0u; i < per; i++) {
        t += lane_sums[at + i];
    }
    var v = t * row_scale(r, per);
    if (p.has_bias != 0u) {
        v += bias[j];
    }
    return v;
}

@compute @workgroup_size(256)
fn gemv_wide_rope(@builtin(workgroup_id) wg: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
                  @builtin(local_invocation_index) lid: u32) {
    let half = p.head_dim / 2u;
    let pairs = p.n / 2u;
    let pair0 = (wg.y * nwg.x + wg.x) * WIDE_COLS;
    let jp = pair0 + lid / WIDE_LANES;
    let a = (jp / half) * p.head_dim + jp % half;
    let groups = p.k / 8u;
    wide_sums(lid, jp < pairs, a * groups, (a + half) * groups);
    let per = WIDE_LANES / min(8u, WIDE_LANES);
    let kv_len = p.kv_heads * p.head_dim;
    // One thread per (row, two consecutive pairs: elements i, i + 1 and their partners).
    for (var o = lid; o < p.m * WIDE_COLS / 2u; o += WG) {
        let r = o / (WIDE_COLS / 2u);
        let c = 2u * (o % (WIDE_COLS / 2u));
        let jp0 = pair0 + c;
        if (jp0 >= pairs) {
            continue;
        }
        let h = jp0 / half;
        let i = jp0 % half;
        let ja = h * p.head_dim + i;
        var va = vec2<f32>(rope_column(0u, r, c, ja, per), rope_column(0u, r, c + 1u, ja + 1u, per));
        var vb = vec2<f32>(rope_column(1u, r, c, ja + half, per),
                           rope_column(1u, r, c + 1u, ja + half + 1u, per));
        let row = p.row0 + r;
        if (h < p.q_heads + p.kv_heads) {
            let cs = u32(positions[row]) * p.head_dim;
            let cc = vec2<f32>(cos_sin[cs + i], cos_sin[cs + i + 1u]);
            let ss = vec2<f32>(cos_sin[cs + half + i], cos_sin[cs + half + i + 1u]);
            let ra = va * cc - vb * ss;
            let rb = vb * cc + va * ss;
            va = ra;
            vb = rb;
        }
        let base = row * p.ld + ja;
        out[base] = va.x;
        out[base + 1u] = va.y;
        out[base + half] = vb.x;
        out[base + half + 1u] = vb.y;
        let slot = slots[row];
        if (slot >= 0 && h >= p.q_heads) {
            if (h < p.q_heads + p.kv_heads) {
                let dst = u32(slot) * kv_len + (h - p.q_heads) * p.head_dim + i;
                kc_set2(dst, va.x, va.y);
                kc_set2(dst + half, vb.x, vb.y);
            } else {
                let dst = u32(slot) * kv_len + (h - p.q_heads - p.kv_heads) * p.head_dim + i;
                vc_set2(dst, va.x, va.y);
                vc_set2(dst + half, vb.x, vb.y);
            }
        }
    }
}
