//! WGSL sources of the wgpu kernels, specialized at start for what the adapter can do and
//! for the dtype of the buffers a kernel reads in more than one format (weights, the KV
//! cache). WGSL has no preprocessor, so each source names accessors (`w_at(i)`,
//! `kc_set2(i, a, b)`) and reductions (`wg_sum(v, lid)`) that are generated here.
//!
//! GGUF blocks are read as they are stored and dequantized in the accessors, so a
//! quantized matrix takes its file size on the device and the kernels that read floats
//! read it unchanged. Q4_1 (20-byte blocks), Q4_K (144-byte super-blocks) and Q5_K (176)
//! are word aligned; Q8_0's 34-byte, Q4_0's 18-byte and Q6_K's 210-byte blocks are not, so
//! the backend stores them in pairs, the two f16 scales in one word and then the rest of
//! each block (17, 9 and 105 words for two blocks).

use crate::DType;

/// What the shaders may use on this adapter.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Features {
    /// `SHADER_F16`: f16 buffers are `array<f16>`; without it they are `array<u32>` of
    /// pairs read with `unpack2x16float`.
    pub shader_f16: bool,
    /// `SUBGROUP`: reductions start with `subgroupAdd`/`subgroupMax`; without it they go
    /// through workgroup memory alone.
    pub subgroup: bool,
    /// `EXPERIMENTAL_COOPERATIVE_MATRIX` with f16 inputs and f32 sums: the side of the
    /// square fragments used (8 or 16) and the adapter's one subgroup size; without it the
    /// products run on the f32 kernels.
    pub cooperative_matrix: Option<CooperativeMatrix>,
}

/// The cooperative-matrix configuration the products use.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct CooperativeMatrix {
    /// Rows, columns and depth of a fragment (F x F times F x F).
    pub side: u32,
    /// Threads of a subgroup: a workgroup is a whole number of subgroups.
    pub subgroup_size: u32,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Access {
    Read,
    ReadWrite,
}

/// A buffer a kernel reads (and may write) in the variant's dtype.
struct Typed {
    name: &'static str,
    binding: u32,
    access: Access,
    /// Where it is also bound as 16-byte vectors, read 8 elements at a time with
    /// `{name}_at8(g) -> W8` (elements 8g..8g+8; a read-only buffer whose rows start at
    /// multiples of 8 elements).
    wide: Option<u32>,
}

/// One WGSL source file and its entry points.
pub struct Kernel {
    pub file: &'static str,
    pub entries: &'static [&'static str],
    source: &'static str,
    typed: &'static [Typed],
    /// Whether it calls `wg_sum`/`wg_max`.
    reduces: bool,
    /// Whether it runs on cooperative matrices (built only where the adapter has them).
    pub cooperative: bool,
    /// The dtypes its typed buffers may have (one variant each).
    pub dtypes: &'static [DType],
}

const FLOATS: &[DType] = &[DType::F32, DType::F16, DType::BF16];
/// The block formats (GGUF's and FP8) the weight accessors dequantize.
pub const BLOCKS: &[DType] = &[
    DType::Q8_0,
    DType::Q4_0,
    DType::Q4_1,
    DType::Q4K,
    DType::Q5K,
    DType::Q6K,
    DType::Fp8,
];
/// The dtypes a weight matrix may have: the floats and the blocks.
const WEIGHTS: &[DType] = &concat::<{ FLOATS.len() + BLOCKS.len() }>(FLOATS, BLOCKS);

const fn concat<const N: usize>(a: &[DType], b: &[DType]) -> [DType; N] {
    let mut out = [DType::F32; N];
    let mut i = 0;
    while i < N {
        out[i] = if i < a.len() { a[i] } else { b[i - a.len()] };
        i += 1;
    }
    out
}

pub const EMBEDDING: Kernel = Kernel {
    file: "embedding",
    entries: &["embedding"],
    source: include_str!("kernels/embedding.wgsl"),
    typed: &[Typed {
        name: "table",
        binding: 1,
        access: Access::Read,
        wide: None,
    }],
    reduces: false,
    cooperative: false,
    dtypes: WEIGHTS,
};

pub const NORM: Kernel = Kernel {
    file: "norm",
    entries: &["rms_norm", "add_rms_norm", "qk_norm"],
    source: include_str!("kernels/norm.wgsl"),
    typed: &[],
    reduces: true,
    cooperative: false,
    dtypes: &[DType::F32],
};

pub const ELEMENTWISE: Kernel = Kernel {
    file: "elementwise",
    entries: &["add_assign", "silu_mul", "gather_rows", "segment_sum"],
    source: include_str!("kernels/elementwise.wgsl"),
    typed: &[],
    reduces: false,
    cooperative: false,
    dtypes: &[DType::F32],
};

/// The weights of matmul.wgsl's products, also bound as 16-byte vectors.
const MATMUL_WEIGHTS: Typed = Typed {
    name: "w",
    binding: 2,
    access: Access::Read,
    wide: Some(6),
};

