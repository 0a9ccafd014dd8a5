# Protocol buffers' wire format for the extensions that write a message themselves (step_core:
# the plan; decode_step: the result): the one varint writer they share (inline: no module).
from libc.stdint cimport uint8_t, uint64_t


cdef inline uint8_t* put_varint(uint8_t* p, uint64_t v) noexcept nogil:
    while v >= 0x80:
        p[0] = <uint8_t>((v & 0x7F) | 0x80)
        p += 1
        v >>= 7
    p[0] = <uint8_t>v
    return p + 1
