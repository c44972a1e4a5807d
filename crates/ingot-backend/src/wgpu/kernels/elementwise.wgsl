// Element-wise ops, one thread per output element.

struct P { n: u32, width: u32 }

@group(0) @binding(0) var<uniform> p: P;
@group(0) @binding(1) var<storage, read> a: array<f32>;
@group(0) @binding(2) var<storage, read> idx: array<i32>;
@group(0) @binding(3) var<storage, read_write> out: array<f32>;

fn element(wg: vec3<u32>, nwg: vec3<u32>, lid: u32) -> u32 {
    return (wg.y * nwg.x + wg.x) * WG + lid;
}

// out += a over n elements.
@compute @workgroup_size(256)
fn add_assign(@builtin(workgroup_id) wg: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
              @builtin(local_invocation_index) lid: u32) {
    let i = element(wg, nwg, lid);
    if (i < p.n) {
        out[i] += a[i];
    }
}

// out[r, c] = silu(a[r, c]) * a[r, width + c] for n = rows * width outputs.
@compute @workgroup_size(256)
fn silu_mul(@builtin(workgroup_id) wg: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
            @builtin(local_invocation_index) lid: u32) {
    let i = element(wg, nwg, lid);
    if (i >= p.n) {
        return;
    }
    let r = i / p.width;
    let c = i - r * p.width;
    let g = a[2u * r * p.width + c];
    out[i] = g / (1.0 + exp(-g)) * a[(2u * r + 1u) * p.width + c];
}

// out[r, c] = a[idx[r], c] for n = rows * width outputs.
@compute @workgroup_size(256)
fn gather_rows(@builtin(workgroup_id) wg: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
               @builtin(local_invocation_index) lid: u32) {
    let i = element(wg, nwg, lid);
    if (i >= p.n) {
        return;
    }
    let r = i / p.width;
    out[i] = a[u32(idx[r]) * p.width + (i - r * p.width)];
}

// out[s, c] = sum of a[r, c] over rows r in idx[s]..idx[s+1] (query_start_loc), in row
// order, for n = num_seqs * width outputs.
@compute @workgroup_size(256)
fn segment_sum(@builtin(workgroup_id) wg: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
               @builtin(local_invocation_index) lid: u32) {
    let i = element(wg, nwg, lid);
    if (i >= p.n) {
        return;
    }
    let s = i / p.width;
    let c = i - s * p.width;
    var acc = 0.0;
    for (var r = u32(idx[s]); r < u32(idx[s + 1u]); r++) {
        acc += a[r * p.width + c];
    }
    out[i] = acc;
}