pub const MATMUL: Kernel = Kernel {
    file: "matmul",
    entries: &["gemv", "gemm"],
    source: include_str!("kernels/matmul.wgsl"),
    typed: &[MATMUL_WEIGHTS],
    reduces: false,
    cooperative: false,
    dtypes: WEIGHTS,
};

/// The GEMM on cooperative matrices: matmul.wgsl's accessors and epilogue, its own entry.
pub const MATMUL_COOP: Kernel = Kernel {
    file: "matmul_coop",
    entries: &["gemm_coop", "gemm_coop_reduce"],
    source: concat!(
        include_str!("kernels/matmul.wgsl"),
        include_str!("kernels/matmul_coop.wgsl")
    ),
    typed: &[MATMUL_WEIGHTS],
    reduces: false,
    cooperative: true,
    dtypes: WEIGHTS,
};

/// The QKV GEMV with RoPE and the KV write in its epilogue: matmul.wgsl's GEMV and its
/// own entry point, weights and cache in one float dtype.
pub const QKV_ROPE: Kernel = Kernel {
    file: "qkv_rope",
    entries: &["gemv_wide_rope"],
    source: concat!(
        include_str!("kernels/matmul.wgsl"),
        include_str!("kernels/qkv_rope.wgsl")
    ),
    typed: &[
        MATMUL_WEIGHTS,
        Typed {
            name: "kc",
            binding: 10,
            access: Access::ReadWrite,
            wide: None,
        },
        Typed {
            name: "vc",
            binding: 11,
            access: Access::ReadWrite,
            wide: None,
        },
    ],
    reduces: false,
    cooperative: false,
    dtypes: FLOATS,
};

pub const ROPE: Kernel = Kernel {
    file: "rope",
    entries: &["rope", "kv_write"],
    source: include_str!("kernels/rope.wgsl"),
    typed: &[
        Typed {
            name: "kc",
            binding: 5,
            access: Access::ReadWrite,
            wide: None,
        },
        Typed {
            name: "vc",
            binding: 6,
            access: Access::ReadWrite,
            wide: None,
        },
    ],
    reduces: false,
    cooperative: false,
    dtypes: FLOATS,
};

pub const ATTENTION: Kernel = Kernel {
    file: "attention",
    entries: &["attention", "decode", "decode_reduce", "prefill"],
    source: include_str!("kernels/attention.wgsl"),
    typed: &[
        Typed {
            name: "kc",
            binding: 5,
            access: Access::Read,
            wide: Some(9),
        },
        Typed {
            name: "vc",
            binding: 6,
            access: Access::Read,
            wide: Some(10),
        },
    ],
    reduces: true,
    cooperative: false,
    dtypes: FLOATS,
};

/// Prefill attention on cooperative matrices: attention.wgsl's helpers and its own entry,
/// for 16-bit caches.
pub const ATTENTION_COOP: Kernel = Kernel {
    file: "attention_coop",
    entries: &["prefill_coop"],
    source: concat!(
        include_str!("kernels/attention.wgsl"),
        include_str!("kernels/attention_coop.wgsl")
    ),
    typed: ATTENTION.typed,
    reduces: true,
    cooperative: true,
    dtypes: &[DType::F16, DType::BF16],
};

pub const MOE: Kernel = Kernel {
    file: "moe",
    entries: &["moe_route", "moe_gate_up", "moe_down", "moe_combine"],
    source: include_str!("kernels/moe.wgsl"),
    typed: &[Typed {
        name: "w",
        binding: 2,
        access: Access::Read,
        wide: None,
    }],
    reduces: false,
    cooperative: false,
    dtypes: WEIGHTS,
};

pub const SAMPLING: Kernel = Kernel {
    file: "sampling",
    entries: &["argmax", "sample"],
    source: include_str!("kernels/sampling.wgsl"),
    typed: &[],
    reduces: false,
    cooperative: false,
    dtypes: &[DType::F32],
};

pub const KERNELS: &[&Kernel] = &[
    &EMBEDDING,
    &NORM,
    &ELEMENTWISE,
    &MATMUL,
    &MATMUL_COOP,
    &QKV_ROPE,
    &ROPE,
    &ATTENTION,
    &ATTENTION_COOP,
    &MOE,
    &SAMPLING,
];

/// Threads per workgroup of every kernel.
pub const WG: u32 = 256;

/// The workgroup memory the kernels need of an adapter: Metal's 32 KiB (the most any
/// kernel takes, tiled prefill attention, is 27,328 bytes; decode attention picks its tiles
/// to fit, [`decode_tiles`]).
pub const MIN_WORKGROUP_MEMORY: u32 = 32 << 10;

