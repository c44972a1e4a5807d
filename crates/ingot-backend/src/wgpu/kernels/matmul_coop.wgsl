// The GEMM on matrix units (cooperative matrices: tensor cores through Vulkan, simdgroup
// matrices on Metal), for k a multiple of 8: out = x · wᵀ as matmul.wgsl's `gemm_wide`,
// with x and w rounded to f16 and the sums in f32.
//
// A workgroup is COOP_WM x COOP_WN subgroups of COOP_SG threads (the adapter's one
// subgroup size); each subgroup computes COOP_FR x SUB_FC fragments of F x F outputs
// (F, the fragment side the adapter offers, is set by the host: 8 on Metal and lavapipe,
// 16 on NVIDIA), SUB_COLS columns wide, so a workgroup's tile is COOP_WM * COOP_FR * F
// rows by COOP_WN * SUB_COLS columns. Tiles of x and w go through workgroup memory in
// steps of CK along k, row-major with rows CK_PAD apart; a fragment of x loads row-major
// (A) and one of w column-major (B = wᵀ) from there.
//
// Products of few rows (decode batches) have few tiles, so the grid also splits k: the
// workgroups of z = s take the s-th of num_workgroups.z runs of k steps and write their
// sums to partials[s][row][column]; gemm_coop_reduce adds the runs up through store().
alias FragA = coop_matFxF<f16, A>;
alias FragB = coop_matFxF<f16, B>;
alias FragC = coop_matFxF<f32, C>;

override COOP_SG: u32 = 32u;
override COOP_WM: u32 = 2u;
override COOP_WN: u32 = 2u;
override COOP_FR: u32 = 2u;
override COOP_THREADS: u32 = COOP_SG * COOP_WM * COOP_WN;
const SUB_COLS: u32 = 32u;
const SUB_FC: u32 = SUB_COLS / F;
const CK: u32 = 32u;
// Rows of a staged tile stand CK + 8 halves apart, so the fragment loads of consecutive
// rows start in different banks.
const CK_PAD: u32 = CK + 8u;
// The largest tile: 64 rows (COOP_WM * COOP_FR * F) by 128 columns (COOP_WN <= 4).
const TILE_ROWS: u32 = 64u;
const TILE_COLS: u32 = 128u;
// Accumulators a subgroup holds at most (COOP_FR * SUB_FC).
const MAX_ACC: u32 = 16u;
var<workgroup> xs_h: array<f16, 2560>; // TILE_ROWS * CK_PAD
var<workgroup> ws_h: array<f16, 5120>; // TILE_COLS * CK_PAD
// One fragment of each subgroup on its way out (at most 8 subgroups of 16 x 16).
var<workgroup> frag_out: array<f32, 2048>;
@group(0) @binding(7) var<storage, read_write> partials: array<f32>;

