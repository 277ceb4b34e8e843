"""Patch embedding_update.cuh in this working copy: add_gradient_rows sums four gradient rows a pass before the pairs."""
from pathlib import Path

p = Path("pipeline/kernels/embedding/embedding_update.cuh")
s = p.read_text()
old = "    for (; u + 2 <= n; u += 2) {\n"
quad = """    for (; u + 4 <= n; u += 4) {
        const long long o0 = __shfl_sync(mask, goff, u, lanes);
        const long long o1 = __shfl_sync(mask, goff, u + 1, lanes);
        const long long o2 = __shfl_sync(mask, goff, u + 2, lanes);
        const long long o3 = __shfl_sync(mask, goff, u + 3, lanes);
        const float f0 = __shfl_sync(mask, scale, u, lanes);
        const float f1 = __shfl_sync(mask, scale, u + 1, lanes);
        const float f2 = __shfl_sync(mask, scale, u + 2, lanes);
        const float f3 = __shfl_sync(mask, scale, u + 3, lanes);
#pragma unroll
        for (int c = 0; c < CHUNKS; ++c) {
            const int d0 = c * chunk + lane * N;
            if (d0 < D) {
                float v0[N], v1[N], v2[N], v3[N];
                load_elems<float, N>(grad + o0, d0, D, vec_g, v0);
                load_elems<float, N>(grad + o1, d0, D, vec_g, v1);
                load_elems<float, N>(grad + o2, d0, D, vec_g, v2);
                load_elems<float, N>(grad + o3, d0, D, vec_g, v3);
#pragma unroll
                for (int k = 0; k < N; ++k) g[c][k] += (f0 * v0[k] + f1 * v1[k]) + (f2 * v2[k] + f3 * v3[k]);
            }
        }
    }
"""
assert s.count(old) == 1
p.write_text(s.replace(old, quad + old))
print("patched")
