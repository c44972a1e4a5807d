// Run on the GPU machine (it has nvcc; the repository's build does not compile this):
//   nvcc -O2 -std=c++17 -arch=sm_90 scripts/gpu/cublaslt_algos.cu -o /tmp/algos -lcublasLt -lcuda
//   /tmp/algos [rows, default 16] [candidates shown per product, default 12]
//
// Probe: every cuBLASLt algorithm (by id, tile, stages, split-K) for the decode products
// at Llama-8B shapes (16 rows unless told), timed from DRAM (weights rotated over copies
// larger than L2), named (the kernel a captured run launches), and for the fastest: does
// the kernel wait for the kernel before it (griddepcontrol.wait)? A one-block kernel lets
// the product launch, waits 50 us, then writes the product's input; behind a programmatic
// edge, a product that does not wait reads the old input.
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>
#include <cuda.h>
#include <cuda_runtime.h>
#include <cublasLt.h>

#define CK(x)                                                                     \
  do {                                                                            \
    long long e_ = (long long)(x);                                                \
    if (e_) { printf("%s:%d %s -> %lld\n", __FILE__, __LINE__, #x, e_); exit(1); } \
  } while (0)

typedef unsigned short u16;

__global__ void fill(u16* p, size_t n, unsigned seed) {
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
    unsigned h = (unsigned)i * 2654435761u ^ seed;
    h ^= h >> 13; h *= 0x5bd1e995u; h ^= h >> 15;
    float f = ((h & 0xffff) / 65536.0f - 0.5f) * 0.1f;
    p[i] = (u16)(__float_as_uint(f) >> 16);
  }
}

__global__ void delayed_copy(const u16* src, u16* dst, int n, unsigned long long ns) {
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
  unsigned long long t0, t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
  do { asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t)); } while (t - t0 < ns);
  for (int i = threadIdx.x; i < n; i += blockDim.x) dst[i] = src[i];
}

struct Cand {
  cublasLtMatmulAlgo_t algo;
  int id, tile, stages, splitk, red, cluster;
  size_t ws;
  float us;
  bool heuristic;
};

static cublasLtHandle_t lt;
static void* workspace;
static const size_t WS = 64 << 20;

struct Problem {
  int m, n, k;
  int copies;
  std::vector<u16*> w;
  u16 *x, *x0, *out, *ref;
  cublasLtMatmulDesc_t desc;
  cublasLtMatrixLayout_t a, b, c;
};

static cublasStatus_t matmul(Problem& p, const cublasLtMatmulAlgo_t* algo, int copy, cudaStream_t s) {
  float alpha = 1.0f, beta = 0.0f;
  return cublasLtMatmul(lt, p.desc, &alpha, p.w[copy], p.a, p.x, p.b, &beta, p.out, p.c, p.out, p.c,
                        algo, workspace, WS, s);
}

static float time_algo(Problem& p, const cublasLtMatmulAlgo_t* algo, cudaStream_t s) {
  cudaEvent_t e0, e1;
  cudaEventCreate(&e0); cudaEventCreate(&e1);
  if (matmul(p, algo, 0, s) != CUBLAS_STATUS_SUCCESS) return -1;
  const int reps = 12;
  cudaEventRecord(e0, s);
  for (int r = 0; r < reps; r++)
    if (matmul(p, algo, (r + 1) % p.copies, s) != CUBLAS_STATUS_SUCCESS) return -1;
  cudaEventRecord(e1, s);
  if (cudaEventSynchronize(e1) != cudaSuccess) { printf("sync failed\n"); exit(1); }
  float ms;
  cudaEventElapsedTime(&ms, e0, e1);
  cudaEventDestroy(e0); cudaEventDestroy(e1);
  return ms * 1000.0f / reps;
}

