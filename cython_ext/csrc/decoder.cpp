// dl_run_layers: the Python decoder loop of model_service/models/llama.py, call for call
// (decoder.h says why and what the buffers hold).
#include "decoder.h"

namespace {

enum { DL_QKV = 0, DL_O, DL_GATE_UP, DL_DOWN, DL_MODULES };

int linear(const dl_kernels* k, const dl_linear* w, const void* x, int64_t rows, void* out, int isa, int threads) {
    if (w->int8)
        return k->linear_int8((const uint16_t*)x, rows, w->k, (const uint8_t*)w->packed, w->n, w->k, w->bias, out, w->n,
                              0, isa, threads);
    return k->linear_bf16((const uint16_t*)x, rows, w->k, (const uint16_t*)w->packed, w->n, w->k, w->bias, out, w->n, 0,
                          isa, threads);
}

// The layer's LoRA module `which`, or NULL where this step has no adapter or none adapts it.
const lr_module* lora_module(const dl_buffers* b, int64_t layer, int which) {
    if (b->lora == nullptr) return nullptr;
    const lr_module* mod = &b->lora->modules[layer * DL_MODULES + which];
    return mod->packed_a ? mod : nullptr;
}

// One layer: x = norm(residual += delta); residual += o(attention(rope(qkv(x)))); delta = mlp(norm).
int run_layer(const dl_kernels* k, const dl_model* m, int64_t index, pa_args* attention, const dl_buffers* b,
              const void* delta_in, int threads, int* failed_op) {
    const dl_layer* layer = &m->layers[index];
    const int64_t T = b->rows, H = m->num_heads, KVH = m->num_kv_heads, D = m->head_dim;
    const int64_t qkv_width = (H + 2 * KVH) * D;
    const int bf16 = LO_BFLOAT16;
    int code;
#define DL_CALL(op, call)      \
    if ((code = (call)) != 0) { \
        *failed_op = (op);     \
        return code;           \
    }
// The fused linear `which`'s LoRA products, where this step has some for it.
#define DL_LORA(which, x, in_features, y, width)                                                            \
    if (const lr_module* mod = lora_module(b, index, (which)))                                             \
        DL_CALL(DL_OP_LORA, lr_add(mod, &b->lora->step, (const uint16_t*)(x), (in_features), (in_features),       \
                                   (uint16_t*)(y), (width), m->gemm_isa, threads));
    DL_CALL(DL_OP_INPUT_NORM, k->add_rms_norm(b->residual, delta_in, layer->input_norm, b->x, T, m->hidden, m->eps,
                                              bf16, m->layer_ops_isa, threads));
    DL_CALL(DL_OP_QKV, linear(k, &layer->qkv, b->x, T, b->qkv, m->gemm_isa, threads));
    DL_LORA(DL_QKV, b->x, m->hidden, b->qkv, qkv_width);
    DL_CALL(DL_OP_ROPE, k->rope(b->qkv, T, qkv_width, H + KVH, D, b->positions, m->rope, m->rope_rows, bf16,
                                m->layer_ops_isa, threads));
    const uint16_t* qkv = (const uint16_t*)b->qkv;
    attention->q = qkv;
    attention->k_new = qkv + H * D;
    attention->v_new = qkv + (H + KVH) * D;
    attention->k_cache = layer->k_cache;
    attention->v_cache = layer->v_cache;
    DL_CALL(DL_OP_ATTENTION, k->attention(attention, m->attention_isa));
    DL_CALL(DL_OP_O, linear(k, &layer->o, b->attn, T, b->delta, m->gemm_isa, threads));
    DL_LORA(DL_O, b->attn, H * D, b->delta, m->hidden);
    DL_CALL(DL_OP_POST_NORM, k->add_rms_norm(b->residual, b->delta, layer->post_attention_norm, b->x, T, m->hidden,
                                             m->eps, bf16, m->layer_ops_isa, threads));
    DL_CALL(DL_OP_GATE_UP, linear(k, &layer->gate_up, b->x, T, b->gate_up, m->gemm_isa, threads));
    DL_LORA(DL_GATE_UP, b->x, m->hidden, b->gate_up, 2 * m->intermediate);
    DL_CALL(DL_OP_SILU_MUL, k->silu_mul(b->gate_up, b->act, T, m->intermediate, bf16, m->layer_ops_isa, threads));
    DL_CALL(DL_OP_DOWN, linear(k, &layer->down, b->act, T, b->delta, m->gemm_isa, threads));
    DL_LORA(DL_DOWN, b->act, m->intermediate, b->delta, m->hidden);
#undef DL_LORA
#undef DL_CALL
    return 0;
}

}  // namespace

extern "C" int dl_run_layers(const dl_kernels* kernels, const dl_model* model, const pa_args* step,
                             const dl_buffers* buffers, int num_threads, int* failed_op, int64_t* failed_layer) {
    *failed_op = DL_OP_NONE;
    *failed_layer = -1;
    if (buffers->rows == 0 || model->num_layers == 0) return 0;
    pa_args attention = *step;  // the step's indices; the per-layer fields below
    attention.out = buffers->attn;
    attention.num_heads = model->num_heads;
    attention.num_kv_heads = model->num_kv_heads;
    attention.head_dim = model->head_dim;
    attention.scale = model->scale;
    attention.dtype = PA_BFLOAT16;
    attention.num_threads = num_threads;
    attention.q_row_stride = attention.k_new_row_stride = attention.v_new_row_stride =
        (model->num_heads + 2 * model->num_kv_heads) * model->head_dim;
    // Every layer's cache has one shape: the indices are checked once, against the first.
    attention.k_cache = model->layers[0].k_cache;
    attention.v_cache = model->layers[0].v_cache;
    int code = kernels->check_indices(&attention);
    if (code != 0) {
        *failed_op = DL_OP_CHECK_INDICES;
        return code;
    }
    for (int64_t i = 0; i < model->num_layers; ++i) {
        code = run_layer(kernels, model, i, &attention, buffers, i ? buffers->delta : nullptr,
                         num_threads, failed_op);
        if (code != 0) {
            *failed_layer = i;
            return code;
        }
    }
    return 0;
}