/// The key tiles of decode attention: `keys` per tile (its `TN`), and the 16-byte vectors
/// each of its key and value tiles holds (`TILE_VECS`: a row of head_dim / 4 + 1 vectors a
/// key, padded against bank conflicts).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DecodeTiles {
    pub keys: u32,
    pub vecs: u32,
}

/// The longest tiles (32 keys for head_dim <= 128, else 16, else 8) whose workgroup memory
/// fits `limit` bytes: the query group (8 KiB), the key and value tiles, the scores (2 KiB)
/// and the per-head softmax state.
pub fn decode_tiles(head_dim: u32, limit: u32) -> DecodeTiles {
    let fixed = 8192 + 2048 + 3 * 64;
    let first = if head_dim <= 128 { 32 } else { 16 };
    let tiles = |keys: u32| DecodeTiles {
        keys,
        vecs: keys * (head_dim / 4 + 1),
    };
    [first, first / 2, first / 4]
        .into_iter()
        .map(tiles)
        .find(|t| fixed + 2 * 16 * t.vecs <= limit)
        .unwrap_or(tiles(first / 4))
}

/// The source of `kernel` with its typed buffers in `dtype`.
pub fn source(kernel: &Kernel, dtype: DType, f: Features) -> String {
    assert!(
        kernel.dtypes.contains(&dtype),
        "{} has no {dtype} variant",
        kernel.file
    );
    let native_f16 = f.shader_f16 && dtype == DType::F16 && !kernel.typed.is_empty();
    let subgroups = f.subgroup && kernel.reduces;
    let mut s = String::new();
    let coop = kernel.cooperative.then(|| {
        f.cooperative_matrix
            .filter(|_| f.shader_f16)
            .unwrap_or_else(|| panic!("{} needs cooperative matrices and f16", kernel.file))
    });
    if native_f16 || coop.is_some() {
        s += "enable f16;\n";
    }
    if let Some(c) = coop {
        s += "enable wgpu_cooperative_matrix;\n";
        s += &format!("const F: u32 = {}u;\n", c.side);
    }
    s += &format!("const WG: u32 = {WG}u;\n");
    // The lowest f32: a start for maxima whose exponentials underflow to 0, without the
    // infinities WGSL has no literal for.
    s += "const NEG_BIG: f32 = -3.40282347e38;\n";
    if dtype == DType::BF16 && kernel.typed.iter().any(|t| t.access == Access::ReadWrite) {
        s += BF16_ROUND;
    }
    if BLOCKS.contains(&dtype) {
        s += BLOCK_HELPERS;
    }
    if kernel.typed.iter().any(|t| t.wide.is_some()) {
        s += "struct W8 { lo: vec4<f32>, hi: vec4<f32> }\n";
        if dtype == DType::BF16 {
            s += "fn bf16_pair(w: u32) -> vec2<f32> { \
                  return vec2<f32>(bitcast<f32>(w << 16u), bitcast<f32>(w & 0xffff0000u)); }\n";
        }
    }
    for t in kernel.typed {
        s += &accessor(t, dtype, native_f16);
    }
    if kernel.reduces {
        s += if subgroups {
            SUBGROUP_REDUCE
        } else {
            WORKGROUP_REDUCE
        };
    }
    let (arg, init) = if subgroups {
        (", @builtin(subgroup_size) sgs: u32", "sg_size = sgs;")
    } else {
        ("", "")
    };
    let body = kernel
        .source
        .replace("$SG_ARG", arg)
        .replace("$SG_INIT", init);
    match coop {
        Some(c) => s + &body.replace("coop_matFxF", &format!("coop_mat{0}x{0}", c.side)),
        None => s + &body,
    }
}

