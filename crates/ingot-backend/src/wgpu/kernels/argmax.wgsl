// out[r] = the first index of the largest of logits[r, ..vocab], one workgroup per row.
// Each thread keeps the first maximum of its strided elements; the tree then prefers the
// larger value, and the smaller index among equals, so a row of equal values (or of
// -inf) gives 0 as on the CPU.

struct P { rows: u32, vocab: u32 }

@group(0) @binding(0) var<uniform> p: P;
@group(0) @binding(1) var<storage, read> logits: array<f32>;
@group(0) @binding(2) var<storage, read_write> out: array<i32>;

const NONE: u32 = 0xffffffffu;
var<workgroup> best_v: array<f32, WG>;
var<workgroup> best_i: array<u32, WG>;

@compute @workgroup_size(256)
fn argmax(@builtin(workgroup_id) wg: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
          @builtin(local_invocation_index) lid: u32) {
    let row = wg.y * nwg.x + wg.x;
    if (row >= p.rows) {
        return;
    }
    var v = 0.0;
    var i = NONE;
    for (var c = lid; c < p.vocab; c += WG) {
        let x = logits[row * p.vocab + c];
        if (i == NONE || x > v) {
            v = x;
            i = c;
        }
    }
    best_v[lid] = v;
    best_i[lid] = i;
    workgroupBarrier();
    for (var s = WG / 2u; s > 0u; s /= 2u) {
        if (lid < s) {
            let ov = best_v[lid + s];
            let oi = best_i[lid + s];
            let mi = best_i[lid];
            if (oi != NONE && (mi == NONE || ov > best_v[lid] || (ov == best_v[lid] && oi < mi))) {
                best_v[lid] = ov;
                best_i[lid] = oi;
            }
        }
        workgroupBarrier();
    }
    if (lid == 0u) {
        out[row] = i32(best_i[0]);
    }
}
