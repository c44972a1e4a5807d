// out[r, col + j] = Σ_k x[r, k] · w[j, k] (+ bias[j]), rows of `out` ld apart; x and out f32,
// w in the weight dtype (w_at), accumulation in f32.

// gemv_wide computes rows row0 .. row0 + m of the product (the others: row0 = 0); eps is
// its NORM_X epsilon; gemv_wide_rope (qkv_rope.wgsl) also reads the head counts and size.
struct P {
    m: u32, n: u32, k: u32, ld: u32, col: u32, has_bias: u32, row0: u32, eps: f32,
    q_heads: u32, kv_heads: u32, head_dim: u32,
}

@group(0) @binding(0) var<uniform> p: P;
@group(0) @binding(1) var<storage, read> x: array<f32>;
@group(0) @binding(3) var<storage, read> bias: array<f32>;
@group(0) @binding(4) var<storage, read_write> out: array<f32>;

const GEMV_ROWS: u32 = 8u;
// A GEMV workgroup computes GEMV_COLS output columns; LANES consecutive threads share
// each column, reading consecutive elements (coalesced on GPUs, one vector load on CPU
// implementations).
const GEMV_COLS: u32 = 32u;
const LANES: u32 = 8u;
var<workgroup> partial: array<f32, 2048>; // [GEMV_ROWS][WG]

fn store(r: u32, j: u32, v: f32) {
    var s = v;
    if (p.has_bias != 0u) {
        s += bias[j];
    }
    let at = (p.row0 + r) * p.ld + p.col + j;
    if (ADD_OUT) {
        s += out[at];
    }
    out[at] = s;
}

// Up to GEMV_ROWS rows (decode steps): each weight row is read once for every input row,
// and a workgroup meets at one barrier.
@compute @workgroup_size(256)
fn gemv(@builtin(workgroup_id) wg: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
        @builtin(local_invocation_index) lid: u32) {
    let lane = lid % LANES;
    let j = (wg.y * nwg.x + wg.x) * GEMV_COLS + lid / LANES;
    // Rows 0-3 and 4-7 in two vectors: registers on every implementation (an indexed
    // array ends up in memory on some). Rows past m read row m - 1 and are not stored.
    var lo = vec4<f32>();
    var hi = vec4<f32>();
    if (j < p.n) {
        let wrow = j * p.k;
        let last = p.m - 1u;
        if (p.m == 1u) {
            var a = 0.0;
            for (var kk = lane; kk < p.k; kk += LANES) {
                a += x[kk] * w_at(wrow + kk);
            }
            lo.x = a;
        } else {
            for (var kk = lane; kk < p.k; kk += LANES) {
                let wv = w_at(wrow + kk);
                lo += wv * vec4<f32>(x[kk], x[min(1u, last) * p.k + kk],
                                     x[min(2u, last) * p.k + kk], x[min(3u, last) * p.k + kk]);
                if (p.m > 4u) {
                    hi += wv * vec4<f32>(x[4u * p.k + kk], x[min(5u, last) * p.k + kk],
                                         x[min(6u, last) * p.k + kk], x[min(7u, last) * p.k + kk]);
                }
            }
        }
    }
    partial[lid] = lo.x;
    partial[WG + lid] = lo.y;
    partial[2u * WG + lid] = lo.z;
    partial[3u * WG + lid] = lo.w;
    partial[4u * WG + lid] = hi.x;
    partial[5u * WG + lid] = hi.y;
    partial[6u * WG + lid] = hi.z;
    partial[7u * WG + lid] = hi.w;
    workgroupBarrier();
    if (lid < GEMV_COLS * p.m) {
        let c = lid % GEMV_COLS;
        let r = lid / GEMV_COLS;
        let jj = (wg.y * nwg.x + wg.x) * GEMV_COLS + c;
        if (jj < p.n) {
            var t = 0.0;
            for (var l = 0u; l < LANES; l++) {
                t += partial[r * WG + c * LANES + l];
            }
            store(r, jj, t);
        }
    }
}