@compute @workgroup_size(COOP_THREADS)
fn gemm_coop(@builtin(workgroup_id) wg: vec3<u32>,
             @builtin(num_workgroups) nwg: vec3<u32>,
             @builtin(local_invocation_index) lid: u32,
             @builtin(subgroup_id) sg: u32,
             @builtin(subgroup_invocation_id) lane: u32) {
    let tile_rows = COOP_WM * COOP_FR * F;
    let tile_cols = COOP_WN * SUB_COLS;
    let row0 = wg.y * tile_rows;
    let col0 = wg.x * tile_cols;
    // This subgroup's first row and column in the tile.
    let sr = (sg / COOP_WN) * COOP_FR * F;
    let sc = (sg % COOP_WN) * SUB_COLS;
    var acc: array<FragC, MAX_ACC>;
    for (var i = 0u; i < COOP_FR * SUB_FC; i++) {
        acc[i] = FragC();
    }
    // This workgroup's run of k steps; the last run may be shorter or empty.
    let run = ((p.k + CK - 1u) / CK + nwg.z - 1u) / nwg.z * CK;
    let k_end = min(p.k, (wg.z + 1u) * run);
    for (var k0 = wg.z * run; k0 < k_end; k0 += CK) {
        // x: tile_rows rows of CK as vectors of 4.
        for (var e = lid; e < tile_rows * (CK / 4u); e += COOP_THREADS) {
            let t = e / (CK / 4u);
            let q = e % (CK / 4u);
            var v = vec4<f32>();
            if (row0 + t < p.m && k0 + 4u * q < p.k) {
                v = x4[(row0 + t) * (p.k / 4u) + k0 / 4u + q];
            }
            let o = t * CK_PAD + 4u * q;
            xs_h[o] = f16(v.x);
            xs_h[o + 1u] = f16(v.y);
            xs_h[o + 2u] = f16(v.z);
            xs_h[o + 3u] = f16(v.w);
        }
        // w: tile_cols rows of CK as pieces of 8.
        for (var e = lid; e < tile_cols * (CK / 8u); e += COOP_THREADS) {
            let t = e / (CK / 8u);
            let h = e % (CK / 8u);
            var v = W8(vec4<f32>(), vec4<f32>());
            if (col0 + t < p.n && k0 + 8u * h < p.k) {
                v = w_at8((col0 + t) * (p.k / 8u) + k0 / 8u + h);
            }
            let o = t * CK_PAD + 8u * h;
            ws_h[o] = f16(v.lo.x);
            ws_h[o + 1u] = f16(v.lo.y);
            ws_h[o + 2u] = f16(v.lo.z);
            ws_h[o + 3u] = f16(v.lo.w);
            ws_h[o + 4u] = f16(v.hi.x);
            ws_h[o + 5u] = f16(v.hi.y);
            ws_h[o + 6u] = f16(v.hi.z);
            ws_h[o + 7u] = f16(v.hi.w);
        }
        workgroupBarrier();
        for (var kk = 0u; kk < CK; kk += F) {
            var a: array<FragA, 8>;
            for (var fr = 0u; fr < COOP_FR; fr++) {
                a[fr] = coopLoadT<FragA>(&xs_h[(sr + fr * F) * CK_PAD + kk], CK_PAD);
            }
            for (var fc = 0u; fc < SUB_FC; fc++) {
                let b = coopLoad<FragB>(&ws_h[(sc + fc * F) * CK_PAD + kk], CK_PAD);
                for (var fr = 0u; fr < COOP_FR; fr++) {
                    acc[fr * SUB_FC + fc] = coopMultiplyAdd(a[fr], b, acc[fr * SUB_FC + fc]);
                }
            }
        }
        workgroupBarrier();
    }
    // Each fragment through workgroup memory, so the lanes write it with store()'s bias,
    // ADD_OUT and bounds (or, with k split, to this run's partial sums).
    let staged = sg * F * F;
    for (var fr = 0u; fr < COOP_FR; fr++) {
        for (var fc = 0u; fc < SUB_FC; fc++) {
            coopStoreT(acc[fr * SUB_FC + fc], &frag_out[staged], F);
            workgroupBarrier();
            for (var e = lane; e < F * F; e += COOP_SG) {
                let r = row0 + sr + fr * F + e / F;
                let c = col0 + sc + fc * F + e % F;
                if (r < p.m && c < p.n) {
                    if (nwg.z == 1u) {
                        store(r, c, frag_out[staged + e]);
                    } else {
                        partials[(wg.z * p.m + r) * p.n + c] = frag_out[staged + e];
                    }
                }
            }
            workgroupBarrier();
        }
    }
}

// The sums of gemm_coop's COOP_SPLITS runs of k, an output a thread, in the order of the
// runs.
override COOP_SPLITS: u32 = 1u;

@compute @workgroup_size(WG)
fn gemm_coop_reduce(@builtin(workgroup_id) wg: vec3<u32>,
                    @builtin(num_workgroups) nwg: vec3<u32>,
                    @builtin(local_invocation_index) lid: u32) {
    let e = (wg.y * nwg.x + wg.x) * WG + lid;
    if (e >= p.m * p.n) {
        return;
    }
    var s = 0.0;
    for (var run = 0u; run < COOP_SPLITS; run++) {
        s += partials[run * p.m * p.n + e];
    }
    store(e / p.n, e % p.n, s);
}
