//! Attention over a 16-bit (f16 or bf16) paged KV cache.
//!
//! A 16-bit cache already rounds keys and values, so this path is laid out for speed rather
//! than for the f32 path's per-head order: one task per (token, KV head, context split)
//! serves the KV head's whole query group, each key and value row converted to f32 once for
//! all of its query heads, and a context longer than [`SPLIT`] positions is split so that
//! one decoding sequence spreads over the threads (flash-decoding). The splits depend only
//! on the token's own context and are merged in order, so a token's output does not depend
//! on the batch it runs in.

use super::attention::PagedAttention;
use super::team::Team;
use crate::quant::{vec_axpy_f32, Isa};
use crate::QkvLayout;
use half::{bf16, f16};
use std::cell::RefCell;

/// Context positions per task.
const SPLIT: usize = 128;
/// (token, query head) outputs merged per parallel task.
const MERGES_PER_TASK: usize = 64;

/// A 16-bit cache element type.
pub trait Half: Copy + Send + Sync {
    /// bf16 (the top half of an f32) rather than IEEE f16.
    const BF16: bool;
    fn to_f32(self) -> f32;
}

impl Half for f16 {
    const BF16: bool = false;
    fn to_f32(self) -> f32 {
        f16::to_f32(self)
    }
}

impl Half for bf16 {
    const BF16: bool = true;
    fn to_f32(self) -> f32 {
        bf16::to_f32(self)
    }
}

/// One SIMD register of f32 lanes (a plain f32 on the portable path) and the operations a
/// task runs on it; [`dot`] and [`weighted_sum`] are written once over it.
trait Lanes: Copy {
    const N: usize;
    /// # Safety (all functions)
    /// The CPU has the instructions of the implementation, and pointers are valid for `N`
    /// elements.
    unsafe fn splat(x: f32) -> Self;
    unsafe fn load(p: *const f32) -> Self;
    /// `N` cache elements as f32.
    unsafe fn load_half<T: Half>(p: *const T) -> Self;
    unsafe fn mul_add(a: Self, b: Self, c: Self) -> Self;
    unsafe fn add(a: Self, b: Self) -> Self;
    unsafe fn store(self, p: *mut f32);
    unsafe fn sum(self) -> f32;
}

impl Lanes for f32 {
    const N: usize = 1;
    unsafe fn splat(x: f32) -> Self {
        x
    }
    unsafe fn load(p: *const f32) -> Self {
        *p
    }
    unsafe fn load_half<T: Half>(p: *const T) -> Self {
        (*p).to_f32()
    }
    unsafe fn mul_add(a: Self, b: Self, c: Self) -> Self {
        a * b + c
    }
    unsafe fn add(a: Self, b: Self) -> Self {
        a + b
    }
    unsafe fn store(self, p: *mut f32) {
        *p = self
    }
    unsafe fn sum(self) -> f32 {
        self
    }
}

/// `q · k`, for rows whose length is a multiple of `L::N` (checked by the caller).
///
/// # Safety
/// As for [`Lanes`]; inlined into the one function that enables its instructions.
#[inline(always)]
unsafe fn dot<L: Lanes, T: Half>(q: &[f32], k: &[T]) -> f32 {
    debug_assert!(q.len() == k.len() && q.len().is_multiple_of(L::N));
    let n = q.len();
    let (q, k) = (q.as_ptr(), k.as_ptr());
    let (mut a0, mut a1) = (L::splat(0.0), L::splat(0.0));
    let mut i = 0;
    while i + 2 * L::N <= n {
        a0 = L::mul_add(L::load(q.add(i)), L::load_half(k.add(i)), a0);
        a1 = L::mul_add(L::load(q.add(i + L::N)), L::load_half(k.add(i + L::N)), a1);
        i += 2 * L::N;
    }
    if i < n {
        a0 = L::mul_add(L::load(q.add(i)), L::load_half(k.add(i)), a0);
    }
    L::add(a0, a1).sum()
}