/// Declares buffer `t` and its `_at(i) -> f32` reader (and `_set2(i, a, b)`, writing
/// elements i and i + 1 with i even, where it is writable: 16-bit elements are written a
/// whole 32-bit word at a time so that no two threads share a word).
fn accessor(t: &Typed, dtype: DType, native_f16: bool) -> String {
    if BLOCKS.contains(&dtype) {
        return block_accessor(t, dtype);
    }
    let (n, b) = (t.name, t.binding);
    let access = match t.access {
        Access::Read => "read",
        Access::ReadWrite => "read_write",
    };
    let (elem, at, set2) = match dtype {
        DType::F32 => (
            "f32",
            format!("return {n}[i];"),
            format!("{n}[i] = a; {n}[i + 1u] = b;"),
        ),
        DType::F16 if native_f16 => (
            "f16",
            format!("return f32({n}[i]);"),
            format!("{n}[i] = f16(a); {n}[i + 1u] = f16(b);"),
        ),
        DType::F16 => (
            "u32",
            format!("return unpack2x16float({n}[i >> 1u])[i & 1u];"),
            format!("{n}[i >> 1u] = pack2x16float(vec2<f32>(a, b));"),
        ),
        DType::BF16 => (
            "u32",
            format!(
                "let w = {n}[i >> 1u]; return bitcast<f32>(select(w << 16u, w & 0xffff0000u, (i & 1u) == 1u));"
            ),
            format!("{n}[i >> 1u] = bf16_bits(a) | (bf16_bits(b) << 16u);"),
        ),
        other => panic!("no {other} buffers in shaders"),
    };
    let mut s = format!(
        "@group(0) @binding({b}) var<storage, {access}> {n}: array<{elem}>;\n\
         fn {n}_at(i: u32) -> f32 {{ {at} }}\n"
    );
    if t.access == Access::ReadWrite {
        s += &format!("fn {n}_set2(i: u32, a: f32, b: f32) {{ {set2} }}\n");
    }
    if let Some(wb) = t.wide {
        assert_eq!(t.access, Access::Read, "wide buffers are read-only");
        let (vec, at8) = match dtype {
            DType::F32 => (
                "vec4<f32>",
                format!("return W8({n}_wide[2u * g], {n}_wide[2u * g + 1u]);"),
            ),
            DType::F16 => (
                "vec4<u32>",
                format!(
                    "let q = {n}_wide[g]; \
                     return W8(vec4<f32>(unpack2x16float(q.x), unpack2x16float(q.y)), \
                     vec4<f32>(unpack2x16float(q.z), unpack2x16float(q.w)));"
                ),
            ),
            DType::BF16 => (
                "vec4<u32>",
                format!(
                    "let q = {n}_wide[g]; \
                     return W8(vec4<f32>(bf16_pair(q.x), bf16_pair(q.y)), \
                     vec4<f32>(bf16_pair(q.z), bf16_pair(q.w)));"
                ),
            ),
            other => panic!("no {other} buffers in shaders"),
        };
        s += &format!(
            "@group(0) @binding({wb}) var<storage, read> {n}_wide: array<{vec}>;\n\
             fn {n}_at8(g: u32) -> W8 {{ {at8} }}\n"
        );
    }
    s
}

/// Declares read-only buffer `t` of GGUF blocks as words, its `_at(i) -> f32` reader and,
/// where it is also bound wide, its `_at8(g) -> W8` reader (the wide binding is words too:
/// a piece of 8 quants is 2 words in every format here).
fn block_accessor(t: &Typed, dtype: DType) -> String {
    assert_eq!(t.access, Access::Read, "{dtype} buffers are read-only");
    let (at, at8) = match dtype {
        DType::Q8_0 => (Q8_0_AT, Q8_0_AT8),
        DType::Q4_0 => (Q4_0_AT, Q4_0_AT8),
        DType::Q4_1 => (Q4_1_AT, Q4_1_AT8),
        DType::Q4K => (Q4K_AT, Q4K_AT8),
        DType::Q5K => (Q5K_AT, Q5K_AT8),
        DType::Q6K => (Q6K_AT, Q6K_AT8),
        DType::Fp8 => (FP8_AT, FP8_AT8),
        other => panic!("no {other} accessors"),
    };
    let (n, b) = (t.name, t.binding);
    let mut s = format!("@group(0) @binding({b}) var<storage, read> {n}: array<u32>;\n");
    s += &at.replace("$N", n).replace("$A", n);
    if let Some(wb) = t.wide {
        let wide = format!("{n}_wide");
        s += &format!("@group(0) @binding({wb}) var<storage, read> {wide}: array<u32>;\n");
        s += &at8.replace("$N", n).replace("$A", &wide);
    }
    s
}

/// Unpacking shared by the block accessors: four signed bytes, the bits under `mask` of
/// four bytes (four low nibbles: `u4x4`), one signed byte, four e4m3 bytes (their exponent
/// rebiased into an f32's, subnormals — exponent 0 — as m · 2^-9: a GPU may flush f32
/// subnormals, which the bit move alone would make of them), and the 6-bit scale and min of
/// K-quant sub-block j from its 12 packed scale bytes (words x, y, z of `s`). Sub-block j's
/// bytes stand at byte j % 4 of fixed words, so both forms are shifts and masks, one
/// selected: the lanes of a product read different sub-blocks, where a branch on j and a
/// vector indexed at run time held Q4_K and Q5_K decode to 91.0 and 79.7 tok/s, against
/// 149.2 and 122.2 (H200 through Vulkan, random Llama-3.1-8B-shaped files, B=1).
const BLOCK_HELPERS: &str = "
fn i8x4(u: u32) -> vec4<f32> {
    return vec4<f32>(bitcast<vec4<i32>>(vec4<u32>(u << 24u, u << 16u, u << 8u, u)) >> vec4<u32>(24u));
}
fn bits4(u: u32, mask: u32) -> vec4<f32> {
    return vec4<f32>((vec4<u32>(u) >> vec4<u32>(0u, 8u, 16u, 24u)) & vec4<u32>(mask));
}
fn u4x4(u: u32) -> vec4<f32> {
    return bits4(u, 15u);
}
fn i8_at(w: u32, k: u32) -> f32 {
    return f32(bitcast<i32>(w << (24u - 8u * k)) >> 24u);
}
fn e4m3x4(u: u32) -> vec4<f32> {
    let b = (vec4<u32>(u) >> vec4<u32>(0u, 8u, 16u, 24u)) & vec4<u32>(255u);
    let e = (b >> vec4<u32>(3u)) & vec4<u32>(15u);
    let m = b & vec4<u32>(7u);
    let normal = bitcast<vec4<f32>>(((b & vec4<u32>(128u)) << vec4<u32>(24u))
        | ((e + vec4<u32>(120u)) << vec4<u32>(23u)) | (m << vec4<u32>(20u)));
    let sign = select(vec4<f32>(1.0), vec4<f32>(-1.0), b >= vec4<u32>(128u));
    return select(normal, sign * vec4<f32>(m) * 0.001953125, e == vec4<u32>(0u));
}
fn k4_scale_min(s: vec3<u32>, j: u32) -> vec2<f32> {
    let at = 8u * (j & 3u);
    let y = s.x >> at;
    let z = s.y >> at;
    let w = s.z >> at;
    let low = vec2<u32>(y & 63u, z & 63u);
    let high = vec2<u32>((w & 15u) | (((y >> 6u) & 3u) << 4u),
                         ((w >> 4u) & 15u) | (((z >> 6u) & 3u) << 4u));
    return vec2<f32>(select(low, high, j >= 4u));
}
";