// The GEMV for k a multiple of 8: each thread reads 8 weights (16 bytes at 16 bits) at a
// time, WIDE_LANES threads per column read WIDE_LANES consecutive 16-byte pieces of its
// row. Each thread takes two columns, WIDE_COLS apart, and has two pieces of each in
// flight; the x pieces it loads serve both. The host sets WIDE_LANES (a power of two, at
// most 64) per product shape. The sums of a row do not depend on m (a row is computed the
// same alone or in a batch).
//
// With SILU_MUL the weights are the gated MLP's [gate; up] (2n rows): a thread's two
// columns are gate column j and up column n + j, and the workgroup writes
// silu(gate) * up to column j (n columns of output, no bias). The sums are the same as
// the plain product's, so the output equals gemv_wide then silu_mul.
//
// With NORM_X each row of x is taken divided by its root mean square (an RMSNorm whose
// weights are folded into w): the sums of squares come from the x pieces the threads of
// the first column load anyway, and the sums are scaled at the end. With ADD_OUT the
// product is added to out (out += x · wᵀ, the residual stream), as add_assign after the
// plain product would.
@group(0) @binding(5) var<storage, read> x4: array<vec4<f32>>;
override WIDE_LANES: u32 = 32u;
override WIDE_COLS: u32 = WG / WIDE_LANES;
override SILU_MUL: bool = false;
override NORM_X: bool = false;
// Set for dispatches of one row: that pipeline holds none of the batched path's registers
// (H100 through Vulkan, B=1 with the norm folded in: 131 tok/s without it, 137 with).
override ONE_ROW: bool = false;
override ADD_OUT: bool = false;
// [column set][row][thread] sums, then a column's lane sums added 8 at a time, then those
// (two short chains, not one of WIDE_LANES).
var<workgroup> wide_partial: array<f32, 4096>;
// With NORM_X it also holds, past the lane sums (at SQUARES), the first column's threads'
// [row][lane] sums of squares of x and then their sums of 8: no workgroup memory of their
// own, which cost batched products through Vulkan ~15% (the plain ones too).
var<workgroup> lane_sums: array<f32, 1088>;

// Where the sums of squares start in lane_sums (after 2 * WIDE_COLS * m * per lane sums),
// and where their sums of 8 start.
fn squares_at() -> u32 {
    return 2u * WIDE_COLS * p.m * (WIDE_LANES / min(8u, WIDE_LANES));
}

fn square_sums_at() -> u32 {
    return squares_at() + p.m * WIDE_LANES;
}

// Piece g (8 elements) of row r of x.
fn x_piece(r: u32, g: u32) -> W8 {
    let b = (p.row0 + r) * (p.k / 4u) + 2u * g;
    return W8(x4[b], x4[b + 1u]);
}

fn dot8(x: W8, w: W8) -> f32 {
    return dot(x.lo, w.lo) + dot(x.hi, w.hi);
}

// Rows r0 .. r0 + 4 (past m: row m - 1) of x times the weights w and v of piece g.
struct Dots4 { w: vec4<f32>, v: vec4<f32> }

fn dots4(r0: u32, last: u32, g: u32, w: W8, v: W8) -> Dots4 {
    var d: Dots4;
    for (var i = 0u; i < 4u; i++) {
        let x = x_piece(min(r0 + i, last), g);
        d.w[i] = dot8(x, w);
        d.v[i] = dot8(x, v);
    }
    return d;
}

// Those rows' pieces g times themselves (NORM_X's sums of squares).
fn squares4(r0: u32, last: u32, g: u32) -> vec4<f32> {
    var s: vec4<f32>;
    for (var i = 0u; i < 4u; i++) {
        let x = x_piece(min(r0 + i, last), g);
        s[i] = dot8(x, x);
    }
    return s;
}

