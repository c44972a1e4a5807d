// Run on the GPU machine (the repository's build does not compile this):
//   nvcc -O2 -std=c++17 -arch=sm_90 scripts/gpu/tma_gemm.cu -lcublas -lcuda -o /tmp/tma_gemm && /tmp/tma_gemm
//
// Microbenchmark: a 16-row decode product (out = x · wᵀ, bf16 in, f32 sums) whose weights
// and input reach shared memory by tensor copies (TMA, `cp.async.bulk.tensor.2d`: one copy
// a 64-wide k slab of BN weight rows or of the 16 input rows, 128-byte swizzled) into a ring
// of stages guarded by mbarriers. One producer lane issues the copies; 4 or 8 consumer warps
// load m16n8k16 fragments from the stages and release each stage through its own mbarrier,
// so no block-wide barrier sits in the stream. One block an SM loops over work units (BN
// weight rows x a k part; f32 partial sums per k part, their sum left out of the timing as
// a later kernel would take it). Checked against a naive f32 product; timed per launch with
// events after a 200 MB write that flushes L2, beside cuBLAS (cublasGemmEx, default
// algorithm) on the same shapes, and beside the same kernel with no fragment loads or mma
// (its copies alone).
#include <algorithm>
#include <cstdio>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <random>
#include <vector>
#include <cublas_v2.h>
#include <cuda.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#define CHECK(x)                                                                   \
  do {                                                                             \
    cudaError_t e = (x);                                                           \
    if (e != cudaSuccess) {                                                        \
      printf("%s:%d %s\n", __FILE__, __LINE__, cudaGetErrorString(e));             \
      exit(1);                                                                     \
    }                                                                              \
  } while (0)

constexpr int M = 16;        // input rows