/// `out = Σ w[i] · v[at[i]..][..out.len()]`, for rows whose length is a multiple of `L::N`:
/// up to eight registers of output columns stay in registers across all positions.
///
/// # Safety
/// As for [`dot`].
#[inline(always)]
unsafe fn weighted_sum<L: Lanes, T: Half>(w: &[f32], at: &[usize], v: &[T], out: &mut [f32]) {
    debug_assert!(out.len().is_multiple_of(L::N) && at.iter().all(|&a| a + out.len() <= v.len()));
    let cols = 8 * L::N;
    for c0 in (0..out.len()).step_by(cols) {
        let vectors = (out.len() - c0).min(cols) / L::N;
        let mut acc = [L::splat(0.0); 8];
        for (&w, &at) in w.iter().zip(at) {
            let (w, row) = (L::splat(w), v.as_ptr().add(at + c0));
            for (j, acc) in acc.iter_mut().enumerate() {
                if j < vectors {
                    *acc = L::mul_add(w, L::load_half(row.add(j * L::N)), *acc);
                }
            }
        }
        for (j, acc) in acc.iter().take(vectors).enumerate() {
            acc.store(out.as_mut_ptr().add(c0 + j * L::N));
        }
    }
}

/// Positions `start..start + len` of one token's context for one KV head.
struct Task {
    row: usize,
    seq: usize,
    kv_head: usize,
    start: usize,
    len: usize,
}

/// Per-thread scratch of a task: its scaled queries, the cache offsets of its positions and
/// one head's scores.
#[derive(Default)]
struct Scratch {
    q: Vec<f32>,
    offsets: Vec<usize>,
    scores: Vec<f32>,
}

thread_local! {
    static SCRATCH: RefCell<Scratch> = RefCell::new(Scratch::default());
}

/// Fills `out` (`[rows, num_heads * head_dim]`) from the 16-bit caches `k` and `v`.
pub fn run<T: Half>(a: &PagedAttention<'_>, k: &[T], v: &[T], out: &mut [f32], team: &Team) {
    let QkvLayout {
        num_heads,
        num_kv_heads,
        head_dim: hd,
    } = a.layout;
    let group = num_heads / num_kv_heads;
    // A token's tasks are contiguous, KV head by KV head, splits in order; `rows` keeps
    // each token's first task and its splits per KV head for the merge.
    let mut tasks = Vec::new();
    let mut rows = Vec::with_capacity(a.rows);
    for row in 0..a.rows {
        let (seq, len) = a.row_context(row);
        rows.push((tasks.len(), len.div_ceil(SPLIT)));
        for kv_head in 0..num_kv_heads {
            for start in (0..len).step_by(SPLIT) {
                let len = SPLIT.min(len - start);
                tasks.push(Task {
                    row,
                    seq,
                    kv_head,
                    start,
                    len,
                });
            }
        }
    }
    // Each task leaves, per query head of its group: the running max, the sum of
    // exponentials, and the unnormalized output.
    let stride = group * (hd + 2);
    let mut partials = vec![0f32; tasks.len() * stride];
    team.chunks_mut(&mut partials, stride, |i, p| {
        attend_on_isa(a, &tasks[i], k, v, p)
    });
    // Merging costs a few vector operations per split: worth another thread only for many
    // rows (prefill).
    let merges = &mut out[..a.rows * num_heads * hd];
    team.chunks_mut(merges, MERGES_PER_TASK * hd, |c, chunk| {
        for (j, out) in chunk.chunks_exact_mut(hd).enumerate() {
            let i = c * MERGES_PER_TASK + j;
            let (row, head) = (i / num_heads, i % num_heads);
            let (first, splits) = rows[row];
            let first = first + (head / group) * splits;
            let at = |s: usize| (first + s) * stride + (head % group) * (hd + 2);
            let max = (0..splits).fold(f32::NEG_INFINITY, |m, s| m.max(partials[at(s)]));
            let mut sum = 0f32;
            out.fill(0.0);
            for s in 0..splits {
                let p = &partials[at(s)..][..hd + 2];
                let w = (p[0] - max).exp();
                sum += w * p[1];
                vec_axpy_f32(out, w, &p[2..]);
            }
            let inv = 1.0 / sum;
            out.iter_mut().for_each(|o| *o *= inv);
        }
    });
}

