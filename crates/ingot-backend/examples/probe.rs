use ingot_backend::cpu::CpuBackend;
use ingot_backend::quant::testing::random_quant_row;
use ingot_backend::{Backend, DType, MatmulOut};
use rand::SeedableRng;
use std::time::Instant;
fn main() {
    let b = CpuBackend::new(Some(2)).unwrap();
    let mut rng = rand::rngs::StdRng::seed_from_u64(1);
    for (dtype, n, k, reps) in [
        (DType::Q8_0, 49152, 576, 50),
        (DType::Q4_1, 576, 576, 2000),
        (DType::Q4_1, 3072, 576, 500),
        (DType::Q4_1, 576, 1536, 500),
    ] {
        let wb: Vec<u8> = (0..n)
            .flat_map(|_| random_quant_row(dtype, k, &mut rng))
            .collect();
        let mut w = b.alloc(dtype, n * k).unwrap();
        b.upload(&mut w, &wb).unwrap();
        let x = b.alloc(DType::F32, k).unwrap();
        let mut out = b.alloc(DType::F32, n).unwrap();
        let t = Instant::now();
        for _ in 0..reps {
            b.matmul(
                &x,
                &w,
                None,
                1,
                n,
                k,
                MatmulOut {
                    buf: &mut out,
                    row_stride: n,
                    col_offset: 0,
                },
            );
        }
        let dt = t.elapsed().as_secs_f64() / reps as f64;
        println!(
            "{dtype} {n}x{k}: {:.1} us, {:.2} GB/s",
            dt * 1e6,
            wb.len() as f64 / dt / 1e9
        );
    }
}
