// The layer operations' avx2 path: layer_ops_impl.h at 32-byte vectors, built with -mavx2 -mfma (setup.py).
#define LO_VEC_BYTES 32
#define LO_NS planserve_lo_avx2
#define LO_ENTRY(name) lo_##name##_avx2
#include "layer_ops_impl.h"