fn attend_on_isa<T: Half>(a: &PagedAttention<'_>, t: &Task, k: &[T], v: &[T], p: &mut [f32]) {
    // The scratch is passed down rather than borrowed inside `attend`: a closure there
    // would not inherit the AVX2 function's target features, and its intrinsics would
    // become calls.
    SCRATCH.with_borrow_mut(|s| {
        let hd = a.layout.head_dim;
        // SAFETY (all): `a.isa` is one this CPU supports (checked when it was chosen), and
        // the head size is a multiple of the path's lanes.
        #[cfg(target_arch = "x86_64")]
        if a.isa == Isa::Avx512Vnni && hd.is_multiple_of(16) {
            return unsafe { x86::attend_avx512(a, t, k, v, p, s) };
        }
        #[cfg(target_arch = "x86_64")]
        if a.isa >= Isa::Avx2 && hd.is_multiple_of(8) {
            return unsafe { x86::attend_avx2(a, t, k, v, p, s) };
        }
        unsafe { attend::<f32, T>(a, t, k, v, p, s) }
    })
}

/// One task: scores of the group's query heads against the split's keys, their softmax
/// weights (relative to the split's max) and the weighted sum of its values.
///
/// # Safety
/// As for [`dot`], with a head size that is a multiple of `L::N`.
#[inline(always)]
unsafe fn attend<L: Lanes, T: Half>(
    a: &PagedAttention<'_>,
    t: &Task,
    k: &[T],
    v: &[T],
    partial: &mut [f32],
    s: &mut Scratch,
) {
    let QkvLayout {
        num_heads,
        num_kv_heads,
        head_dim: hd,
    } = a.layout;
    let group = num_heads / num_kv_heads;
    let kv_len = a.layout.kv_len();
    let bs = a.cache.block_size;
    let table = a.block_table(t.seq);
    // Cache offsets of the split's positions, walked block by block.
    s.offsets.clear();
    let first = t.start / bs;
    for (b, &block) in table
        .iter()
        .enumerate()
        .take((t.start + t.len - 1) / bs + 1)
        .skip(first)
    {
        let lo = (b * bs).max(t.start);
        let hi = ((b + 1) * bs).min(t.start + t.len);
        let base = block as usize * bs;
        s.offsets
            .extend((lo..hi).map(|p| (base + p - b * bs) * kv_len + t.kv_head * hd));
    }
    let q_at = t.row * a.layout.row_len() + t.kv_head * group * hd;
    s.q.clear();
    s.q.extend(a.qkv[q_at..][..group * hd].iter().map(|x| x * a.scale));
    s.scores.resize(t.len, 0.0);
    for (h, p) in partial.chunks_exact_mut(hd + 2).enumerate() {
        let q = &s.q[h * hd..][..hd];
        for (score, &at) in s.scores.iter_mut().zip(&s.offsets) {
            *score = dot::<L, T>(q, &k[at..][..hd]);
        }
        let max = s.scores.iter().fold(f32::NEG_INFINITY, |m, &x| m.max(x));
        exp_shifted(a.isa, &mut s.scores, max);
        p[0] = max;
        p[1] = s.scores.iter().sum();
        weighted_sum::<L, T>(&s.scores, &s.offsets, v, &mut p[2..]);
    }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use super::{Half, Lanes, PagedAttention, Scratch, Task};
    use std::arch::x86_64::*;

    impl Lanes for __m256 {
        const N: usize = 8;
        #[inline(always)]
        unsafe fn splat(x: f32) -> Self {
            _mm256_set1_ps(x)
        }
        #[inline(always)]
        unsafe fn load(p: *const f32) -> Self {
            _mm256_loadu_ps(p)
        }
        #[inline(always)]
        unsafe fn load_half<T: Half>(p: *const T) -> Self {
            let raw = _mm_loadu_si128(p as *const __m128i);
            if T::BF16 {
                _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16))
            } else {
                _mm256_cvtph_ps(raw)
            }
        }
        #[inline(always)]
        unsafe fn mul_add(a: Self, b: Self, c: Self) -> Self {
            _mm256_fmadd_ps(a, b, c)
        }
        #[inline(always)]
        unsafe fn add(a: Self, b: Self) -> Self {
            _mm256_add_ps(a, b)
        }
        #[inline(always)]
        unsafe fn store(self, p: *mut f32) {
            _mm256_storeu_ps(p, self)
        }
        #[inline(always)]
        unsafe fn sum(self) -> f32 {
            let s = _mm_add_ps(_mm256_castps256_ps128(self), _mm256_extractf128_ps(self, 1));
            let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
            _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)))
        }
    }

    impl Lanes for __m512 {
        const N: usize = 16;
        #[inline(always)]
        unsafe fn splat(x: f32) -> Self {
            _mm512_set1_ps(x)
        }
        #[inline(always)]
        unsafe fn load(p: *const f32) -> Self {
            _mm512_loadu_ps(p)
        }
        #[inline(always)]
        unsafe fn load_half<T: Half>(p: *const T) -> Self {
            let raw = _mm256_loadu_si256(p as *const __m256i);
            if T::BF16 {
                _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16))
            } else {
                _mm512_cvtph_ps(raw)
            }
        }
        #[inline(always)]
        unsafe fn mul_add(a: Self, b: Self, c: Self) -> Self {
            _mm512_fmadd_ps(a, b, c)
        }
        #[inline(always)]
        unsafe fn add(a: Self, b: Self) -> Self {
            _mm512_add_ps(a, b)
        }
        #[inline(always)]
        unsafe fn store(self, p: *mut f32) {
            _mm512_storeu_ps(p, self)
        }
        #[inline(always)]
        unsafe fn sum(self) -> f32 {
            _mm512_reduce_add_ps(self)
        }
    }

    /// `attend` compiled for AVX2; its `Lanes` calls inline into this function.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn attend_avx2<T: Half>(
        a: &PagedAttention<'_>,
        t: &Task,
        k: &[T],
        v: &[T],
        partial: &mut [f32],
        s: &mut Scratch,
    ) {
        super::attend::<__m256, T>(a, t, k, v, partial, s)
    }

    /// `attend` compiled for AVX-512.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
    pub(super) unsafe fn attend_avx512<T: Half>(
        a: &PagedAttention<'_>,
        t: &Task,
        k: &[T],
        v: &[T],
        partial: &mut [f32],
        s: &mut Scratch,
    ) {
        super::attend::<__m512, T>(a, t, k, v, partial, s)
    }
}

