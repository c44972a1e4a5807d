// RMSNorm of rows (one workgroup per row), the residual add fused before it, and the
// per-head norm of query and key heads (one workgroup per head).

struct P { rows: u32, dim: u32, eps: f32, q_heads: u32, k_heads: u32, row_len: u32 }

@group(0) @binding(0) var<uniform> p: P;
@group(0) @binding(1) var<storage, read> x: array<f32>;
@group(0) @binding(2) var<storage, read> w: array<f32>;
@group(0) @binding(3) var<storage, read_write> out: array<f32>;
@group(0) @binding(4) var<storage, read_write> residual: array<f32>;
@group(0) @binding(5) var<storage, read> w_k: array<f32>;

fn inv_rms(ss: f32, lid: u32) -> f32 {
    return 1.0 / sqrt(wg_sum(ss, lid) / f32(p.dim) + p.eps);
}

@compute @workgroup_size(256)
fn rms_norm(@builtin(workgroup_id) wg: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
            @builtin(local_invocation_index) lid: u32 $SG_ARG) {
    $SG_INIT
    let row = wg.y * nwg.x + wg.x;
    if (row >= p.rows) {
        return;
    }
    let base = row * p.dim;
    var ss = 0.0;
    for (var c = lid; c < p.dim; c += WG) {
        let v = x[base + c];
        ss += v * v;
    }
    let inv = inv_rms(ss, lid);
    for (var c = lid; c < p.dim; c += WG) {
        out[base + c] = x[base + c] * inv * w[c];
    }
}

// residual += x, then out = rms_norm(residual) * w. Each thread reads back only the
// elements it wrote.
@compute @workgroup_size(256)
fn add_rms_norm(@builtin(workgroup_id) wg: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
                @builtin(local_invocation_index) lid: u32 $SG_ARG) {
    $SG_INIT
    let row = wg.y * nwg.x + wg.x;
    if (row >= p.rows) {
        return;
    }
    let base = row * p.dim;
    var ss = 0.0;
    for (var c = lid; c < p.dim; c += WG) {
        let v = residual[base + c] + x[base + c];
        residual[base + c] = v;
        ss += v * v;
    }
    let inv = inv_rms(ss, lid);
    for (var c = lid; c < p.dim; c += WG) {
        out[base + c] = residual[base + c] * inv * w[c];
    }
}

// add_rms_norm for dim a multiple of 4, at most 4 * WIDE_VECS * WG: each thread loads all
// its vectors of the row before it stores any, so that their loads are in flight together
// (the loop above waits for each load, not knowing that residual and x never overlap).
@group(0) @binding(6) var<storage, read> x4: array<vec4<f32>>;
@group(0) @binding(7) var<storage, read> w4: array<vec4<f32>>;
@group(0) @binding(8) var<storage, read_write> out4: array<vec4<f32>>;
@group(0) @binding(9) var<storage, read_write> residual4: array<vec4<f32>>;
const WIDE_VECS: u32 = 8u;

@compute @workgroup_size(256)
fn add_rms_norm_wide(@builtin(workgroup_id) wg: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
                     @builtin(local_invocation_index) lid: u32 $SG_ARG) {
    $SG_INIT
    let row = wg.y * nwg.x + wg.x;
    if (row >= p.rows) {
        return;
    }
    let dim4 = p.dim / 4u;
    let base = row * dim4;
    var v: array<vec4<f32>, WIDE_VECS>;
    for (var i = 0u; i < WIDE_VECS; i++) {
        let c = lid + i * WG;
        if (c < dim4) {
            v[i] = residual4[base + c] + x4[base + c];
        }
    }
    var ss = 0.0;
    for (var i = 0u; i < WIDE_VECS; i++) {
        let c = lid + i * WG;
        if (c < dim4) {
            residual4[base + c] = v[i];
            ss += dot(v[i], v[i]);
        }
    }
    let inv = inv_rms(ss, lid);
    for (var i = 0u; i < WIDE_VECS; i++) {
        let c = lid + i * WG;
        if (c < dim4) {
            out4[base + c] = v[i] * inv * w4[c];
        }
    }
}

// In place on the fused QKV rows in `out`: query heads scaled by w, key heads by w_k.
@compute @workgroup_size(256)
fn qk_norm(@builtin(workgroup_id) wg: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
           @builtin(local_invocation_index) lid: u32 $SG_ARG) {
    $SG_INIT
    let heads = p.q_heads + p.k_heads;
    let idx = wg.y * nwg.x + wg.x;
    if (idx >= p.rows * heads) {
        return;
    }
    let h = idx % heads;
    let base = (idx / heads) * p.row_len + h * p.dim;
    var ss = 0.0;
    for (var c = lid; c < p.dim; c += WG) {
        let v = out[base + c];
        ss += v * v;
    }
    let inv = inv_rms(ss, lid);
    for (var c = lid; c < p.dim; c += WG) {
        let g = select(w_k[c], w[c], h < p.q_heads);
        out[base + c] = out[base + c] * inv * g;
    }
}
