//! WGSL sources of the wgpu kernels, specialized at start for what the adapter can do and
//! for the dtype of the buffers a kernel reads in more than one format (weights, the KV
//! cache). WGSL has no preprocessor, so each source names accessors (`w_at(i)`,
//! `kc_set2(i, a, b)`) and reductions (`wg_sum(v, lid)`) that are generated here.

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
    /// The dtypes its typed buffers may have (one variant each).
    pub dtypes: &'static [DType],
}

const FLOATS: &[DType] = &[DType::F32, DType::F16, DType::BF16];

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
    dtypes: FLOATS,
};

pub const NORM: Kernel = Kernel {
    file: "norm",
    entries: &["rms_norm", "add_rms_norm", "qk_norm"],
    source: include_str!("kernels/norm.wgsl"),
    typed: &[],
    reduces: true,
    dtypes: &[DType::F32],
};

pub const ELEMENTWISE: Kernel = Kernel {
    file: "elementwise",
    entries: &["add_assign", "silu_mul", "gather_rows"],
    source: include_str!("kernels/elementwise.wgsl"),
    typed: &[],
    reduces: false,
    dtypes: &[DType::F32],
};

pub const MATMUL: Kernel = Kernel {
    file: "matmul",
    entries: &["gemv", "gemm"],
    source: include_str!("kernels/matmul.wgsl"),
    typed: &[Typed {
        name: "w",
        binding: 2,
        access: Access::Read,
        wide: Some(6),
    }],
    reduces: false,
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
    dtypes: FLOATS,
};

pub const ARGMAX: Kernel = Kernel {
    file: "argmax",
    entries: &["argmax"],
    source: include_str!("kernels/argmax.wgsl"),
    typed: &[],
    reduces: false,
    dtypes: &[DType::F32],
};

pub const KERNELS: &[&Kernel] = &[
    &EMBEDDING,
    &NORM,
    &ELEMENTWISE,
    &MATMUL,
    &ROPE,
    &ATTENTION,
    &ARGMAX,
];

/// Threads per workgroup of every kernel.
pub const WG: u32 = 256;

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
    if native_f16 {
        s += "enable f16;\n";
    }
    s += &format!("const WG: u32 = {WG}u;\n");
    // The lowest f32: a start for maxima whose exponentials underflow to 0, without the
    // infinities WGSL has no literal for.
    s += "const NEG_BIG: f32 = -3.40282347e38;\n";
    if dtype == DType::BF16 && kernel.typed.iter().any(|t| t.access == Access::ReadWrite) {
        s += BF16_ROUND;
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
    s + &kernel
        .source
        .replace("$SG_ARG", arg)
        .replace("$SG_INIT", init)
}

/// Declares buffer `t` and its `_at(i) -> f32` reader (and `_set2(i, a, b)`, writing
/// elements i and i + 1 with i even, where it is writable: 16-bit elements are written a
/// whole 32-bit word at a time so that no two threads share a word).
fn accessor(t: &Typed, dtype: DType, native_f16: bool) -> String {
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

    /// Every kernel in every variant parses and validates, and translates to Metal
    /// Shading Language: a shader error fails here on machines without any adapter.
    #[test]
    fn every_shader_validates_and_translates_to_metal() {
        for kernel in KERNELS {
            for &dtype in kernel.dtypes {
                for shader_f16 in [false, true] {
                    for subgroup in [false, true] {
                        let f = Features {
                            shader_f16,
                            subgroup,
                        };
                        let what = format!("{} {dtype} {f:?}", kernel.file);
                        let src = source(kernel, dtype, f);
                        let module = naga::front::wgsl::parse_str(&src)
                            .unwrap_or_else(|e| panic!("{what}: {}", e.emit_to_string(&src)));
                        // pack2x16float/unpack2x16float: every WebGPU adapter has them.
                        let mut caps = Capabilities::SHADER_FLOAT16_IN_FLOAT32;
                        caps.set(Capabilities::SHADER_FLOAT16, shader_f16);
                        caps.set(Capabilities::SUBGROUP, subgroup);
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
                        msl::write_string(
                            &module,
                            &info,
                            &options,
                            &msl::PipelineOptions::default(),
                        )
                        .unwrap_or_else(|e| panic!("{what}: Metal translation: {e}"));
                    }
                }
            }
        }
    }
}