// Q8_0 pairs: word 0 holds both blocks' f16 scales, words 1-8 and 9-16 their quants.
const Q8_0_AT: &str = "
fn $N_at(i: u32) -> f32 {
    let b = i >> 5u;
    let base = (b >> 1u) * 17u;
    let qw = $A[base + 1u + ((b & 1u) << 3u) + ((i & 31u) >> 2u)];
    let q = bitcast<i32>(qw << (24u - 8u * (i & 3u))) >> 24u;
    return unpack2x16float($A[base])[b & 1u] * f32(q);
}
";
const Q8_0_AT8: &str = "
fn $N_at8(g: u32) -> W8 {
    let b = g >> 2u;
    let base = (b >> 1u) * 17u;
    let d = unpack2x16float($A[base])[b & 1u];
    let o = base + 1u + ((b & 1u) << 3u) + ((g & 3u) << 1u);
    return W8(d * i8x4($A[o]), d * i8x4($A[o + 1u]));
}
";

// FP8 blocks of 128: word 0 holds the f32 scale, words 1-32 the e4m3 bytes in order.
const FP8_AT: &str = "
fn $N_at(i: u32) -> f32 {
    let base = (i >> 7u) * 33u;
    let qw = $A[base + 1u + ((i & 127u) >> 2u)];
    return bitcast<f32>($A[base]) * e4m3x4(qw)[i & 3u];
}
";
const FP8_AT8: &str = "
fn $N_at8(g: u32) -> W8 {
    let base = (g >> 4u) * 33u;
    let d = bitcast<f32>($A[base]);
    let o = base + 1u + ((g & 15u) << 1u);
    return W8(d * e4m3x4($A[o]), d * e4m3x4($A[o + 1u]));
}
";

// Q4_0 pairs: word 0 holds both blocks' f16 scales, words 1-4 and 5-8 their 16 bytes whose
// low nibbles are elements 0-15 and high nibbles 16-31, offset by 8.
const Q4_0_AT: &str = "
fn $N_at(i: u32) -> f32 {
    let b = i >> 5u;
    let base = (b >> 1u) * 9u;
    let j = i & 31u;
    let qw = $A[base + 1u + ((b & 1u) << 2u) + ((j & 15u) >> 2u)];
    let q = (qw >> (8u * (j & 3u) + 4u * (j >> 4u))) & 15u;
    return unpack2x16float($A[base])[b & 1u] * (f32(q) - 8.0);
}
";
const Q4_0_AT8: &str = "
fn $N_at8(g: u32) -> W8 {
    let b = g >> 2u;
    let base = (b >> 1u) * 9u;
    let d = unpack2x16float($A[base])[b & 1u];
    let o = base + 1u + ((b & 1u) << 2u) + ((g & 1u) << 1u);
    let s = 4u * ((g >> 1u) & 1u);
    return W8(d * (u4x4($A[o] >> s) - 8.0), d * (u4x4($A[o + 1u] >> s) - 8.0));
}
";

