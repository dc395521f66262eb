/*
 * test_tensor.c — the descriptor table: counts, names, slab layout, tying and decay flags.
 */
#include <string.h>

#include "../common.h"
#include "../config.h"
#include "../tensor.h"
#include "testing.h"

// Every layer's slabs are tiled exactly by its tensors, in table order, without overlap.
static int slabs_tile(const TensorTable* tt) {
    for (int l = 0; l < tt->n_layers; l++) {
        int64_t p = 0, g = 0;
        for (int i = tt->first[l]; i < tt->first[l] + tt->count[l]; i++) {
            const TensorDesc* d = &tt->t[i];
            if (d->layer != l) return 0;
            if (d->grad_offset != g) return 0;
            g += d->numel;
            if (d->tied_to >= 0) continue;
            if (d->param_offset != p) return 0;
            p += d->numel;
        }
        if (p != tt->param_numel[l] || g != tt->grad_numel[l]) return 0;
    }
    return 1;
}

static void test_tensor_table_qwen3_tied(TestCtx* t) {
    char err[ERR_LEN];
    ModelConfig c;
    config_from_preset(&c, "qwen3-1.7b", err);
    TensorTable tt;
    CHECK(t, tensor_table_build(&tt, &c, 0, err) == 0, "%s", err);
    CHECK(t, tt.n_layers == 30, "n_layers %d", tt.n_layers);
    CHECK(t, tt.total_params == config_num_params(&c), "total %lld vs %lld",
          (long long)tt.total_params, (long long)config_num_params(&c));
    CHECK(t, tt.n == 1 + 28 * 11 + 2, "tensor count %d", tt.n);
    CHECK(t, slabs_tile(&tt), "slabs tile");
    int head = tensor_table_index(&tt, TK_LM_HEAD, -1), emb = tensor_table_index(&tt, TK_EMBED, -1);
    CHECK(t, head >= 0 && tt.t[head].tied_to == emb && tt.t[head].owner_layer == 0 &&
                 tt.t[head].layer == 29,
          "tied head");
    CHECK(t, tt.param_numel[29] == c.C && tt.grad_numel[29] == c.C + (int64_t)c.V * c.C,
          "postfix owns only the final norm, but has gradient room for the head");
    CHECK(t, !tt.t[emb].decay && !tt.t[head].decay, "tied embedding not decayed by default");
    int q = tensor_table_index(&tt, TK_WQ, 3);
    CHECK(t, q >= 0 && strcmp(tt.t[q].hf_name, "model.layers.3.self_attn.q_proj.weight") == 0 &&
                 strcmp(tt.t[q].gguf_name, "blk.3.attn_q.weight") == 0 &&
                 tt.t[q].shape[0] == 2048 && tt.t[q].shape[1] == 2048 && tt.t[q].decay,
          "q_proj descriptor");
    int kn = tensor_table_index(&tt, TK_K_NORM, 27);
    CHECK(t, kn >= 0 && tt.t[kn].numel == 128 && !tt.t[kn].decay, "k_norm descriptor");
    CHECK(t, tensor_table_find_hf(&tt, "model.norm.weight") ==
                 tensor_table_index(&tt, TK_FINAL_NORM, -1),
          "find by HF name");
    CHECK(t, tensor_table_find_hf(&tt, "lm_head.weight") < 0, "tied head has no HF tensor");
    CHECK(t, tensor_table_find(&tt, "layers.0.w_up") == tensor_table_index(&tt, TK_W_UP, 0),
          "find by our name");
    tensor_table_free(&tt);
    CHECK(t, tensor_table_build(&tt, &c, 1, err) == 0 && tt.t[0].decay, "decay_embeddings");
    tensor_table_free(&tt);
}

static void test_tensor_table_llama_untied(TestCtx* t) {
    char err[ERR_LEN];
    ModelConfig c;
    config_from_preset(&c, "llama3.1-8b", err);
    TensorTable tt;
    CHECK(t, tensor_table_build(&tt, &c, 0, err) == 0, "%s", err);
    CHECK(t, tt.total_params == config_num_params(&c), "total");
    CHECK(t, tt.n == 1 + 32 * 9 + 2, "no qk-norm tensors: %d", tt.n);
    CHECK(t, slabs_tile(&tt), "slabs tile");
    int head = tensor_table_index(&tt, TK_LM_HEAD, -1);
    CHECK(t, tt.t[head].tied_to < 0 && tt.t[head].decay &&
                 strcmp(tt.t[head].hf_name, "lm_head.weight") == 0 &&
                 tt.param_numel[33] == c.C + (int64_t)c.V * c.C,
          "untied head owned by the postfix");
    CHECK(t, tensor_table_index(&tt, TK_Q_NORM, 0) < 0, "llama has no q_norm");
    // fused-matmul adjacency inside a block
    int iq = tensor_table_index(&tt, TK_WQ, 5), ik = tensor_table_index(&tt, TK_WK, 5);
    int iv = tensor_table_index(&tt, TK_WV, 5), ig = tensor_table_index(&tt, TK_W_GATE, 5);
    int iu = tensor_table_index(&tt, TK_W_UP, 5);
    CHECK(t, tt.t[ik].param_offset == tt.t[iq].param_offset + tt.t[iq].numel &&
                 tt.t[iv].param_offset == tt.t[ik].param_offset + tt.t[ik].numel &&
                 tt.t[iu].param_offset == tt.t[ig].param_offset + tt.t[ig].numel,
          "q/k/v and gate/up adjacent");
    tensor_table_free(&tt);
}

const TestCase tests_tensor[] = {
    {"tensor_table_qwen3_tied", test_tensor_table_qwen3_tied},
    {"tensor_table_llama_untied", test_tensor_table_llama_untied},
    {NULL, NULL},
};
