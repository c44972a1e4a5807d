//! Which SIMD kernels the CPU's integer dot products run with, chosen once at start.
//!
//! Every path gives results within rounding of the scalar reference, but not the same
//! bits as another path: the integer sums are exact, the per-block scaling and the final
//! additions are ordered differently. One process uses one path throughout, so its results
//! stay batch-invariant. `INGOT_CPU_ISA=portable|avx2|avx512-vnni` picks a lower path than
//! the CPU offers (to compare them on one machine); asking for one the CPU lacks is an
//! error.

use std::sync::OnceLock;

#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Isa {
    /// Plain Rust, any CPU.
    Portable,
    /// AVX2 + FMA + F16C: `maddubs`/`madd` integer dots, 32 weights a step.
    Avx2,
    /// AVX-512 F/BW/VL + VNNI: `vpdpbusd` integer dots for Q4_0/Q4_1, 64 weights a step;
    /// the other integer kernels are AVX2's, and attention reads 16-bit caches 16 lanes wide.
    Avx512Vnni,
}

impl Isa {
    pub fn name(self) -> &'static str {
        match self {
            Isa::Portable => "portable",
            Isa::Avx2 => "avx2",
            Isa::Avx512Vnni => "avx512-vnni",
        }
    }

    /// Every path this CPU can run, lowest first (tests run each).
    pub fn available() -> Vec<Isa> {
        [Isa::Portable, Isa::Avx2, Isa::Avx512Vnni]
            .into_iter()
            .filter(|&isa| isa <= Isa::best())
            .collect()
    }

    /// The path the kernels use: the best one here unless `INGOT_CPU_ISA` asks for another.
    pub fn selected() -> Isa {
        static SELECTED: OnceLock<Isa> = OnceLock::new();
        *SELECTED.get_or_init(|| match Isa::from_env() {
            Ok(isa) => isa,
            Err(e) => panic!("{e}"),
        })
    }

    /// Checks `INGOT_CPU_ISA` (the backend calls this at start so a bad value is an error
    /// there, not a panic in the first matmul).
    pub fn from_env() -> anyhow::Result<Isa> {
        let best = Isa::best();
        let Ok(asked) = std::env::var("INGOT_CPU_ISA") else {
            return Ok(best);
        };
        let isa = [Isa::Portable, Isa::Avx2, Isa::Avx512Vnni]
            .into_iter()
            .find(|isa| isa.name() == asked)
            .ok_or_else(|| {
                anyhow::anyhow!("INGOT_CPU_ISA={asked}: expected portable, avx2 or avx512-vnni")
            })?;
        anyhow::ensure!(
            isa <= best,
            "INGOT_CPU_ISA={asked}: this CPU supports at most {}",
            best.name()
        );
        Ok(isa)
    }

    fn best() -> Isa {
        #[cfg(target_arch = "x86_64")]
        {
            use std::arch::is_x86_feature_detected as has;
            let avx2 = has!("avx2") && has!("fma") && has!("f16c");
            if avx2 && has!("avx512f") && has!("avx512bw") && has!("avx512vl") && has!("avx512vnni")
            {
                return Isa::Avx512Vnni;
            }
            if avx2 {
                return Isa::Avx2;
            }
        }
        Isa::Portable
    }
}
