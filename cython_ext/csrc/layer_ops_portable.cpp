// The layer operations' portable path: layer_ops_impl.h at 16-byte vectors, built without ISA flags (SSE2 on x86-64, NEON on ARM).
#define LO_VEC_BYTES 16
#define LO_NS planserve_lo_portable
#define LO_ENTRY(name) lo_##name##_portable
#include "layer_ops_impl.h"