// Q4_1: word 0 holds the f16 scale and min, words 1-4 the 16 bytes whose low nibbles are
// elements 0-15 and high nibbles 16-31.
const Q4_1_AT: &str = "
fn $N_at(i: u32) -> f32 {
    let base = (i >> 5u) * 5u;
    let j = i & 31u;
    let dm = unpack2x16float($A[base]);
    let qw = $A[base + 1u + ((j & 15u) >> 2u)];
    let q = (qw >> (8u * (j & 3u) + 4u * (j >> 4u))) & 15u;
    return dm.x * f32(q) + dm.y;
}
";
const Q4_1_AT8: &str = "
fn $N_at8(g: u32) -> W8 {
    let base = (g >> 2u) * 5u;
    let dm = unpack2x16float($A[base]);
    let o = base + 1u + ((g & 1u) << 1u);
    let s = 4u * ((g >> 1u) & 1u);
    return W8(dm.x * u4x4($A[o] >> s) + dm.y, dm.x * u4x4($A[o + 1u] >> s) + dm.y);
}
";

// Q4_K super-blocks of 256: word 0 the f16 scale and min scale, words 1-3 the packed
// 6-bit scales and mins of 8 sub-blocks of 32, words 4-35 the quants: 64 elements per 32
// bytes, sub-block 2c in the low nibbles of bytes 32c..32c+32, 2c + 1 in the high ones.
const Q4K_AT: &str = "
fn $N_at(i: u32) -> f32 {
    let base = (i >> 8u) * 36u;
    let e = i & 255u;
    let c = e >> 6u;
    let h = (e >> 5u) & 1u;
    let l = e & 31u;
    let dd = unpack2x16float($A[base]);
    let sm = k4_scale_min(vec3<u32>($A[base + 1u], $A[base + 2u], $A[base + 3u]), 2u * c + h);
    let q = ($A[base + 4u + 8u * c + (l >> 2u)] >> (8u * (l & 3u) + 4u * h)) & 15u;
    return (dd.x * sm.x) * f32(q) - dd.y * sm.y;
}
";
const Q4K_AT8: &str = "
fn $N_at8(g: u32) -> W8 {
    let base = (g >> 5u) * 36u;
    let p = g & 31u;
    let c = p >> 3u;
    let h = (p >> 2u) & 1u;
    let dd = unpack2x16float($A[base]);
    let sm = k4_scale_min(vec3<u32>($A[base + 1u], $A[base + 2u], $A[base + 3u]), 2u * c + h);
    let d = dd.x * sm.x;
    let m = dd.y * sm.y;
    let o = base + 4u + 8u * c + 2u * (p & 3u);
    return W8(d * u4x4($A[o] >> (4u * h)) - m, d * u4x4($A[o + 1u] >> (4u * h)) - m);
}
";

// Q5_K super-blocks of 256: Q4_K's scale words (0-3), then words 4-11 the high bits (bit
// 2c + h of byte l: element 64c + 32h + l) and words 12-43 the low nibbles laid out as
// Q4_K's quants.
const Q5K_AT: &str = "
fn $N_at(i: u32) -> f32 {
    let base = (i >> 8u) * 44u;
    let e = i & 255u;
    let c = e >> 6u;
    let h = (e >> 5u) & 1u;
    let l = e & 31u;
    let dd = unpack2x16float($A[base]);
    let sm = k4_scale_min(vec3<u32>($A[base + 1u], $A[base + 2u], $A[base + 3u]), 2u * c + h);
    let lo = ($A[base + 12u + 8u * c + (l >> 2u)] >> (8u * (l & 3u) + 4u * h)) & 15u;
    let hi = ($A[base + 4u + (l >> 2u)] >> (8u * (l & 3u) + 2u * c + h)) & 1u;
    return (dd.x * sm.x) * f32(lo + 16u * hi) - dd.y * sm.y;
}
";
const Q5K_AT8: &str = "
fn $N_at8(g: u32) -> W8 {
    let base = (g >> 5u) * 44u;
    let p = g & 31u;
    let c = p >> 3u;
    let h = (p >> 2u) & 1u;
    let dd = unpack2x16float($A[base]);
    let sm = k4_scale_min(vec3<u32>($A[base + 1u], $A[base + 2u], $A[base + 3u]), 2u * c + h);
    let d = dd.x * sm.x;
    let m = dd.y * sm.y;
    let o = base + 12u + 8u * c + 2u * (p & 3u);
    let oh = base + 4u + 2u * (p & 3u);
    let sh = 2u * c + h;
    return W8(d * (u4x4($A[o] >> (4u * h)) + 16.0 * bits4($A[oh] >> sh, 1u)) - m,
              d * (u4x4($A[o + 1u] >> (4u * h)) + 16.0 * bits4($A[oh + 1u] >> sh, 1u)) - m);
}
";

