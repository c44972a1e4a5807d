// A mixture of experts: routing, each slot's gated MLP through its expert, and the weighted
// sum of each row's slots. f32 activations; the experts' stacked matrices in the weight
// dtype (w_at). One thread per output and each slot on its own: a slot's result does not
// depend on the others of its step, and experts read once per slot rather than once per
// step is the price of this first, correctness-first version.

// flag: moe_route's renormalize, moe_combine's add. y_off: where moe_down's outputs start
// in `out`, which also holds the activations it reads (one workspace buffer cannot be bound
// twice).
struct P {
    rows: u32, experts: u32, k: u32, dim: u32, ffn: u32, flag: u32, n: u32, y_off: u32,
}

@group(0) @binding(0) var<uniform> p: P;
// Router logits (moe_route), rows (moe_gate_up), activations (moe_down) or slot outputs
// (moe_combine).
@group(0) @binding(1) var<storage, read> a: array<f32>;
@group(0) @binding(3) var<storage, read_write> ids: array<i32>;
@group(0) @binding(4) var<storage, read_write> probs: array<f32>;
@group(0) @binding(5) var<storage, read_write> out: array<f32>;

fn element(wg: vec3<u32>, nwg: vec3<u32>, lid: u32) -> u32 {
    return (wg.y * nwg.x + wg.x) * WG + lid;
}

// One thread per row: softmax over the experts, the k largest in descending order (the
// lower index first among equals), rescaled to sum to 1 where p.flag (renormalize).
@compute @workgroup_size(256)
fn moe_route(@builtin(workgroup_id) wg: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
             @builtin(local_invocation_index) lid: u32) {
    let r = element(wg, nwg, lid);
    if (r >= p.rows) {
        return;
    }
    let base = r * p.experts;
    var top = NEG_BIG;
    for (var e = 0u; e < p.experts; e++) {
        top = max(top, a[base + e]);
    }
    var sum = 0.0;
    for (var e = 0u; e < p.experts; e++) {
        sum += exp(a[base + e] - top);
    }
    var chosen = 0.0;
    for (var j = 0u; j < p.k; j++) {
        // The largest probability not yet chosen, compared as the CPU compares them (the
        // exponentials, so logits that round to one probability tie).
        var best = -1;
        var best_v = -1.0;
        for (var e = 0u; e < p.experts; e++) {
            var taken = false;
            for (var q = 0u; q < j; q++) {
                taken = taken || ids[r * p.k + q] == i32(e);
            }
            let v = exp(a[base + e] - top);
            if (!taken && v > best_v) {
                best = i32(e);
                best_v = v;
            }
        }
        let prob = best_v / sum;
        ids[r * p.k + j] = best;
        probs[r * p.k + j] = prob;
        chosen += prob;
    }
    if (p.flag != 0u) {
        for (var j = 0u; j < p.k; j++) {
            probs[r * p.k + j] /= chosen;
        }
    }
}

// out[s, c] = silu(gate_e · x[s / k]) * (up_e · x[s / k]) at column c < ffn of slot s's
// expert e, for n = slots * ffn outputs.
@compute @workgroup_size(256)
fn moe_gate_up(@builtin(workgroup_id) wg: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
               @builtin(local_invocation_index) lid: u32) {
    let i = element(wg, nwg, lid);
    if (i >= p.n) {
        return;
    }
    let s = i / p.ffn;
    let c = i - s * p.ffn;
    let e = u32(ids[s]);
    let x0 = (s / p.k) * p.dim;
    let g0 = (e * 2u * p.ffn + c) * p.dim;
    let u0 = g0 + p.ffn * p.dim;
    var g = 0.0;
    var u = 0.0;
    for (var kk = 0u; kk < p.dim; kk++) {
        let xv = a[x0 + kk];
        g += xv * w_at(g0 + kk);
        u += xv * w_at(u0 + kk);
    }
    out[i] = g / (1.0 + exp(-g)) * u;
}

// out[y_off + s * dim + c] = down_e[c] · act[s] for slot s's expert e, with act at the
// start of `out`; n = slots * dim outputs.
@compute @workgroup_size(256)
fn moe_down(@builtin(workgroup_id) wg: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
            @builtin(local_invocation_index) lid: u32) {
    let i = element(wg, nwg, lid);
    if (i >= p.n) {
        return;
    }
    let s = i / p.dim;
    let c = i - s * p.dim;
    let e = u32(ids[s]);
    let a0 = s * p.ffn;
    let w0 = (e * p.dim + c) * p.ffn;
    var acc = 0.0;
    for (var f = 0u; f < p.ffn; f++) {
        acc += out[a0 + f] * w_at(w0 + f);
    }
    out[p.y_off + i] = acc;
}

// out[r, c] = Σ_j probs[r * k + j] · y[r * k + j, c] in slot order (added to out where
// p.flag), with y at y_off in `a`; n = rows * dim outputs.
@compute @workgroup_size(256)
fn moe_combine(@builtin(workgroup_id) wg: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
               @builtin(local_invocation_index) lid: u32) {
    let i = element(wg, nwg, lid);
    if (i >= p.n) {
        return;
    }
    let r = i / p.dim;
    let c = i - r * p.dim;
    var acc = 0.0;
    for (var j = 0u; j < p.k; j++) {
        let s = r * p.k + j;
        acc += probs[s] * a[p.y_off + s * p.dim + c];
    }
    if (p.flag != 0u) {
        acc += out[i];
    }
    out[i] = acc;
}
