// Token selection on the device, so a step sends back token ids instead of logits.

// The larger value across the warp, the lower index on ties, in every lane.
__device__ __forceinline__ void warp_argmax(float& best, int& idx) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        const float v = __shfl_xor_sync(0xffffffffu, best, o);
        const int j = __shfl_xor_sync(0xffffffffu, idx, o);
        if (v > best || (v == best && j < idx)) {
            best = v;
            idx = j;
        }
    }
}

// One block per row: each thread keeps the first maximum of its strided slice, then the
// block keeps the larger value, the lower index on ties (torch.argmax's choice).
extern "C" __global__ void argmax_rows(const float* logits, int vocab, int* out) {
    __shared__ float s_val[32];
    __shared__ int s_idx[32];
    const float* x = logits + (long long)blockIdx.x * vocab;
    int idx = threadIdx.x < vocab ? threadIdx.x : 0;
    float best = x[idx];
    for (int i = threadIdx.x + blockDim.x; i < vocab; i += blockDim.x) {
        const float v = x[i];
        if (v > best) {
            best = v;
            idx = i;
        }
    }
    warp_argmax(best, idx);
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    if (lane == 0) {
        s_val[warp] = best;
        s_idx[warp] = idx;
    }
    __syncthreads();
    if (warp == 0) {
        const int warps = blockDim.x >> 5;
        best = lane < warps ? s_val[lane] : NEG_INF;
        idx = lane < warps ? s_idx[lane] : 0x7fffffff;
        warp_argmax(best, idx);
        if (lane == 0) out[blockIdx.x] = idx;
    }
}