// The sums of the wide GEMV: the thread's two columns start at weight pieces base_a and
// base_b (valid: it has columns), each row of x read once for both; at the end lane_sums
// holds [column set][row][column][lane group] sums (and with NORM_X the rows' sums of
// squares), after a barrier. Rows 0-3 and 4-7 of both columns; pieces at even and odd
// steps in separate sums (two loads in flight), added at the end.
fn wide_sums(lid: u32, valid: bool, base_a: u32, base_b: u32) {
    let lane = lid % WIDE_LANES;
    let groups = p.k / 8u;
    let l = WIDE_LANES;
    var a_lo = vec4<f32>();
    var a_hi = vec4<f32>();
    var b_lo = vec4<f32>();
    var b_hi = vec4<f32>();
    // NORM_X: sums of squares of rows 0-3 and 4-7 of the x pieces this thread loads, in
    // one chain (the same order at one row and in a batch).
    var s_lo = vec4<f32>();
    var s_hi = vec4<f32>();
    if (valid) {
        let last = p.m - 1u;
        var g = lane;
        if (ONE_ROW) {
            var a = vec2<f32>();
            var b = vec2<f32>();
            var s = 0.0;
            // Four steps a turn (eight weight loads in flight), steps 0 and 2 into a.x and
            // 1 and 3 into a.y: the order of additions of each sum is that of the two-step
            // turns below and of the batched path, so rows stay bitwise the same.
            for (; g + 3u * l < groups; g += 4u * l) {
                let w0 = w_at8(base_a + g);
                let w1 = w_at8(base_a + g + l);
                let w2 = w_at8(base_a + g + 2u * l);
                let w3 = w_at8(base_a + g + 3u * l);
                let v0 = w_at8(base_b + g);
                let v1 = w_at8(base_b + g + l);
                let v2 = w_at8(base_b + g + 2u * l);
                let v3 = w_at8(base_b + g + 3u * l);
                let x0 = x_piece(0u, g);
                let x1 = x_piece(0u, g + l);
                let x2 = x_piece(0u, g + 2u * l);
                let x3 = x_piece(0u, g + 3u * l);
                a += vec2<f32>(dot8(x0, w0), dot8(x1, w1));
                b += vec2<f32>(dot8(x0, v0), dot8(x1, v1));
                a += vec2<f32>(dot8(x2, w2), dot8(x3, w3));
                b += vec2<f32>(dot8(x2, v2), dot8(x3, v3));
                if (NORM_X) {
                    s += dot8(x0, x0);
                    s += dot8(x1, x1);
                    s += dot8(x2, x2);
                    s += dot8(x3, x3);
                }
            }
            for (; g + l < groups; g += 2u * l) {
                let w0 = w_at8(base_a + g);
                let w1 = w_at8(base_a + g + l);
                let v0 = w_at8(base_b + g);
                let v1 = w_at8(base_b + g + l);
                let x0 = x_piece(0u, g);
                let x1 = x_piece(0u, g + l);
                a += vec2<f32>(dot8(x0, w0), dot8(x1, w1));
                b += vec2<f32>(dot8(x0, v0), dot8(x1, v1));
                if (NORM_X) {
                    s += dot8(x0, x0);
                    s += dot8(x1, x1);
                }
            }
            if (g < groups) {
                let x0 = x_piece(0u, g);
                a.x += dot8(x0, w_at8(base_a + g));
                b.x += dot8(x0, w_at8(base_b + g));
                if (NORM_X) {
                    s += dot8(x0, x0);
                }
            }
            a_lo.x = a.x + a.y;
            b_lo.x = b.x + b.y;
            s_lo.x = s;
        } else {
            var a_lo1 = vec4<f32>();
            var a_hi1 = vec4<f32>();
            var b_lo1 = vec4<f32>();
            var b_hi1 = vec4<f32>();
            for (; g + l < groups; g += 2u * l) {
                let w0 = w_at8(base_a + g);
                let w1 = w_at8(base_a + g + l);
                let v0 = w_at8(base_b + g);
                let v1 = w_at8(base_b + g + l);
                let d0 = dots4(0u, last, g, w0, v0);
                let d1 = dots4(0u, last, g + l, w1, v1);
                a_lo += d0.w;
                b_lo += d0.v;
                a_lo1 += d1.w;
                b_lo1 += d1.v;
                if (NORM_X) {
                    s_lo += squares4(0u, last, g);
                    s_lo += squares4(0u, last, g + l);
                }
                if (p.m > 4u) {
                    let e0 = dots4(4u, last, g, w0, v0);
                    let e1 = dots4(4u, last, g + l, w1, v1);
                    a_hi += e0.w;
                    b_hi += e0.v;
                    a_hi1 += e1.w;
                    b_hi1 += e1.v;
                    if (NORM_X) {
                        s_hi += squares4(4u, last, g);
                        s_hi += squares4(4u, last, g + l);
                    }
                }
            }
            if (g < groups) {
                let w0 = w_at8(base_a + g);
                let v0 = w_at8(base_b + g);
                let d0 = dots4(0u, last, g, w0, v0);
                a_lo += d0.w;
                b_lo += d0.v;
                if (NORM_X) {
                    s_lo += squares4(0u, last, g);
                }
                if (p.m > 4u) {
                    let e0 = dots4(4u, last, g, w0, v0);
                    a_hi += e0.w;
                    b_hi += e0.v;
                    if (NORM_X) {
                        s_hi += squares4(4u, last, g);
                    }
                }
            }
            a_lo += a_lo1;
            a_hi += a_hi1;
            b_lo += b_lo1;
            b_hi += b_hi1;
        }
    }
    // The first column's threads cover every piece of x once.
    if (NORM_X && lid < WIDE_LANES) {
        for (var i = 0u; i < 4u; i++) {
            if (i < p.m) {
                lane_sums[squares_at() + i * WIDE_LANES + lid] = s_lo[i];
            }
            if (4u + i < p.m) {
                lane_sums[squares_at() + (4u + i) * WIDE_LANES + lid] = s_hi[i];
            }
        }
    }
    for (var i = 0u; i < 4u; i++) {
        wide_partial[i * WG + lid] = a_lo[i];
        wide_partial[(4u + i) * WG + lid] = a_hi[i];
        wide_partial[(8u + i) * WG + lid] = b_lo[i];
        wide_partial[(12u + i) * WG + lid] = b_hi[i];
    }
    workgroupBarrier();
    // Sums of 8 lanes (or all of them, when fewer), then each column's total; o counts
    // (column set, row, column, lane group).
    let eight = min(8u, WIDE_LANES);
    let per = WIDE_LANES / eight;
    let per_set = WIDE_COLS * p.m * per;
    for (var o = lid; o < 2u * per_set; o += WG) {
        let r = (o % per_set) / (per * WIDE_COLS);
        let at = ((o / per_set) * 8u + r) * WG + (o % (per * WIDE_COLS)) * eight;
        var t = 0.0;
        for (var i = 0u; i < eight; i++) {
            t += wide_partial[at + i];
        }
        lane_sums[o] = t;
    }
    if (NORM_X) {
        for (var o = lid; o < p.m * per; o += WG) {
            var t = 0.0;
            for (var i = 0u; i < eight; i++) {
                t += lane_sums[squares_at() + o * eight + i];
            }
            lane_sums[square_sums_at() + o] = t;
        }
    }
    workgroupBarrier();
}

