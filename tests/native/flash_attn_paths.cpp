// ggml's CPU flash attention on a quantized KV cache: the tiled path (a batch of 64 queries or more, patch
// 0020) against the CPU backend's reference path (the per-row one), on a prompt-shaped case laid out as
// llama.cpp lays out its cache (cells of all KV heads in a row, Q permuted, a causal mask, GQA).
// Prints one line per K/V type pair: "<k>/<v> nmse <x> max_abs <y>"; tests/test_llama_kv_types.py reads it.
#include "ggml.h"
#include "ggml-backend.h"
#include "ggml-cpu.h"

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <vector>

typedef void (*set_use_ref_t)(ggml_backend_t, bool);

static std::vector<float> attend(bool use_ref, ggml_type type_k, ggml_type type_v) {
    const int d = 64, n_q = 256, n_kv = 1024, n_head = 6, n_head_kv = 2;

    ggml_init_params init = { 64u << 20, nullptr, false };
    ggml_context * ctx = ggml_init(init);
    ggml_tensor * q_rows = ggml_new_tensor_3d(ctx, GGML_TYPE_F32, d, n_head, n_q);
    ggml_tensor * k_cells = ggml_new_tensor_2d(ctx, type_k, d*n_head_kv, n_kv);
    ggml_tensor * v_cells = ggml_new_tensor_2d(ctx, type_v, d*n_head_kv, n_kv);
    ggml_tensor * mask = ggml_new_tensor_2d(ctx, GGML_TYPE_F16, n_kv, n_q);

    std::mt19937 rng(7);
    std::normal_distribution<float> normal(0.0f, 1.0f);
    for (int64_t i = 0; i < ggml_nelements(q_rows); i++) {
        ((float *) q_rows->data)[i] = normal(rng);
    }
    std::vector<float> values(d*n_head_kv*n_kv);
    for (ggml_tensor * cells : { k_cells, v_cells }) {
        for (float & x : values) {
            x = normal(rng);
        }
        ggml_quantize_chunk(cells->type, values.data(), cells->data, 0, n_kv, d*n_head_kv, nullptr);
    }
    // the queries are the last n_q positions; each sees the cells up to its own
    for (int i = 0; i < n_q; i++) {
        for (int j = 0; j < n_kv; j++) {
            ((ggml_fp16_t *) mask->data)[i*n_kv + j] = ggml_fp32_to_fp16(j <= n_kv - n_q + i ? 0.0f : -INFINITY);
        }
    }

    ggml_tensor * q = ggml_permute(ctx, q_rows, 0, 2, 1, 3);
    ggml_tensor * k = ggml_permute(ctx, ggml_view_3d(ctx, k_cells, d, n_head_kv, n_kv,
        ggml_row_size(type_k, d), k_cells->nb[1], 0), 0, 2, 1, 3);
    ggml_tensor * v = ggml_permute(ctx, ggml_view_3d(ctx, v_cells, d, n_head_kv, n_kv,
        ggml_row_size(type_v, d), v_cells->nb[1], 0), 0, 2, 1, 3);
    ggml_tensor * out = ggml_flash_attn_ext(ctx, q, k, v, mask, 1.0f/sqrtf((float) d), 0.0f, 0.0f);
    ggml_cgraph * graph = ggml_new_graph(ctx);
    ggml_build_forward_expand(graph, out);

    ggml_backend_t backend = ggml_backend_cpu_init();
    ggml_backend_cpu_set_n_threads(backend, 2);
    ggml_backend_reg_t reg = ggml_backend_dev_backend_reg(ggml_backend_get_device(backend));
    auto set_use_ref = (set_use_ref_t) ggml_backend_reg_get_proc_address(reg, "ggml_backend_cpu_set_use_ref");
    if (set_use_ref == nullptr) {
        fprintf(stderr, "the CPU backend has no reference path (ggml_backend_cpu_set_use_ref)\n");
        exit(1);
    }
    set_use_ref(backend, use_ref);
    if (ggml_backend_graph_compute(backend, graph) != GGML_STATUS_SUCCESS) {
        fprintf(stderr, "flash attention failed\n");
        exit(1);
    }
    std::vector<float> result((float *) out->data, (float *) out->data + ggml_nelements(out));
    ggml_backend_free(backend);
    ggml_free(ctx);
    return result;
}

int main() {
    const ggml_type pairs[][2] = {
        { GGML_TYPE_F16,  GGML_TYPE_F16  },
        { GGML_TYPE_Q8_0, GGML_TYPE_Q8_0 },
        { GGML_TYPE_Q8_0, GGML_TYPE_Q4_0 },
        { GGML_TYPE_Q4_0, GGML_TYPE_Q4_0 },
        { GGML_TYPE_Q4_1, GGML_TYPE_Q5_1 },
        { GGML_TYPE_IQ4_NL, GGML_TYPE_IQ4_NL },
    };
    for (const auto & pair : pairs) {
        const std::vector<float> tiled = attend(false, pair[0], pair[1]);
        const std::vector<float> reference = attend(true, pair[0], pair[1]);
        double err = 0.0, norm = 0.0, max_abs = 0.0;
        for (size_t i = 0; i < tiled.size(); i++) {
            const double diff = (double) tiled[i] - reference[i];
            err += diff*diff;
            norm += (double) reference[i]*reference[i];
            max_abs = fmax(max_abs, fabs(diff));
        }
        printf("%s/%s nmse %.3e max_abs %.3e\n", ggml_type_name(pair[0]), ggml_type_name(pair[1]), err/norm, max_abs);
    }
    return 0;
}