/// `x ← e^(x − max)` for every score (all ≤ max), vectorized.
fn exp_shifted(isa: Isa, xs: &mut [f32], max: f32) {
    #[cfg(target_arch = "x86_64")]
    if isa >= Isa::Avx2 {
        // SAFETY: the CPU has AVX2 and FMA (checked when the ISA was chosen).
        return unsafe { exp_shifted_avx2(xs, max) };
    }
    exp_shifted_portable(xs, max)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn exp_shifted_avx2(xs: &mut [f32], max: f32) {
    exp_shifted_portable(xs, max)
}

#[inline(always)]
fn exp_shifted_portable(xs: &mut [f32], max: f32) {
    xs.iter_mut().for_each(|x| *x = exp_nonpositive(*x - max));
}

/// e^x for x ≤ 0 within 4 ulp, in branch-free arithmetic the compiler vectorizes: x is
/// n·ln2 + r with |r| ≤ ln2/2, e^r comes from its degree-6 Taylor polynomial (error below
/// r⁷/7! ≈ 1.3e-7 relative), and 2^n goes into the exponent bits. Below −87 the result would leave the normal
/// range; it is clamped there (e^−87 ≈ 1.6e−38, zero for a softmax weight).
#[inline(always)]
fn exp_nonpositive(x: f32) -> f32 {
    const SHIFTER: f32 = 12_582_912.0; // 1.5 · 2^23: adding it rounds to an integer
    let x = x.max(-87.0);
    let shifted = x * std::f32::consts::LOG2_E + SHIFTER;
    let n = shifted - SHIFTER;
    // Cody–Waite: ln 2 in two parts, so n·ln2 is subtracted without rounding error.
    let r = (x - n * 0.693_145_75) - n * 1.428_606_8e-6;
    let p = 1.0
        + r * (1.0
            + r * (0.5
                + r * (1.0 / 6.0 + r * (1.0 / 24.0 + r * (1.0 / 120.0 + r * (1.0 / 720.0))))));
    // The low mantissa bits of `shifted` hold n (two's complement over the 1.5·2^23 base).
    let n_bits = shifted.to_bits().wrapping_sub(SHIFTER.to_bits());
    p * f32::from_bits(n_bits.wrapping_add(127) << 23)
}

#[cfg(test)]
mod tests {
    use super::super::attention::KvData;
    use super::*;
    use crate::CacheLayout;
    use rand::seq::SliceRandom;
    use rand::{Rng, SeedableRng};

    /// Sequences as (cached context before the step, query rows in the step): a prefill
    /// chunk continuing a cached prefix across splits, a first token, a long decode.
    const SEQS: [(usize, usize); 3] = [(290, 5), (0, 1), (699, 1)];

    struct Case {
        layout: QkvLayout,
        qkv: Vec<f32>,
        k: Vec<f16>,
        v: Vec<f16>,
        tables: Vec<i32>,
        blocks_per_seq: usize,
        num_blocks: usize,
    }

    const BS: usize = 16;

    fn case(layout: QkvLayout, rng: &mut impl Rng) -> Case {
        let rows: usize = SEQS.iter().map(|s| s.1).sum();
        let blocks_per_seq = SEQS.iter().map(|s| (s.0 + s.1).div_ceil(BS)).max().unwrap();
        let num_blocks = blocks_per_seq * SEQS.len();
        // Every sequence's blocks are scattered over the whole cache.
        let mut ids: Vec<i32> = (0..num_blocks as i32).collect();
        ids.shuffle(rng);
        let kv = num_blocks * BS * layout.kv_len();
        let mut rand_f16 = |n| {
            (0..n)
                .map(|_| f16::from_f32(rng.random_range(-1.0..1.0)))
                .collect::<Vec<_>>()
        };
        let (k, v) = (rand_f16(kv), rand_f16(kv));
        Case {
            layout,
            qkv: (0..rows * layout.row_len())
                .map(|_| rng.random_range(-2.0..2.0))
                .collect(),
            k,
            v,
            tables: ids,
            blocks_per_seq,
            num_blocks,
        }
    }

    /// Runs the rows of sequences `seqs` (indices into [`SEQS`]) with `kv`.
    fn run_seqs(c: &Case, seqs: &[usize], kv: KvData<'_>, isa: Isa, team: &Team) -> Vec<f32> {
        let (mut qsl, mut lens, mut tables, mut qkv) = (vec![0i32], vec![], vec![], vec![]);
        let mut row0 = 0;
        for (i, &(cached, q)) in SEQS.iter().enumerate() {
            if seqs.contains(&i) {
                qsl.push(qsl.last().unwrap() + q as i32);
                lens.push((cached + q) as i32);
                tables.extend_from_slice(&c.tables[i * c.blocks_per_seq..][..c.blocks_per_seq]);
                qkv.extend_from_slice(
                    &c.qkv[row0 * c.layout.row_len()..][..q * c.layout.row_len()],
                );
            }
            row0 += q;
        }
        let rows = *qsl.last().unwrap() as usize;
        let a = PagedAttention {
            qkv: &qkv,
            layout: c.layout,
            rows,
            query_start_loc: &qsl,
            seq_lens: &lens,
            block_tables: &tables,
            max_blocks_per_seq: c.blocks_per_seq,
            cache: CacheLayout {
                num_blocks: c.num_blocks,
                block_size: BS,
            },
            kv,
            scale: 1.0 / (c.layout.head_dim as f32).sqrt(),
            isa,
        };
        let mut out = vec![0f32; rows * c.layout.q_len()];
        a.run(&mut out, team);
        out
    }

    #[test]
    fn sixteen_bit_cache_matches_the_exact_path_on_every_isa_and_batch() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(5);
        let team = Team::new(3).unwrap();
        let all = [0, 1, 2];
        // GQA 1, 4 and 8; head sizes for the AVX-512 (16s), AVX2 (8s) and portable paths.
        for (num_heads, num_kv_heads, head_dim) in
            [(4, 4, 64), (8, 2, 128), (8, 1, 80), (4, 1, 72), (2, 2, 36)]
        {
            let layout = QkvLayout {
                num_heads,
                num_kv_heads,
                head_dim,
            };
            let c = case(layout, &mut rng);
            let (kf, vf): (Vec<f32>, Vec<f32>) = (
                c.k.iter().map(|x| x.to_f32()).collect(),
                c.v.iter().map(|x| x.to_f32()).collect(),
            );
            let exact = run_seqs(&c, &all, KvData::F32(&kf, &vf), Isa::Portable, &team);
            let kb: Vec<bf16> = kf.iter().map(|&x| bf16::from_f32(x)).collect();
            let vb: Vec<bf16> = vf.iter().map(|&x| bf16::from_f32(x)).collect();
            let (kbf, vbf): (Vec<f32>, Vec<f32>) = (
                kb.iter().map(|x| x.to_f32()).collect(),
                vb.iter().map(|x| x.to_f32()).collect(),
            );
            let exact_bf16 = run_seqs(&c, &all, KvData::F32(&kbf, &vbf), Isa::Portable, &team);
            for isa in Isa::available() {
                let what = format!(
                    "{} heads {num_heads}/{num_kv_heads} dim {head_dim}",
                    isa.name()
                );
                for (got, want) in [
                    (
                        run_seqs(&c, &all, KvData::F16(&c.k, &c.v), isa, &team),
                        &exact,
                    ),
                    (
                        run_seqs(&c, &all, KvData::BF16(&kb, &vb), isa, &team),
                        &exact_bf16,
                    ),
                ] {
                    let worst = got
                        .iter()
                        .zip(want.iter())
                        .map(|(a, b)| (a - b).abs())
                        .fold(0f32, f32::max);
                    assert!(worst <= 1e-5, "{what}: max difference {worst}");
                }
                // The long decode's row is the same bits alone and beside the others.
                let batch = run_seqs(&c, &all, KvData::F16(&c.k, &c.v), isa, &team);
                let alone = run_seqs(&c, &[2], KvData::F16(&c.k, &c.v), isa, &team);
                assert_eq!(
                    &batch[batch.len() - alone.len()..],
                    &alone[..],
                    "{what}: batch"
                );
            }
        }
    }

    #[test]
    fn exp_is_within_four_ulp_of_libm() {
        let mut x = 0f32;
        while x > -87.0 {
            let (got, want) = (exp_nonpositive(x), x.exp());
            assert!(
                (got - want).abs() <= 4.0 * f32::EPSILON * want,
                "e^{x}: {got} vs {want}"
            );
            x -= 0.0137;
        }
        assert!(exp_nonpositive(-1000.0) < 1e-37);
        assert_eq!(exp_nonpositive(0.0), 1.0);
    }
}