@compute @workgroup_size(256)
fn gemv_wide(@builtin(workgroup_id) wg: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
             @builtin(local_invocation_index) lid: u32) {
    let col0 = (wg.y * nwg.x + wg.x) * select(2u, 1u, SILU_MUL) * WIDE_COLS;
    let j = col0 + lid / WIDE_LANES;
    let groups = p.k / 8u;
    // Columns j and j + WIDE_COLS (SILU_MUL: gate j and up n + j); a second column past n
    // repeats the first and is not stored.
    let jb = select(j + WIDE_COLS, j + p.n, SILU_MUL);
    let base_b = select(j, jb, SILU_MUL || jb < p.n) * groups;
    wide_sums(lid, j < p.n, j * groups, base_b);
    let per = WIDE_LANES / min(8u, WIDE_LANES);
    if (SILU_MUL) {
        let up = WIDE_COLS * p.m * per;
        for (var o = lid; o < WIDE_COLS * p.m; o += WG) {
            let jj = col0 + o % WIDE_COLS;
            if (jj < p.n) {
                var g = 0.0;
                var u = 0.0;
                for (var i = 0u; i < per; i++) {
                    g += lane_sums[o * per + i];
                    u += lane_sums[up + o * per + i];
                }
                let scale = row_scale(o / WIDE_COLS, per);
                g *= scale;
                u *= scale;
                out[(p.row0 + o / WIDE_COLS) * p.ld + p.col + jj] = g / (1.0 + exp(-g)) * u;
            }
        }
        return;
    }
    for (var o = lid; o < 2u * WIDE_COLS * p.m; o += WG) {
        let in_set = o % (WIDE_COLS * p.m);
        let jj = col0 + (o / (WIDE_COLS * p.m)) * WIDE_COLS + in_set % WIDE_COLS;
        if (jj < p.n) {
            var t = 0.0;
            for (var i = 0u; i < per; i++) {
                t += lane_sums[o * per + i];
            }
            store(in_set / WIDE_COLS, jj, t * row_scale(in_set / WIDE_COLS, per));
        }
    }
}

