// The layer operations' avx512 path: layer_ops_impl.h at 64-byte vectors, built with -mavx512f/bw/vl/dq -mfma (setup.py).
#define LO_VEC_BYTES 64
#define LO_NS planserve_lo_avx512
#define LO_ENTRY(name) lo_##name##_avx512
#include "layer_ops_impl.h"