// Q6_K pairs: word 0 holds both blocks' f16 scales d, then each block's other 208 bytes
// (52 words from word 1 + 52b): words 0-31 the low nibbles, 32-47 the high 2-bit pairs,
// 48-51 sixteen signed 8-bit sub-block scales. Element 128n + 32t + l (t < 4, l < 32) is
// nibble t / 2 of low byte 64n + 32(t % 2) + l and pair t of high byte 32n + l, scaled by
// d times scale 8n + 2t + l / 16, offset by 32.
const Q6K_AT: &str = "
fn $N_at(i: u32) -> f32 {
    let b = i >> 8u;
    let o = (b >> 1u) * 105u + 1u + 52u * (b & 1u);
    let e = i & 255u;
    let n = e >> 7u;
    let t = (e >> 5u) & 3u;
    let l = e & 31u;
    let lb = 64u * n + 32u * (t & 1u) + l;
    let lo = ($A[o + (lb >> 2u)] >> (8u * (lb & 3u) + 4u * (t >> 1u))) & 15u;
    let hb = 32u * n + l;
    let hi = ($A[o + 32u + (hb >> 2u)] >> (8u * (hb & 3u) + 2u * t)) & 3u;
    let s = 8u * n + 2u * t + (l >> 4u);
    let d = unpack2x16float($A[(b >> 1u) * 105u])[b & 1u] * i8_at($A[o + 48u + (s >> 2u)], s & 3u);
    return d * (f32(lo | (hi << 4u)) - 32.0);
}
";
const Q6K_AT8: &str = "
fn $N_at8(g: u32) -> W8 {
    let b = g >> 5u;
    let o = (b >> 1u) * 105u + 1u + 52u * (b & 1u);
    let p = g & 31u;
    let n = p >> 4u;
    let t = (p >> 2u) & 3u;
    let r = p & 3u;
    let ol = o + 16u * n + 8u * (t & 1u) + 2u * r;
    let oh = o + 32u + 8u * n + 2u * r;
    let s = 8u * n + 2u * t + (r >> 1u);
    let d = unpack2x16float($A[(b >> 1u) * 105u])[b & 1u] * i8_at($A[o + 48u + (s >> 2u)], s & 3u);
    let ls = 4u * (t >> 1u);
    return W8(d * (u4x4($A[ol] >> ls) + 16.0 * bits4($A[oh] >> (2u * t), 3u) - 32.0),
              d * (u4x4($A[ol + 1u] >> ls) + 16.0 * bits4($A[oh + 1u] >> (2u * t), 3u) - 32.0));
}
";

/// f32 to bf16 bits, rounded to nearest even (NaN stays NaN).
const BF16_ROUND: &str = "
fn bf16_bits(x: f32) -> u32 {
    let b = bitcast<u32>(x);
    if ((b & 0x7fffffffu) > 0x7f800000u) {
        return 0x7fc0u;
    }
    return (b + 0x7fffu + ((b >> 16u) & 1u)) >> 16u;
}
";

/// Sums and maxima over the workgroup, returned to every thread, in an order that
/// depends on WG only.
const WORKGROUP_REDUCE: &str = "
var<workgroup> red: array<f32, WG>;

fn wg_sum(v: f32, lid: u32) -> f32 {
    red[lid] = v;
    workgroupBarrier();
    for (var s = WG / 2u; s > 0u; s /= 2u) {
        if (lid < s) {
            red[lid] += red[lid + s];
        }
        workgroupBarrier();
    }
    let t = red[0];
    workgroupBarrier();
    return t;
}

fn wg_max(v: f32, lid: u32) -> f32 {
    red[lid] = v;
    workgroupBarrier();
    for (var s = WG / 2u; s > 0u; s /= 2u) {
        if (lid < s) {
            red[lid] = max(red[lid], red[lid + s]);
        }
        workgroupBarrier();
    }
    let t = red[0];
    workgroupBarrier();
    return t;
}
";

/// The same through subgroups: each subgroup reduces in registers, then every thread
/// adds the subgroups' results in subgroup order.
const SUBGROUP_REDUCE: &str = "
var<workgroup> red: array<f32, WG>;
var<private> sg_size: u32;

fn wg_sum(v: f32, lid: u32) -> f32 {
    let s = subgroupAdd(v);
    if (lid % sg_size == 0u) {
        red[lid / sg_size] = s;
    }
    workgroupBarrier();
    var t = 0.0;
    for (var i = 0u; i < WG / sg_size; i++) {
        t += red[i];
    }
    workgroupBarrier();
    return t;
}

fn wg_max(v: f32, lid: u32) -> f32 {
    let s = subgroupMax(v);
    if (lid % sg_size == 0u) {
        red[lid / sg_size] = s;
    }
    workgroupBarrier();
    var t = NEG_BIG;
    for (var i = 0u; i < WG / sg_size; i++) {
        t = max(t, red[i]);
    }
    workgroupBarrier();
    return t;
}
";

#[cfg(test)]
mod tests {
    use super::*;
    use naga::back::msl;
    use naga::valid::{Capabilities, ValidationFlags, Validator};

