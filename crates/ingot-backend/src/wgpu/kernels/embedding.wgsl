// out[i, c] = table[ids[i], c]: one thread per output element.

struct P { n: u32, dim: u32 }

@group(0) @binding(0) var<uniform> p: P;
@group(0) @binding(2) var<storage, read> ids: array<i32>;
@group(0) @binding(3) var<storage, read_write> out: array<f32>;

@compute @workgroup_size(256)
fn embedding(@builtin(workgroup_id) wg: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
             @builtin(local_invocation_index) lid: u32) {
    let i = (wg.y * nwg.x + wg.x) * WG + lid;
    if (i >= p.n * p.dim) {
        return;
    }
    let r = i / p.dim;
    out[i] = table_at(u32(ids[r]) * p.dim + (i - r * p.dim));
}
