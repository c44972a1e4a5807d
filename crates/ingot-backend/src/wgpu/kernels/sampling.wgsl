// Token selection on the device, so a step sends back token ids instead of logits. One
// workgroup per row: `argmax` takes the first index of the row's largest logit; `sample`
// applies the row's edits and structured-output mask, then takes the argmax (temperature 0) or draws as
// crate::sampling::sample_row does. The draw's thresholds are integer keys of the relative
// probabilities found by radix select, and probability mass is summed in 2^-40 fixed point
// as two-word integers (WGSL has no 64-bit types): every sum is exact, so the draw picks
// the CPU reference's token for the same uniform draw and probabilities.

struct P { rows: u32, vocab: u32 }

struct SampleRow {
    temperature: f32,
    top_k: u32,
    top_p: f32,
    min_p: f32,
    uniform: f32,
    edit_start: u32,
    edit_end: u32,
    // 1 + the row's bitmask in `masks` (bit t allows token t), or 0.
    mask: u32,
}

struct LogitEdit { token: u32, bias: f32, repetition: f32, subtract: f32 }

@group(0) @binding(0) var<uniform> p: P;
@group(0) @binding(1) var<storage, read_write> logits: array<f32>;
@group(0) @binding(2) var<storage, read_write> out: array<i32>;
@group(0) @binding(3) var<storage, read> params: array<SampleRow>;
@group(0) @binding(4) var<storage, read> edits: array<LogitEdit>;
@group(0) @binding(5) var<storage, read> masks: array<u32>;

const NONE: u32 = 0xffffffffu;
var<workgroup> best_v: array<f32, WG>;
var<workgroup> best_i: array<u32, WG>;

// A row is read by one workgroup; to keep enough loads in flight from it, each pass over the
// row loads UNROLL elements per thread (i0, i0 + WG, ...) before it uses them. Element
// i0 + u·WG of the row at `base`, clamped into the row (callers skip those past its end).
const UNROLL: u32 = 8u;

fn load_row(base: u32, i0: u32) -> array<f32, UNROLL> {
    var v: array<f32, UNROLL>;
    for (var u = 0u; u < UNROLL; u++) {
        v[u] = logits[base + min(i0 + u * WG, p.vocab - 1u)];
    }
    return v;
}