    /// The workgroup memory `entry` of a module (overrides processed) takes.
    fn workgroup_bytes(module: &naga::Module, info: &naga::valid::ModuleInfo, entry: &str) -> u32 {
        let i = module
            .entry_points
            .iter()
            .position(|e| e.name == entry)
            .unwrap();
        let used = info.get_entry_point(i);
        module
            .global_variables
            .iter()
            .filter(|(h, v)| v.space == naga::AddressSpace::WorkGroup && !used[*h].is_empty())
            .map(|(_, v)| module.types[v.ty].inner.size(module.to_ctx()))
            .sum()
    }

    /// The most workgroup memory `decode` takes with the tiles the host picks for a
    /// device of MIN_WORKGROUP_MEMORY, over the head sizes it runs (multiples of 8 up to
    /// 256).
    fn decode_workgroup_bytes(src: &str, caps: Capabilities) -> u32 {
        let module = naga::front::wgsl::parse_str(src).unwrap();
        let info = Validator::new(ValidationFlags::all(), caps)
            .validate(&module)
            .unwrap();
        (8..=256)
            .step_by(8)
            .map(|head_dim| {
                let t = decode_tiles(head_dim, MIN_WORKGROUP_MEMORY);
                let constants = [
                    ("TN".to_string(), f64::from(t.keys)),
                    ("TILE_VECS".to_string(), f64::from(t.vecs)),
                ]
                .into_iter()
                .collect();
                let (module, info) = naga::back::pipeline_constants::process_overrides(
                    &module, &info, None, &constants,
                )
                .unwrap();
                workgroup_bytes(&module, &info, "decode")
            })
            .max()
            .unwrap()
    }

    /// The feature sets `kernel` is built with: with and without f16 and subgroups, and
    /// for a cooperative-matrix kernel, f16 and subgroups with the fragment sides of Metal
    /// and lavapipe (8) and of NVIDIA (16) and their subgroup sizes.
    fn variants(kernel: &Kernel) -> Vec<Features> {
        if kernel.cooperative {
            return [(8, 32), (8, 8), (16, 32)]
                .into_iter()
                .map(|(side, subgroup_size)| Features {
                    shader_f16: true,
                    subgroup: true,
                    cooperative_matrix: Some(CooperativeMatrix {
                        side,
                        subgroup_size,
                    }),
                })
                .collect();
        }
        [false, true]
            .into_iter()
            .flat_map(|shader_f16| {
                [false, true].map(|subgroup| Features {
                    shader_f16,
                    subgroup,
                    cooperative_matrix: None,
                })
            })
            .collect()
    }

    /// Every kernel in every variant parses and validates, translates to Metal Shading
    /// Language, and fits Metal's 32 KiB of workgroup memory (decode attention with the
    /// tiles the host picks there): a shader error fails here on machines without any
    /// adapter.
    #[test]
    fn every_shader_validates_and_translates_to_metal() {
        for kernel in KERNELS {
            for &dtype in kernel.dtypes {
                for f in variants(kernel) {
                    let what = format!("{} {dtype} {f:?}", kernel.file);
                    let src = source(kernel, dtype, f);
                    let module = naga::front::wgsl::parse_str(&src)
                        .unwrap_or_else(|e| panic!("{what}: {}", e.emit_to_string(&src)));
                    // pack2x16float/unpack2x16float: every WebGPU adapter has them.
                    let mut caps = Capabilities::SHADER_FLOAT16_IN_FLOAT32;
                    caps.set(Capabilities::SHADER_FLOAT16, f.shader_f16);
                    caps.set(Capabilities::SUBGROUP, f.subgroup);
                    caps.set(
                        Capabilities::COOPERATIVE_MATRIX,
                        f.cooperative_matrix.is_some(),
                    );
                    let info = Validator::new(ValidationFlags::all(), caps)
                        .validate(&module)
                        .unwrap_or_else(|e| panic!("{what}: {}", e.emit_to_string(&src)));
                    for entry in kernel.entries {
                        assert!(
                            module.entry_points.iter().any(|e| e.name == *entry),
                            "{what}: no entry point {entry}"
                        );
                    }
                    // Override constants keep their defaults here (the host sets
                    // them per pipeline).
                    let (module, info) = naga::back::pipeline_constants::process_overrides(
                        &module,
                        &info,
                        None,
                        &Default::default(),
                    )
                    .unwrap_or_else(|e| panic!("{what}: overrides: {e}"));
                    let options = msl::Options {
                        lang_version: (2, 4),
                        ..Default::default()
                    };
                    msl::write_string(&module, &info, &options, &msl::PipelineOptions::default())
                        .unwrap_or_else(|e| panic!("{what}: Metal translation: {e}"));
                    for ep in module.entry_points.iter().map(|e| e.name.as_str()) {
                        let bytes = if ep == "decode" {
                            decode_workgroup_bytes(&src, caps)
                        } else {
                            workgroup_bytes(&module, &info, ep)
                        };
                        assert!(
                            bytes <= MIN_WORKGROUP_MEMORY,
                            "{what} {ep}: {bytes} bytes of workgroup memory"
                        );
                    }
                }
            }
        }
    }
}