// NORM_X: 1 / rms of row r of x (as rms_norm computes it), from its `per` sums; else 1.
fn row_scale(r: u32, per: u32) -> f32 {
    if (!NORM_X) {
        return 1.0;
    }
    var ss = 0.0;
    for (var i = 0u; i < per; i++) {
        ss += lane_sums[square_sums_at() + r * per + i];
    }
    return 1.0 / sqrt(ss / f32(p.k) + p.eps);
}

// Columns j, j + 16, j + 32 and j + 48 of row r, those inside the product.
fn store4(r: u32, j: u32, v: vec4<f32>) {
    if (r >= p.m) {
        return;
    }
    for (var q = 0u; q < 4u; q++) {
        if (j + 16u * q < p.n) {
            store(r, j + 16u * q, v[q]);
        }
    }
}

// Tiles of 64 x 64 outputs, 32 deep along k, staged in workgroup memory k-major (so
// neighbouring threads read neighbouring words); each thread computes 4 x 4 outputs 16
// rows and 16 columns apart.
const TILE: u32 = 64u;
const DEPTH: u32 = 32u;
var<workgroup> xs: array<f32, 2048>;
var<workgroup> ws: array<f32, 2048>;

@compute @workgroup_size(256)
fn gemm(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let row0 = wg.y * TILE;
    let col0 = wg.x * TILE;
    let tx = lid % 16u;
    let ty = lid / 16u;
    // Output rows row0 + ty + 16 i in c0..c3, columns col0 + tx + 16 jj in their lanes.
    var c0 = vec4<f32>();
    var c1 = vec4<f32>();
    var c2 = vec4<f32>();
    var c3 = vec4<f32>();
    for (var k0 = 0u; k0 < p.k; k0 += DEPTH) {
        for (var e = lid; e < TILE * DEPTH; e += WG) {
            let t = e / DEPTH;
            let kk = k0 + e % DEPTH;
            var xv = 0.0;
            if (row0 + t < p.m && kk < p.k) {
                xv = x[(row0 + t) * p.k + kk];
            }
            xs[(e % DEPTH) * TILE + t] = xv;
            var wv = 0.0;
            if (col0 + t < p.n && kk < p.k) {
                wv = w_at((col0 + t) * p.k + kk);
            }
            ws[(e % DEPTH) * TILE + t] = wv;
        }
        workgroupBarrier();
        for (var kk = 0u; kk < DEPTH; kk++) {
            let o = kk * TILE;
            let b = vec4<f32>(ws[o + tx], ws[o + tx + 16u], ws[o + tx + 32u], ws[o + tx + 48u]);
            c0 += xs[o + ty] * b;
            c1 += xs[o + ty + 16u] * b;
            c2 += xs[o + ty + 32u] * b;
            c3 += xs[o + ty + 48u] * b;
        }
        workgroupBarrier();
    }
    store4(row0 + ty, col0 + tx, c0);
    store4(row0 + ty + 16u, col0 + tx, c1);
    store4(row0 + ty + 32u, col0 + tx, c2);
    store4(row0 + ty + 48u, col0 + tx, c3);
}

