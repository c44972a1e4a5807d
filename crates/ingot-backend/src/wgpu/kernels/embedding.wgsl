// out[i, c] = table[ids[i] - first, c] for the ids in first..first + rows (the part of the
// vocabulary the table holds; other rows are left as they are): one thread per element.

struct P { n: u32, dim: u32, first: u32, rows: u32 }

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
    let id = u32(ids[r]) - p.first;
    if (id < p.rows) {
        out[i] = table_at(id * p.dim + (i - r * p.dim));
    }
}