static std::string kernel_names(Problem& p, const cublasLtMatmulAlgo_t* algo, cudaStream_t s) {
  cudaGraph_t g;
  CK(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal));
  matmul(p, algo, 0, s);
  CK(cudaStreamEndCapture(s, &g));
  size_t n = 0;
  CK(cudaGraphGetNodes(g, nullptr, &n));
  std::vector<cudaGraphNode_t> nodes(n);
  CK(cudaGraphGetNodes(g, nodes.data(), &n));
  std::string names;
  for (auto node : nodes) {
    cudaGraphNodeType t;
    cudaGraphNodeGetType(node, &t);
    if (t == cudaGraphNodeTypeMemset) { names += "[memset] "; continue; }
    if (t != cudaGraphNodeTypeKernel) { names += "[other] "; continue; }
    CUDA_KERNEL_NODE_PARAMS kp;
    memset(&kp, 0, sizeof kp);
    CK(cuGraphKernelNodeGetParams((CUgraphNode)node, &kp));
    const char* name = nullptr;
    if (kp.func) cuFuncGetName(&name, kp.func);
    if (!name && kp.kern) cuKernelGetName(&name, kp.kern);
    names += std::string(name ? name : "?") + "(" + std::to_string(kp.gridDimX) + "x" +
             std::to_string(kp.gridDimY) + "x" + std::to_string(kp.gridDimZ) + ") ";
  }
  cudaGraphDestroy(g);
  return names;
}

// Max |out - ref| of the product behind a programmatic edge from a delayed writer of x.
static std::string wait_test(Problem& p, const cublasLtMatmulAlgo_t* algo, cudaStream_t s) {
  // The reference is the same algorithm run on its input in order (split-K sums differ).
  CK(matmul(p, algo, 0, s));
  CK(cudaStreamSynchronize(s));
  CK(cudaMemcpy(p.ref, p.out, (size_t)p.m * p.n * 2, cudaMemcpyDeviceToDevice));
  CK(cudaMemset(p.out, 0, (size_t)p.m * p.n * 2));
  CK(cudaMemset(p.x, 0, (size_t)p.m * p.k * 2));
  cudaGraph_t g;
  CK(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal));
  delayed_copy<<<1, 256, 0, s>>>(p.x0, p.x, p.m * p.k, 50000);
  matmul(p, algo, 0, s);
  CK(cudaStreamEndCapture(s, &g));
  size_t ne = 0;
  CK(cuGraphGetEdges_v2((CUgraph)g, nullptr, nullptr, nullptr, &ne));
  std::vector<CUgraphNode> from(ne), to(ne);
  std::vector<CUgraphEdgeData> data(ne);
  CK(cuGraphGetEdges_v2((CUgraph)g, from.data(), to.data(), data.data(), &ne));
  // The edge out of the root (delayed_copy has no dependencies).
  std::string what = "no edge";
  for (size_t i = 0; i < ne; i++) {
    size_t deps = 0;
    CK(cuGraphNodeGetDependencies_v2(from[i], nullptr, nullptr, &deps));
    if (deps != 0) continue;
    CUgraphNodeType t;
    cuGraphNodeGetType(to[i], &t);
    if (t != CU_GRAPH_NODE_TYPE_KERNEL) { what = "first node not a kernel"; break; }
    CK(cuGraphRemoveDependencies_v2((CUgraph)g, &from[i], &to[i], &data[i], 1));
    CUgraphEdgeData e;
    memset(&e, 0, sizeof e);
    e.from_port = CU_GRAPH_KERNEL_NODE_PORT_PROGRAMMATIC;
    e.type = CU_GRAPH_DEPENDENCY_TYPE_PROGRAMMATIC;
    CK(cuGraphAddDependencies_v2((CUgraph)g, &from[i], &to[i], &e, 1));
    what = "";
    break;
  }
  if (!what.empty()) { cudaGraphDestroy(g); return what; }
  cudaGraphExec_t ex;
  CK(cudaGraphInstantiate(&ex, g, 0));
  CK(cudaGraphLaunch(ex, s));
  CK(cudaStreamSynchronize(s));
  std::vector<u16> o((size_t)p.m * p.n), r((size_t)p.m * p.n);
  CK(cudaMemcpy(o.data(), p.out, o.size() * 2, cudaMemcpyDeviceToHost));
  CK(cudaMemcpy(r.data(), p.ref, r.size() * 2, cudaMemcpyDeviceToHost));
  size_t bad = 0;
  for (size_t i = 0; i < o.size(); i++) bad += o[i] != r[i];
  cudaGraphExecDestroy(ex);
  cudaGraphDestroy(g);
  CK(cudaMemcpy(p.x, p.x0, (size_t)p.m * p.k * 2, cudaMemcpyDeviceToDevice));
  return bad ? "STALE " + std::to_string(bad) + "/" + std::to_string(o.size()) : "waits";
}