__device__ __forceinline__ unsigned smem_addr(const void* p) {
  return static_cast<unsigned>(__cvta_generic_to_shared(p));
}
__device__ __forceinline__ void mbar_init(unsigned a, unsigned count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(a), "r"(count));
}
__device__ __forceinline__ void mbar_expect(unsigned a, unsigned bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(a), "r"(bytes) : "memory");
}
__device__ __forceinline__ void mbar_arrive(unsigned a) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(a) : "memory");
}
__device__ __forceinline__ void mbar_wait(unsigned a, unsigned parity) {
  unsigned ok = 0;
  while (!ok) {
    asm volatile(
        "{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2; selp.u32 %0, 1, 0, p; }"
        : "=r"(ok)
        : "r"(a), "r"(parity)
        : "memory");
  }
}
__device__ __forceinline__ void tensor_copy(unsigned dst, const CUtensorMap* map, int k, int row, unsigned bar) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], [%4];" ::"r"(dst),
      "l"(map), "r"(k), "r"(row), "r"(bar)
      : "memory");
}
// Programmatic dependent launch: returns once the kernel before has finished (at once where
// the launch did not ask for it), then lets the kernel after launch.
__device__ __forceinline__ void await_previous_kernel() {
  asm volatile("griddepcontrol.wait;" ::: "memory");
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
}
__device__ __forceinline__ void mma(float* c, const unsigned* a, unsigned b0, unsigned b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// A stage holds BK / 64 slabs of BN weight rows x 128 bytes, then BK / 64 slabs of the 16
// input rows, each 16-byte piece q of row r stored at piece q ^ (r % 8) (the 128-byte
// swizzle). Lane (g, t) takes pieces 2t and 2t + 1 of a slab (k 16t .. 16t + 15) from rows
// g and g + 8 of each m16 tile and of the input, so that the 8 lanes of one phase of a
// 128-bit shared load (rows g and g + 1) meet no bank twice; both operands take k in that
// order, as a dot product may. The consumer warps split a stage's 32-wide k steps four ways
// and, past four warps, its m16 tiles.
constexpr int KW = 4;

template <int BN, int BK, int STAGES, int CONSUMERS, bool MATH>
__global__ void __launch_bounds__(32 * (CONSUMERS + 1), 1)
    tma_gemm(const __grid_constant__ CUtensorMap wmap, const __grid_constant__ CUtensorMap xmap, float* out,
             int n, int k, int ksplit) {
  extern __shared__ __align__(1024) unsigned char smem_raw[];
  unsigned char* smem = reinterpret_cast<unsigned char*>((reinterpret_cast<size_t>(smem_raw) + 1023) & ~size_t(1023));
  constexpr int SLABS = BK / 64, WSLAB = BN * 128, XSLAB = M * 128, STAGE = SLABS * (WSLAB + XSLAB);
  constexpr int MW = CONSUMERS / KW, MT = BN / 16 / MW;
  unsigned long long* full = reinterpret_cast<unsigned long long*>(smem + STAGES * STAGE);
  unsigned long long* empty = full + STAGES;
  float* part = reinterpret_cast<float*>(empty + STAGES);  // [KW][M][BN]
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int kpart = k / ksplit, steps = kpart / BK, units = (n / BN) * ksplit;
  if (threadIdx.x == 0) {
    for (int s = 0; s < STAGES; s++) {
      mbar_init(smem_addr(&full[s]), 1);
      mbar_init(smem_addr(&empty[s]), CONSUMERS);
    }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();
  if (warp == CONSUMERS) {
    if (lane != 0) return;
    auto copy = [&](int slot, int row0, int k, bool weights) {
      unsigned char* stage = smem + slot * STAGE;
#pragma unroll
      for (int sl = 0; sl < SLABS; sl++) {
        if (weights)
          tensor_copy(smem_addr(stage + sl * WSLAB), &wmap, k + sl * 64, row0, smem_addr(&full[slot]));
        else
          tensor_copy(smem_addr(stage + SLABS * WSLAB + sl * XSLAB), &xmap, k + sl * 64, 0, smem_addr(&full[slot]));
      }
    };
    // The first unit's first stages of weights are requested before the wait for the kernel
    // before (no kernel writes weights); its input only after.
    const int pre = min(STAGES, steps);
    {
      const int row0 = (blockIdx.x / ksplit) * BN, k0 = (blockIdx.x % ksplit) * kpart;
      for (int s = 0; s < pre; s++) {
        mbar_expect(smem_addr(&full[s]), (BN + M) * BK * 2);
        copy(s, row0, k0 + s * BK, true);
      }
      await_previous_kernel();
      for (int s = 0; s < pre; s++) copy(s, row0, k0 + s * BK, false);
    }
    int it = pre;
    for (int u = blockIdx.x; u < units; u += gridDim.x) {
      const int row0 = (u / ksplit) * BN, k0 = (u % ksplit) * kpart;
      for (int s = u == (int)blockIdx.x ? pre : 0; s < steps; s++, it++) {
        const int slot = it % STAGES, round = it / STAGES;
        if (it >= STAGES) mbar_wait(smem_addr(&empty[slot]), (round & 1) ^ 1);
        mbar_expect(smem_addr(&full[slot]), (BN + M) * BK * 2);
        copy(slot, row0, k0 + s * BK, true);
        copy(slot, row0, k0 + s * BK, false);
      }
    }
    return;
  }
  await_previous_kernel();
  const int g = lane / 4, t = lane % 4, kw = warp % KW, mt0 = warp / KW * MT;
  int it = 0;
  for (int u = blockIdx.x; u < units; u += gridDim.x) {
    const int row0 = (u / ksplit) * BN, kp = u % ksplit;
    float acc[MT][2][4] = {};
    for (int s = 0; s < steps; s++, it++) {
      const int slot = it % STAGES, round = it / STAGES;
      mbar_wait(smem_addr(&full[slot]), round & 1);
      if (MATH) {
        const unsigned char* stage = smem + slot * STAGE;
#pragma unroll
        for (int cs = kw; cs < BK / 32; cs += KW) {
          const int sl = cs / 2, q = 2 * t + cs % 2, piece = (q ^ g) * 16;
          const unsigned char* xs = stage + SLABS * WSLAB + sl * XSLAB;
          const uint4 xa = *reinterpret_cast<const uint4*>(xs + g * 128 + piece);
          const uint4 xb = *reinterpret_cast<const uint4*>(xs + (g + 8) * 128 + piece);
          const unsigned char* ws = stage + sl * WSLAB;
#pragma unroll
          for (int i = 0; i < MT; i++) {
            const int r = (mt0 + i) * 16 + g;  // r % 8 == g, and (r + 8) % 8 == g
            const uint4 a = *reinterpret_cast<const uint4*>(ws + r * 128 + piece);
            const uint4 b = *reinterpret_cast<const uint4*>(ws + (r + 8) * 128 + piece);
            const unsigned lo[4] = {a.x, b.x, a.y, b.y}, hi[4] = {a.z, b.z, a.w, b.w};
            mma(acc[i][0], lo, xa.x, xa.y);
            mma(acc[i][0], hi, xa.z, xa.w);
            mma(acc[i][1], lo, xb.x, xb.y);
            mma(acc[i][1], hi, xb.z, xb.w);
          }
        }
      }
      __syncwarp();
      if (lane == 0) mbar_arrive(smem_addr(&empty[slot]));
    }
    // acc[i][h]: weight rows (mt0 + i) * 16 + g (+8), input rows 8h + 2t (+1).
#pragma unroll
    for (int i = 0; i < MT; i++)
#pragma unroll
      for (int h = 0; h < 2; h++) {
        float* p = part + (kw * M + 8 * h + 2 * t) * BN + (mt0 + i) * 16 + g;
        p[0] = acc[i][h][0];
        p[BN] = acc[i][h][1];
        p[8] = acc[i][h][2];
        p[BN + 8] = acc[i][h][3];
      }
    asm volatile("bar.sync 1, %0;" ::"n"(32 * CONSUMERS));
    for (int i = threadIdx.x; i < M * BN; i += 32 * CONSUMERS) {
      float v = 0.0f;
      for (int q = 0; q < KW; q++) v += part[q * M * BN + i];
      out[((long long)kp * M + i / BN) * n + row0 + i % BN] = v;
    }
    asm volatile("bar.sync 1, %0;" ::"n"(32 * CONSUMERS));
  }
}

__global__ void reference(const unsigned short* x, const unsigned short* w, float* out, int n, int k) {
  const int j = blockIdx.x * blockDim.x + threadIdx.x, r = blockIdx.y;
  if (j >= n) return;
  float s = 0.0f;
  for (int i = 0; i < k; i++)
    s += __uint_as_float((unsigned)x[(long long)r * k + i] << 16) *
         __uint_as_float((unsigned)w[(long long)j * k + i] << 16);
  out[(long long)r * n + j] = s;
}

struct Shape {
  const char* name;
  int n, k, ksplit;
};

CUtensorMap tensor_map(const unsigned short* w, int n, int k, int bn) {
  CUtensorMap map;
  const cuuint64_t dims[2] = {(cuuint64_t)k, (cuuint64_t)n};
  const cuuint64_t strides[1] = {(cuuint64_t)k * 2};
  const cuuint32_t box[2] = {64, (cuuint32_t)bn}, estr[2] = {1, 1};
  const CUresult r = cuTensorMapEncodeTiled(&map, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 2, (void*)w, dims, strides, box,
                                            estr, CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
                                            CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  if (r != CUDA_SUCCESS) {
    printf("cuTensorMapEncodeTiled: %d\n", (int)r);
    exit(1);
  }
  return map;
}

// Dynamic shared memory of tma_gemm: the ring, its mbarriers, the warps' sums, and 1 KB to
// align the ring to the swizzle's 1024 bytes.
constexpr size_t smem_bytes(int bn, int bk, int stages) {
  return 1024 + (size_t)stages * bk / 64 * (bn + M) * 128 + 2 * stages * 8 + KW * M * bn * 4;
}

template <int BN, int BK, int STAGES, int CONSUMERS, bool MATH>
float run(const Shape& sh, const unsigned short* x, const unsigned short* const* w, float* out, char* flush,
          int sms) {
  const size_t bytes = smem_bytes(BN, BK, STAGES);
  auto f = tma_gemm<BN, BK, STAGES, CONSUMERS, MATH>;
  CHECK(cudaFuncSetAttribute(f, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)bytes));
  const CUtensorMap maps[2] = {tensor_map(w[0], sh.n, sh.k, BN), tensor_map(w[1], sh.n, sh.k, BN)};
  const CUtensorMap xmap = tensor_map(x, M, sh.k, M);
  const int units = sh.n / BN * sh.ksplit;
  const int grid = std::min(units, sms);
  cudaEvent_t a, b;
  cudaEventCreate(&a);
  cudaEventCreate(&b);
  std::vector<float> ts;
  for (int i = 0; i < 21; i++) {
    CHECK(cudaMemsetAsync(flush, i, 200 << 20));
    cudaEventRecord(a);
    f<<<grid, 32 * (CONSUMERS + 1), bytes>>>(maps[i % 2], xmap, out, sh.n, sh.k, sh.ksplit);
    cudaEventRecord(b);
    CHECK(cudaEventSynchronize(b));
    float ms;
    cudaEventElapsedTime(&ms, a, b);
    if (i > 0) ts.push_back(ms * 1000.0f);
  }
  CHECK(cudaGetLastError());
  std::sort(ts.begin(), ts.end());
  return ts[ts.size() / 2];
}

float run_cublas(cublasHandle_t h, const Shape& sh, const unsigned short* x, const unsigned short* const* w,
                 unsigned short* out, char* flush) {
  cudaEvent_t a, b;
  cudaEventCreate(&a);
  cudaEventCreate(&b);
  std::vector<float> ts;
  const float one = 1.0f, zero = 0.0f;
  for (int i = 0; i < 21; i++) {
    CHECK(cudaMemsetAsync(flush, i, 200 << 20));
    cudaEventRecord(a);
    cublasGemmEx(h, CUBLAS_OP_T, CUBLAS_OP_N, sh.n, M, sh.k, &one, w[i % 2], CUDA_R_16BF, sh.k, x, CUDA_R_16BF,
                 sh.k, &zero, out, CUDA_R_16BF, sh.n, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT);
    cudaEventRecord(b);
    CHECK(cudaEventSynchronize(b));
    float ms;
    cudaEventElapsedTime(&ms, a, b);
    if (i > 0) ts.push_back(ms * 1000.0f);
  }
  std::sort(ts.begin(), ts.end());
  return ts[ts.size() / 2];
}

template <int BN, int BK, int STAGES, int CONSUMERS>
void shape(const Shape& sh, const unsigned short* x, const unsigned short* const* w, float* out, float* ref,
           char* flush, int sms, float bw) {
  if (sh.k / sh.ksplit % BK != 0) return;
  reference<<<dim3((sh.n + 127) / 128, M), 128>>>(x, w[0], ref, sh.n, sh.k);
  const float us = run<BN, BK, STAGES, CONSUMERS, true>(sh, x, w, out, flush, sms);
  // The last launch read w[0], as the reference did.
  std::vector<float> got((size_t)sh.ksplit * M * sh.n), want((size_t)M * sh.n);
  CHECK(cudaMemcpy(got.data(), out, got.size() * 4, cudaMemcpyDeviceToHost));
  CHECK(cudaMemcpy(want.data(), ref, want.size() * 4, cudaMemcpyDeviceToHost));
  double err = 0, norm = 0;
  for (size_t i = 0; i < want.size(); i++) {
    float s = 0;
    for (int p = 0; p < sh.ksplit; p++) s += got[p * want.size() + i];
    err = std::max(err, (double)std::fabs(s - want[i]));
    norm = std::max(norm, (double)std::fabs(want[i]));
  }
  const float copy = run<BN, BK, STAGES, CONSUMERS, false>(sh, x, w, out, flush, sms);
  const double floor_us = (double)sh.n * sh.k * 2 / bw * 1e6;
  printf("%-8s BN %3d BK %3d stages %d warps %d ksplit %2d: %7.1f us (copies alone %7.1f; floor %6.1f at %.3f TB/s), "
         "max error %.2e of %.2e\n",
         sh.name, BN, BK, STAGES, CONSUMERS, sh.ksplit, us, copy, floor_us, bw / 1e12, err, norm);
}

// One launchable configuration of tma_gemm (MATH on) for a chain.
using Kernel = void (*)(const CUtensorMap, const CUtensorMap, float*, int, int, int);
struct Config {
  Kernel f;
  size_t bytes;
  int bn, threads;
  const char* name;
};
template <int BN, int BK, int STAGES, int CONSUMERS>
Config config(const char* name) {
  const size_t bytes = smem_bytes(BN, BK, STAGES);
  Kernel f = tma_gemm<BN, BK, STAGES, CONSUMERS, true>;
  CHECK(cudaFuncSetAttribute(f, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)bytes));
  return {f, bytes, BN, 32 * (CONSUMERS + 1), name};
}

// A decode step's products at Llama-3.1-8B shapes, 32 layers of qkv, o, gate/up and down
// back to back over two sets of weights, each product waiting for the one before (with
// programmatic launch: its first weight stages requested before that wait), product p run
// by `cfgs[p]` with k split in `shs[p].ksplit`. Microseconds a layer, median of 5 runs.
float chain_mixed(bool pdl, const Shape* shs, const Config* cfgs, const unsigned short* (*ws)[4],
                  const unsigned short* x, float* out, int sms) {
  CUtensorMap wm[2][4], xm[4];
  for (int p = 0; p < 4; p++) {
    for (int set = 0; set < 2; set++) wm[set][p] = tensor_map(ws[set][p], shs[p].n, shs[p].k, cfgs[p].bn);
    xm[p] = tensor_map(x, M, shs[p].k, M);
  }
  cudaLaunchAttribute attr;
  attr.id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr.val.programmaticStreamSerializationAllowed = 1;
  cudaEvent_t a, b;
  cudaEventCreate(&a);
  cudaEventCreate(&b);
  std::vector<float> ts;
  for (int rep = 0; rep < 6; rep++) {
    cudaEventRecord(a);
    for (int layer = 0; layer < 32; layer++)
      for (int p = 0; p < 4; p++) {
        cudaLaunchConfig_t cfg = {};
        cfg.blockDim = dim3(cfgs[p].threads);
        cfg.dynamicSmemBytes = cfgs[p].bytes;
        cfg.attrs = pdl ? &attr : nullptr;
        cfg.numAttrs = pdl ? 1 : 0;
        cfg.gridDim = dim3(std::min(shs[p].n / cfgs[p].bn * shs[p].ksplit, sms));
        CHECK(cudaLaunchKernelEx(&cfg, cfgs[p].f, wm[layer % 2][p], xm[p], out, shs[p].n, shs[p].k, shs[p].ksplit));
      }
    cudaEventRecord(b);
    CHECK(cudaEventSynchronize(b));
    float ms;
    cudaEventElapsedTime(&ms, a, b);
    if (rep > 0) ts.push_back(ms * 1000.0f / 32);
  }
  std::sort(ts.begin(), ts.end());
  return ts[ts.size() / 2];
}

// The chain with every product on one configuration.
template <int BN, int BK, int STAGES, int CONSUMERS>
float chain(bool pdl, const Shape* shs, const unsigned short* (*ws)[4], const unsigned short* x, float* out,
            int sms) {
  const Config c = config<BN, BK, STAGES, CONSUMERS>("");
  const Config cfgs[4] = {c, c, c, c};
  return chain_mixed(pdl, shs, cfgs, ws, x, out, sms);
}

float chain_cublas(cublasHandle_t h, const Shape* shs, const unsigned short* (*ws)[4], const unsigned short* x,
                   unsigned short* out) {
  cudaEvent_t a, b;
  cudaEventCreate(&a);
  cudaEventCreate(&b);
  std::vector<float> ts;
  const float one = 1.0f, zero = 0.0f;
  for (int rep = 0; rep < 6; rep++) {
    cudaEventRecord(a);
    for (int layer = 0; layer < 32; layer++)
      for (int p = 0; p < 4; p++)
        cublasGemmEx(h, CUBLAS_OP_T, CUBLAS_OP_N, shs[p].n, M, shs[p].k, &one, ws[layer % 2][p], CUDA_R_16BF,
                     shs[p].k, x, CUDA_R_16BF, shs[p].k, &zero, out, CUDA_R_16BF, shs[p].n, CUBLAS_COMPUTE_32F,
                     CUBLAS_GEMM_DEFAULT);
    cudaEventRecord(b);
    CHECK(cudaEventSynchronize(b));
    float ms;
    cudaEventElapsedTime(&ms, a, b);
    if (rep > 0) ts.push_back(ms * 1000.0f / 32);
  }
  std::sort(ts.begin(), ts.end());
  return ts[ts.size() / 2];
}

int main() {
  int sms;
  cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0);
  const Shape shapes[] = {{"qkv", 6144, 4096, 4}, {"o", 4096, 4096, 8}, {"gate/up", 28672, 4096, 2},
                          {"down", 4096, 14336, 8}};
  const size_t wmax = (size_t)28672 * 4096;
  std::vector<unsigned short> host(wmax);
  std::mt19937 rng(1);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  for (auto& v : host) {
    const float f = nd(rng) * 0.05f;
    unsigned u;
    memcpy(&u, &f, 4);
    v = (unsigned short)(u >> 16);
  }
  unsigned short *w[2], *x, *cb_out;
  float *out, *ref;
  char* flush;
  for (auto& p : w) {
    CHECK(cudaMalloc(&p, wmax * 2));
    CHECK(cudaMemcpy(p, host.data(), wmax * 2, cudaMemcpyHostToDevice));
  }
  CHECK(cudaMalloc(&x, (size_t)M * 14336 * 2));
  CHECK(cudaMemcpy(x, host.data() + 12345, (size_t)M * 14336 * 2, cudaMemcpyHostToDevice));
  CHECK(cudaMalloc(&out, (size_t)16 * M * 28672 * 4));
  CHECK(cudaMalloc(&ref, (size_t)M * 28672 * 4));
  CHECK(cudaMalloc(&cb_out, (size_t)M * 28672 * 2));
  CHECK(cudaMalloc(&flush, 200 << 20));
  const float bw = 2.965e12f;  // bytes/s, the roofline's read bandwidth on these machines
  cublasHandle_t h;
  cublasCreate(&h);
  const unsigned short* wc[2] = {w[0], w[1]};
  for (const Shape& sh : shapes) {
    printf("%-8s cuBLAS: %7.1f us\n", sh.name, run_cublas(h, sh, x, wc, cb_out, flush));
    shape<128, 128, 5, 4>(sh, x, wc, out, ref, flush, sms, bw);
    shape<128, 128, 5, 8>(sh, x, wc, out, ref, flush, sms, bw);
    shape<64, 256, 5, 4>(sh, x, wc, out, ref, flush, sms, bw);
    shape<64, 256, 5, 8>(sh, x, wc, out, ref, flush, sms, bw);
    Shape more = sh;
    more.ksplit *= 2;
    shape<128, 128, 5, 8>(more, x, wc, out, ref, flush, sms, bw);
    Shape whole = sh;
    whole.ksplit = 1;
    shape<64, 256, 5, 8>(whole, x, wc, out, ref, flush, sms, bw);
    shape<32, 256, 8, 8>(whole, x, wc, out, ref, flush, sms, bw);
    Shape half = sh;
    half.ksplit = 2;
    shape<32, 256, 8, 8>(half, x, wc, out, ref, flush, sms, bw);
  }
  const unsigned short* layer[2][4];
  for (int set = 0; set < 2; set++)
    for (int p = 0; p < 4; p++) {
      unsigned short* m;
      const size_t len = (size_t)shapes[p].n * shapes[p].k;
      CHECK(cudaMalloc(&m, len * 2));
      CHECK(cudaMemcpy(m, host.data(), len * 2, cudaMemcpyHostToDevice));
      layer[set][p] = m;
    }
  double bytes = 0;
  for (const Shape& sh : shapes) bytes += (double)sh.n * sh.k * 2;
  printf("layer of 4 products (%.0f MB, floor %.1f us): cuBLAS %.1f us\n", bytes / 1e6, bytes / bw * 1e6,
         chain_cublas(h, shapes, layer, x, cb_out));
  printf("  TMA BN 64 BK 256 5 stages 8 warps: %.1f us, with programmatic launch %.1f us\n",
         chain<64, 256, 5, 8>(false, shapes, layer, x, out, sms), chain<64, 256, 5, 8>(true, shapes, layer, x, out, sms));
  printf("  TMA BN 128 BK 128 5 stages 8 warps: %.1f us, with programmatic launch %.1f us\n",
         chain<128, 128, 5, 8>(false, shapes, layer, x, out, sms),
         chain<128, 128, 5, 8>(true, shapes, layer, x, out, sms));
  // Tiles and k splits per product (8 consumer warps each): k split in parts that a later
  // kernel must add, or not at all, with 32-row tiles where 64 leave SMs idle.
  const Config c64 = config<64, 256, 5, 8>("BN 64"), c32 = config<32, 256, 8, 8>("BN 32");
  struct Mix {
    Config c[4];
    int ksplit[4];
  };
  const Mix mixes[] = {{{c64, c64, c64, c64}, {4, 8, 2, 8}}, {{c64, c32, c64, c32}, {1, 1, 1, 1}},
                       {{c32, c32, c32, c32}, {1, 1, 1, 1}}, {{c64, c32, c64, c32}, {4, 1, 2, 1}},
                       {{c32, c32, c64, c32}, {1, 1, 2, 1}}, {{c32, c32, c32, c32}, {2, 1, 1, 1}}};
  for (const Mix& mix : mixes) {
    Shape shs[4];
    for (int p = 0; p < 4; p++) {
      shs[p] = shapes[p];
      shs[p].ksplit = mix.ksplit[p];
    }
    printf("  mixed");
    for (int p = 0; p < 4; p++) printf(" %s %s/%d", shapes[p].name, mix.c[p].name, mix.ksplit[p]);
    printf(": %.1f us, with programmatic launch %.1f us\n", chain_mixed(false, shs, mix.c, layer, x, out, sms),
           chain_mixed(true, shs, mix.c, layer, x, out, sms));
  }
  printf("  cuBLAS again: %.1f us\n", chain_cublas(h, shapes, layer, x, cb_out));
  return 0;
}