// The first index of the largest of logits[base ..][.. vocab], in every thread. Each thread
// keeps the first maximum of its strided elements; the tree then prefers the larger value,
// and the smaller index among equals, so a row of equal values (or of -inf) gives 0 as on
// the CPU.
fn row_argmax(base: u32, lid: u32) -> u32 {
    var v = 0.0;
    var i = NONE;
    for (var i0 = lid; i0 < p.vocab; i0 += WG * UNROLL) {
        let x = load_row(base, i0);
        for (var u = 0u; u < UNROLL; u++) {
            let c = i0 + u * WG;
            if (c < p.vocab && (i == NONE || x[u] > v)) {
                v = x[u];
                i = c;
            }
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
    let best = workgroupUniformLoad(&best_i[0]);
    workgroupBarrier();
    return best;
}

@compute @workgroup_size(256)
fn argmax(@builtin(workgroup_id) wg: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
          @builtin(local_invocation_index) lid: u32) {
    let row = wg.y * nwg.x + wg.x;
    if (row >= p.rows) {
        return;
    }
    let best = row_argmax(row * p.vocab, lid);
    if (lid == 0u) {
        out[row] = i32(best);
    }
}

// 64-bit unsigned integers as (low, high) words.
fn add64(a: vec2<u32>, b: vec2<u32>) -> vec2<u32> {
    let lo = a.x + b.x;
    return vec2<u32>(lo, a.y + b.y + select(0u, 1u, lo < a.x));
}

fn sub64(a: vec2<u32>, b: vec2<u32>) -> vec2<u32> {
    return vec2<u32>(a.x - b.x, a.y - b.y - select(0u, 1u, a.x < b.x));
}

fn ge64(a: vec2<u32>, b: vec2<u32>) -> bool {
    return a.y > b.y || (a.y == b.y && a.x >= b.x);
}

fn is_zero64(a: vec2<u32>) -> bool {
    return a.x == 0u && a.y == 0u;
}

// a · b as (low, high) words, from 16-bit halves.
fn mul32(a: u32, b: u32) -> vec2<u32> {
    let a0 = a & 0xffffu;
    let a1 = a >> 16u;
    let b0 = b & 0xffffu;
    let b1 = b >> 16u;
    let p00 = a0 * b0;
    let mid = a0 * b1 + a1 * b0;
    let mid_carry = select(0u, 0x10000u, mid < a0 * b1);
    let lo = p00 + (mid << 16u);
    return vec2<u32>(lo, a1 * b1 + (mid >> 16u) + mid_carry + select(0u, 1u, lo < p00));
}

// floor(total · frac) for frac in [0, 1], exactly (crate::sampling::scaled): frac is
// m · 2^-shift with m < 2^24, and total < 2^58, so the product takes three words.
fn scaled(total: vec2<u32>, frac: f32) -> vec2<u32> {
    if (frac >= 1.0) {
        return total;
    }
    if (!(frac > 0.0)) {
        return vec2<u32>(0u);
    }
    let bits = bitcast<u32>(frac);
    let e = bits >> 23u;
    var m = bits & 0x7fffffu;
    var shift = 149u;
    if (e != 0u) {
        m |= 0x800000u;
        shift = 150u - e;
    }
    if (shift >= 96u) {
        return vec2<u32>(0u);
    }
    let a = mul32(total.x, m);
    let b = mul32(total.y, m);
    let w1 = a.y + b.x;
    var w = array<u32, 5>(a.x, w1, b.y + select(0u, 1u, w1 < a.y), 0u, 0u);
    let q = shift / 32u;
    let r = shift % 32u;
    if (r == 0u) {
        return vec2<u32>(w[q], w[q + 1u]);
    }
    return vec2<u32>((w[q] >> r) | (w[q + 1u] << (32u - r)),
                     (w[q + 1u] >> r) | (w[q + 2u] << (32u - r)));
}

// An integer key with the order of the floats.
fn order_key(x: f32) -> u32 {
    let b = bitcast<u32>(x);
    return select(b | 0x80000000u, ~b, (b & 0x80000000u) != 0u);
}

// floor(prob · 2^40) for a relative probability in [0, 1], from its bits: below 2^41.
fn mass_of(prob: f32) -> vec2<u32> {
    let bits = bitcast<u32>(prob);
    let e = bits >> 23u;
    // Zero, subnormals (below 2^-40 anyway), and NaN (as the CPU's cast) weigh nothing.
    if (e == 0u || e > 127u) {
        return vec2<u32>(0u);
    }
    let m = (bits & 0x7fffffu) | 0x800000u;
    if (e >= 110u) {
        let s = e - 110u;
        if (s == 0u) {
            return vec2<u32>(m, 0u);
        }
        return vec2<u32>(m << s, m >> (32u - s));
    }
    let t = 110u - e;
    if (t >= 24u) {
        return vec2<u32>(0u);
    }
    return vec2<u32>(m >> t, 0u);
}

// Bins of the radix select: a weight goes in as four 11-bit parts (masses are below 2^41),
// whose sums stay within 32 bits for vocabularies below 2^21; integer adds, so the order
// in which threads add does not matter.
var<workgroup> hist: array<atomic<u32>, 1024>;
var<workgroup> sel_digit: u32;
var<workgroup> sel_left: vec2<u32>;

fn bin_weight(b: u32) -> vec2<u32> {
    let p0 = atomicLoad(&hist[b]);
    let p1 = atomicLoad(&hist[256u + b]);
    let p2 = atomicLoad(&hist[512u + b]);
    let p3 = atomicLoad(&hist[768u + b]);
    let lo = add64(vec2<u32>(p0, 0u), vec2<u32>(p1 << 11u, p1 >> 21u));
    return add64(add64(lo, vec2<u32>(p2 << 22u, p2 >> 10u)), vec2<u32>(0u, p3 << 1u));
}

// The key at which the weight of the row's elements with key >= floor, taken from the
// largest key down, first reaches `goal` (>= 1 and at most their total): one 8-bit digit
// of the key per pass. The weight is 1 per element, or its mass.
fn radix_select(base: u32, floor: u32, goal: vec2<u32>, by_mass: bool, lid: u32) -> u32 {
    var prefix = 0u;
    var mask = 0u;
    var left = goal;
    for (var shift = 24u; shift < 32u; shift -= 8u) {
        for (var b = lid; b < 1024u; b += WG) {
            atomicStore(&hist[b], 0u);
        }
        workgroupBarrier();
        for (var i0 = lid; i0 < p.vocab; i0 += WG * UNROLL) {
            let x = load_row(base, i0);
            for (var u = 0u; u < UNROLL; u++) {
                let v = x[u];
                let key = order_key(v);
                if (i0 + u * WG < p.vocab && key >= floor && (key & mask) == prefix) {
                    let bin = (key >> shift) & 255u;
                    if (by_mass) {
                        let m = mass_of(v);
                        atomicAdd(&hist[bin], m.x & 0x7ffu);
                        atomicAdd(&hist[256u + bin], (m.x >> 11u) & 0x7ffu);
                        atomicAdd(&hist[512u + bin], ((m.x >> 22u) | (m.y << 10u)) & 0x7ffu);
                        atomicAdd(&hist[768u + bin], m.y >> 1u);
                    } else {
                        atomicAdd(&hist[bin], 1u);
                    }
                }
            }
        }
        workgroupBarrier();
        if (lid == 0u) {
            var above = vec2<u32>(0u);
            var b = 255u;
            for (; b > 0u; b--) {
                let h = bin_weight(b);
                if (ge64(add64(above, h), left)) {
                    break;
                }
                above = add64(above, h);
            }
            sel_digit = b;
            sel_left = sub64(left, above);
        }
        workgroupBarrier();
        prefix |= sel_digit << shift;
        mask |= 255u << shift;
        left = sel_left;
        workgroupBarrier();
    }
    return prefix;
}

var<workgroup> sums: array<vec2<u32>, WG>;
// The kept mass of the whole row, for the draw.
var<workgroup> kept_total: vec2<u32>;

// The workgroup's total of v, in every thread.
fn sum64(v: vec2<u32>, lid: u32) -> vec2<u32> {
    sums[lid] = v;
    workgroupBarrier();
    for (var s = WG / 2u; s > 0u; s /= 2u) {
        if (lid < s) {
            sums[lid] = add64(sums[lid], sums[lid + s]);
        }
        workgroupBarrier();
    }
    let t = workgroupUniformLoad(&sums[0]);
    workgroupBarrier();
    return t;
}

// The row is left holding the edited logits (temperature 0) or the relative
// probabilities exp((x - max) / temperature).
@compute @workgroup_size(256)
fn sample(@builtin(workgroup_id) wg: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
          @builtin(local_invocation_index) lid: u32) {
    let row = wg.y * nwg.x + wg.x;
    if (row >= p.rows) {
        return;
    }
    let base = row * p.vocab;
    let sp = params[row];
    // At most one edit per token: no two threads touch one logit.
    for (var e = sp.edit_start + lid; e < sp.edit_end; e += WG) {
        let ed = edits[e];
        let v = logits[base + ed.token] + ed.bias;
        let r = select(v * ed.repetition, v / ed.repetition, v > 0.0);
        logits[base + ed.token] = r - ed.subtract;
    }
    storageBarrier();
    if (sp.mask > 0u) {
        let m = (sp.mask - 1u) * ((p.vocab + 31u) / 32u);
        for (var i = lid; i < p.vocab; i += WG) {
            if (((masks[m + i / 32u] >> (i % 32u)) & 1u) == 0u) {
                logits[base + i] = bitcast<f32>(0xff800000u);
            }
        }
    }
    storageBarrier();
    let best = row_argmax(base, lid);
    if (sp.temperature == 0.0) {
        if (lid == 0u) {
            out[row] = i32(best);
        }
        return;
    }
    let mx = logits[base + best];
    let inv_t = 1.0 / sp.temperature;
    storageBarrier();
    for (var i0 = lid; i0 < p.vocab; i0 += WG * UNROLL) {
        let x = load_row(base, i0);
        for (var u = 0u; u < UNROLL; u++) {
            if (i0 + u * WG < p.vocab) {
                logits[base + i0 + u * WG] = exp((x[u] - mx) * inv_t);
            }
        }
    }
    storageBarrier();

    var threshold = 0u;
    if (sp.top_k > 0u && sp.top_k < p.vocab) {
        threshold = radix_select(base, 0u, vec2<u32>(sp.top_k, 0u), false, lid);
    }
    if (sp.top_p < 1.0) {
        var total = vec2<u32>(0u);
        var kept = vec2<u32>(0u);
        for (var i0 = lid; i0 < p.vocab; i0 += WG * UNROLL) {
            let x = load_row(base, i0);
            for (var u = 0u; u < UNROLL; u++) {
                if (i0 + u * WG < p.vocab) {
                    let m = mass_of(x[u]);
                    total = add64(total, m);
                    if (order_key(x[u]) >= threshold) {
                        kept = add64(kept, m);
                    }
                }
            }
        }
        total = sum64(total, lid);
        kept = sum64(kept, lid);
        var goal = scaled(total, sp.top_p);
        if (is_zero64(goal)) {
            goal = vec2<u32>(1u, 0u);
        }
        if (ge64(kept, goal)) {
            threshold = radix_select(base, threshold, goal, true, lid);
        }
    }

    // Each thread owns a contiguous run of ids, so the exclusive prefix sums of the runs'
    // kept masses order the kept tokens by id; the thread whose run holds the goal walks it.
    let run = (p.vocab + WG - 1u) / WG;
    let lo = min(lid * run, p.vocab);
    let hi = min(lo + run, p.vocab);
    var mine = vec2<u32>(0u);
    for (var i = lo; i < hi; i++) {
        let v = logits[base + i];
        if (order_key(v) >= threshold && v >= sp.min_p) {
            mine = add64(mine, mass_of(v));
        }
    }
    sums[lid] = mine;
    workgroupBarrier();
    if (lid == 0u) {
        var acc = vec2<u32>(0u);
        for (var t = 0u; t < WG; t++) {
            let m = sums[t];
            sums[t] = acc;
            acc = add64(acc, m);
        }
        kept_total = acc;
    }
    workgroupBarrier();
    let total = kept_total;
    let before = sums[lid];
    if (is_zero64(total)) {
        // Every token masked: nothing to draw from.
        if (lid == 0u) {
            out[row] = i32(best);
        }
        return;
    }
    var goal = scaled(total, sp.uniform);
    if (ge64(goal, total)) {
        goal = sub64(total, vec2<u32>(1u, 0u));
    }
    if (ge64(goal, before) && !ge64(goal, add64(before, mine))) {
        var acc = before;
        for (var i = lo; i < hi; i++) {
            let v = logits[base + i];
            if (order_key(v) >= threshold && v >= sp.min_p) {
                acc = add64(acc, mass_of(v));
                if (!ge64(goal, acc)) {
                    out[row] = i32(i);
                    break;
                }
            }
        }
    }
}