int main(int argc, char** argv) {
  const int m = argc > 1 ? atoi(argv[1]) : 16;
  const int top = argc > 2 ? atoi(argv[2]) : 12;
  CK(cublasLtCreate(&lt));
  printf("cuBLASLt %zu, m = %d\n", cublasLtGetVersion(), m);
  CK(cudaMalloc(&workspace, WS));
  cudaStream_t s;
  CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  struct { const char* name; int n, k; } shapes[] = {
      {"qkv", 6144, 4096}, {"o", 4096, 4096}, {"gate_up", 28672, 4096}, {"down", 4096, 14336}};
  for (auto& sh : shapes) {
    Problem p;
    p.m = m; p.n = sh.n; p.k = sh.k;
    const size_t wbytes = (size_t)p.n * p.k * 2;
    p.copies = std::max<size_t>(2, (300u << 20) / wbytes + 1);
    for (int i = 0; i < p.copies; i++) {
      u16* w;
      CK(cudaMalloc(&w, wbytes));
      fill<<<1024, 256>>>(w, wbytes / 2, 17);  // the same weights in every copy
      p.w.push_back(w);
    }
    CK(cudaMalloc(&p.x, (size_t)m * p.k * 2));
    CK(cudaMalloc(&p.x0, (size_t)m * p.k * 2));
    CK(cudaMalloc(&p.out, (size_t)m * p.n * 2));
    CK(cudaMalloc(&p.ref, (size_t)m * p.n * 2));
    fill<<<64, 256>>>(p.x0, (size_t)m * p.k, 99);
    CK(cudaMemcpy(p.x, p.x0, (size_t)m * p.k * 2, cudaMemcpyDeviceToDevice));
    CK(cublasLtMatmulDescCreate(&p.desc, CUBLAS_COMPUTE_32F, CUDA_R_32F));
    cublasOperation_t ta = CUBLAS_OP_T, tb = CUBLAS_OP_N;
    CK(cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof ta));
    CK(cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof tb));
    CK(cublasLtMatrixLayoutCreate(&p.a, CUDA_R_16BF, p.k, p.n, p.k));
    CK(cublasLtMatrixLayoutCreate(&p.b, CUDA_R_16BF, p.k, m, p.k));
    CK(cublasLtMatrixLayoutCreate(&p.c, CUDA_R_16BF, p.n, m, p.n));
    CK(cudaDeviceSynchronize());

    std::vector<Cand> cands;
    // The heuristic's candidates, as ingot's tuner sees them.
    {
      cublasLtMatmulPreference_t pref;
      CK(cublasLtMatmulPreferenceCreate(&pref));
      size_t ws = WS;
      CK(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws, sizeof ws));
      cublasLtMatmulHeuristicResult_t res[32];
      int found = 0;
      CK(cublasLtMatmulAlgoGetHeuristic(lt, p.desc, p.a, p.b, p.c, p.c, pref, 32, res, &found));
      for (int i = 0; i < found; i++) {
        Cand c{};
        c.algo = res[i].algo;
        c.heuristic = true;
        size_t w;
        cublasLtMatmulAlgoConfigGetAttribute(&c.algo, CUBLASLT_ALGO_CONFIG_ID, &c.id, sizeof c.id, &w);
        cublasLtMatmulAlgoConfigGetAttribute(&c.algo, CUBLASLT_ALGO_CONFIG_TILE_ID, &c.tile, sizeof c.tile, &w);
        cublasLtMatmulAlgoConfigGetAttribute(&c.algo, CUBLASLT_ALGO_CONFIG_SPLITK_NUM, &c.splitk, sizeof c.splitk, &w);
        c.ws = res[i].workspaceSize;
        cands.push_back(c);
      }
      cublasLtMatmulPreferenceDestroy(pref);
    }
    int ids[512], nids = 0;
    CK(cublasLtMatmulAlgoGetIds(lt, CUBLAS_COMPUTE_32F, CUDA_R_32F, CUDA_R_16BF, CUDA_R_16BF, CUDA_R_16BF,
                                CUDA_R_16BF, 512, ids, &nids));
    printf("\n== %s: m %d n %d k %d, %d weight copies, %d algorithm ids, %zu heuristic\n", sh.name, m, p.n,
           p.k, p.copies, nids, cands.size());
    int checked = 0, valid = 0;
    for (int ii = 0; ii < nids; ii++) {
      cublasLtMatmulAlgo_t algo;
      if (cublasLtMatmulAlgoInit(lt, CUBLAS_COMPUTE_32F, CUDA_R_32F, CUDA_R_16BF, CUDA_R_16BF, CUDA_R_16BF,
                                 CUDA_R_16BF, ids[ii], &algo) != CUBLAS_STATUS_SUCCESS)
        continue;
      size_t w = 0;
      std::vector<unsigned> tiles(256), stages(256), clusters(256);
      cublasLtMatmulAlgoCapGetAttribute(&algo, CUBLASLT_ALGO_CAP_TILE_IDS, tiles.data(), tiles.size() * 4, &w);
      tiles.resize(w / 4);
      if (tiles.empty()) tiles.push_back(CUBLASLT_MATMUL_TILE_UNDEFINED);
      w = 0;
      cublasLtMatmulAlgoCapGetAttribute(&algo, CUBLASLT_ALGO_CAP_STAGES_IDS, stages.data(), stages.size() * 4, &w);
      stages.resize(w / 4);
      if (stages.empty()) stages.push_back(CUBLASLT_MATMUL_STAGES_UNDEFINED);
      // No capability lists cluster shapes: auto, 1x1x1 and 2x1x1, which the check filters.
      clusters = {0u, 2u, 3u};
      int splitk_ok = 0;
      cublasLtMatmulAlgoCapGetAttribute(&algo, CUBLASLT_ALGO_CAP_SPLITK_SUPPORT, &splitk_ok, sizeof splitk_ok, &w);
      unsigned redmask = 0;
      cublasLtMatmulAlgoCapGetAttribute(&algo, CUBLASLT_ALGO_CAP_REDUCTION_SCHEME_MASK, &redmask, sizeof redmask, &w);
      printf("id %d: %zu tiles, %zu stages, %zu clusters, split-k %d, reductions %x\n", ids[ii], tiles.size(),
             stages.size(), clusters.size(), splitk_ok, redmask);
      const int splits[] = {1, 2, 4, 8};
      for (unsigned tile : tiles)
        for (unsigned st : stages)
          for (unsigned cl : clusters)
            for (int sk : splits) {
              if (sk > 1 && !splitk_ok) continue;
              for (unsigned red : {0u, 1u, 2u, 4u}) {
                if ((sk == 1) != (red == 0)) continue;
                if (red && !(redmask & red)) continue;
                cublasLtMatmulAlgo_t a = algo;
                cublasLtMatmulAlgoConfigSetAttribute(&a, CUBLASLT_ALGO_CONFIG_TILE_ID, &tile, 4);
                cublasLtMatmulAlgoConfigSetAttribute(&a, CUBLASLT_ALGO_CONFIG_STAGES_ID, &st, 4);
                cublasLtMatmulAlgoConfigSetAttribute(&a, CUBLASLT_ALGO_CONFIG_CLUSTER_SHAPE_ID, &cl, 4);
                cublasLtMatmulAlgoConfigSetAttribute(&a, CUBLASLT_ALGO_CONFIG_SPLITK_NUM, &sk, 4);
                cublasLtMatmulAlgoConfigSetAttribute(&a, CUBLASLT_ALGO_CONFIG_REDUCTION_SCHEME, &red, 4);
                cublasLtMatmulHeuristicResult_t r;
                checked++;
                if (cublasLtMatmulAlgoCheck(lt, p.desc, p.a, p.b, p.c, p.c, &a, &r) != CUBLAS_STATUS_SUCCESS)
                  continue;
                if (r.workspaceSize > WS) continue;
                valid++;
                Cand c{};
                c.algo = a; c.id = ids[ii]; c.tile = tile; c.stages = st; c.splitk = sk; c.red = red;
                c.cluster = cl; c.ws = r.workspaceSize;
                cands.push_back(c);
              }
            }
    }
    printf("%d configurations checked, %d valid\n", checked, valid);
    size_t timed = 0;
    for (auto& c : cands) {
      if (timed >= 3000) { c.us = -1; continue; }
      c.us = time_algo(p, &c.algo, s);
      cudaError_t e = cudaGetLastError();
      if (e != cudaSuccess) { printf("error %s\n", cudaGetErrorString(e)); exit(1); }
      timed++;
    }
    // Retime the best 40 (two passes, the smaller kept) against noise.
    std::vector<Cand*> order;
    for (auto& c : cands) if (c.us > 0) order.push_back(&c);
    std::sort(order.begin(), order.end(), [](Cand* a, Cand* b) { return a->us < b->us; });
    if (order.size() > 40) order.resize(40);
    for (auto* c : order) c->us = std::min(c->us, std::min(time_algo(p, &c->algo, s), time_algo(p, &c->algo, s)));
    std::sort(order.begin(), order.end(), [](Cand* a, Cand* b) { return a->us < b->us; });
    printf("heuristic: ");
    for (auto& c : cands) if (c.heuristic) printf("%.1f(id %d) ", c.us, c.id);
    printf("\n");
    int shown = 0;
    for (auto* c : order) {
      if (shown++ >= top) break;
      printf("%7.1f us  %s id %3d tile %3d stages %3d cluster %2d splitk %d red %u ws %zu | %s| %s\n", c->us,
             c->heuristic ? "H" : " ", c->id, c->tile, c->stages, c->cluster, c->splitk, c->red, c->ws,
             wait_test(p, &c->algo, s).c_str(), kernel_names(p, &c->algo, s).c_str());
    }
    // The fastest kernel other than nvjet among the best 200, tested the same way.
    std::vector<Cand*> all;
    for (auto& c : cands) if (c.us > 0) all.push_back(&c);
    std::sort(all.begin(), all.end(), [](Cand* a, Cand* b) { return a->us < b->us; });
    int tried = 0;
    for (auto* c : all) {
      if (tried++ >= 200) break;
      std::string names = kernel_names(p, &c->algo, s);
      if (names.find("nvjet") != std::string::npos) continue;
      printf("first non-nvjet: %7.1f us id %3d tile %3d stages %3d cluster %2d splitk %d red %u | %s| %s\n", c->us,
             c->id, c->tile, c->stages, c->cluster, c->splitk, c->red, wait_test(p, &c->algo, s).c_str(),
             names.c_str());
      break;
    }
    for (auto* w : p.w) cudaFree(w);
    cudaFree(p.x); cudaFree(p.x0); cudaFree(p.out); cudaFree(p.ref);
    cublasLtMatmulDescDestroy(p.desc);
    cublasLtMatrixLayoutDestroy(p.a); cublasLtMatrixLayoutDestroy(p.b); cublasLtMatrixLayoutDestroy(p.c);
  }
  return 0;
}