// The GEMM for k a multiple of 8: tiles of 128 x 128 outputs, 16 deep along k, staged
// k-major in workgroup memory from 16-byte loads; each thread computes 8 x 8 outputs 16
// rows and 16 columns apart (64 products per 16 reads of workgroup memory).
// It stages its tiles in the `gemm` kernel's xs and ws (the same 2048 elements each).
const BIG: u32 = 128u;
const BIG_DEPTH: u32 = 16u;

@compute @workgroup_size(256)
fn gemm_wide(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let row0 = wg.y * BIG;
    let col0 = wg.x * BIG;
    let tx = lid % 16u;
    let ty = lid / 16u;
    // c[i][j]: row row0 + ty + 16 i, column col0 + tx + 16 j (j in two vec4 halves).
    var c: array<array<vec4<f32>, 2>, 8>;
    // Each step loads 128 rows of x as 4 vec4 each (two per thread) and 128 columns of w
    // as 2 pieces of 8 (one per thread).
    for (var k0 = 0u; k0 < p.k; k0 += BIG_DEPTH) {
        for (var e = lid; e < BIG * 4u; e += WG) {
            let t = e / 4u;
            let q = e % 4u;
            var xv = vec4<f32>();
            if (row0 + t < p.m && k0 + 4u * q < p.k) {
                xv = x4[(row0 + t) * (p.k / 4u) + k0 / 4u + q];
            }
            xs[(4u * q) * BIG + t] = xv.x;
            xs[(4u * q + 1u) * BIG + t] = xv.y;
            xs[(4u * q + 2u) * BIG + t] = xv.z;
            xs[(4u * q + 3u) * BIG + t] = xv.w;
        }
        {
            let t = lid / 2u;
            let h = lid % 2u;
            var w = W8(vec4<f32>(), vec4<f32>());
            if (col0 + t < p.n && k0 + 8u * h < p.k) {
                w = w_at8((col0 + t) * (p.k / 8u) + k0 / 8u + h);
            }
            let o = 8u * h * BIG + t;
            ws[o] = w.lo.x;
            ws[o + BIG] = w.lo.y;
            ws[o + 2u * BIG] = w.lo.z;
            ws[o + 3u * BIG] = w.lo.w;
            ws[o + 4u * BIG] = w.hi.x;
            ws[o + 5u * BIG] = w.hi.y;
            ws[o + 6u * BIG] = w.hi.z;
            ws[o + 7u * BIG] = w.hi.w;
        }
        workgroupBarrier();
        for (var kk = 0u; kk < BIG_DEPTH; kk++) {
            let o = kk * BIG;
            let b0 = vec4<f32>(ws[o + tx], ws[o + tx + 16u], ws[o + tx + 32u], ws[o + tx + 48u]);
            let b1 = vec4<f32>(ws[o + tx + 64u], ws[o + tx + 80u], ws[o + tx + 96u],
                               ws[o + tx + 112u]);
            for (var i = 0u; i < 8u; i++) {
                let a = xs[o + ty + 16u * i];
                c[i][0] += a * b0;
                c[i][1] += a * b1;
            }
        }
        workgroupBarrier();
    }
    for (var i = 0u; i < 8u; i++) {
        let r = row0 + ty + 16u * i;
        if (r < p.m) {
            for (var j = 0u; j < 8u; j++) {
                let col = col0 + tx + 16u * j;
                if (col < p.n) {
                    store(r, col, c[i][j / 4u][j % 4u]);
                }
            }
        }
    }
}
