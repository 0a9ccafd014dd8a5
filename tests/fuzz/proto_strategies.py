"""Hypothesis strategies for random protobuf messages, built from the message descriptors.

Field values lean towards the edges that bounds checks care about (0, -1, the type's extremes,
NaN and infinities, empty and odd strings, unknown enum numbers) while keeping small in-range
values common, so that some messages get past validation and reach deeper code.
"""
from __future__ import annotations

from google.protobuf import message_factory
from google.protobuf.descriptor import FieldDescriptor as F
from hypothesis import strategies as st

_INT32 = st.one_of(st.integers(-3, 300), st.sampled_from([2**31 - 1, -2**31, 65536, 1 << 20]))
_INT64 = st.one_of(st.integers(-3, 300), st.sampled_from([2**63 - 1, -2**63, 2**32, 1 << 40]))
_UINT32 = st.one_of(st.integers(0, 300), st.sampled_from([2**32 - 1, 2**31, 65535, 1 << 20]))
_UINT64 = st.one_of(st.integers(0, 300), st.sampled_from([2**64 - 1, 2**63, 2**32]))
_FLOAT = st.one_of(st.floats(-2, 2, width=32), st.floats(width=32),
                   st.sampled_from([0.0, -0.0, 1.0, -1.0]))
_DOUBLE = st.one_of(st.floats(-2, 2), st.floats(), st.sampled_from([0.0, 1.0, -1.0]))
_TEXT = st.one_of(st.text(max_size=24), st.sampled_from(["", " ", "\x00", "user", "assistant",
                                                         "fcfs", "a" * 300]))

_SCALARS = {
    F.TYPE_INT32: _INT32, F.TYPE_SINT32: _INT32, F.TYPE_SFIXED32: _INT32,
    F.TYPE_INT64: _INT64, F.TYPE_SINT64: _INT64, F.TYPE_SFIXED64: _INT64,
    F.TYPE_UINT32: _UINT32, F.TYPE_FIXED32: _UINT32,
    F.TYPE_UINT64: _UINT64, F.TYPE_FIXED64: _UINT64,
    F.TYPE_FLOAT: _FLOAT, F.TYPE_DOUBLE: _DOUBLE, F.TYPE_BOOL: st.booleans(),
    F.TYPE_STRING: _TEXT, F.TYPE_BYTES: st.binary(max_size=64),
}


def _scalar(field, overrides: dict):
    if field.name in overrides:
        return overrides[field.name]
    if field.type == F.TYPE_ENUM:
        return st.sampled_from([v.number for v in field.enum_type.values] + [99])
    return _SCALARS[field.type]


@st.composite
def messages(draw, message_class, depth: int = 0, overrides: dict | None = None,
             max_repeated: int = 6):
    """A random instance of `message_class`; `overrides` maps field names to strategies for
    their (element) values, at any depth."""
    overrides = overrides or {}
    message = message_class()
    for field in message_class.DESCRIPTOR.fields:
        if not draw(st.booleans()):
            continue
        is_map = (field.type == F.TYPE_MESSAGE
                  and field.message_type.GetOptions().map_entry)
        if is_map:
            key_field, value_field = field.message_type.fields
            if depth >= 3 or value_field.type == F.TYPE_MESSAGE:
                continue
            entries = draw(st.dictionaries(_scalar(key_field, {}), _scalar(value_field, {}),
                                           max_size=3))
            getattr(message, field.name).update(entries)
        elif field.type == F.TYPE_MESSAGE:
            if depth >= 3:
                continue
            sub = st.deferred(lambda f=field: messages(message_factory.GetMessageClass(f.message_type), depth + 1,
                                                       overrides, max_repeated))
            if field.is_repeated:
                for value in draw(st.lists(sub, max_size=3)):
                    getattr(message, field.name).add().CopyFrom(value)
            else:
                getattr(message, field.name).CopyFrom(draw(sub))
        elif field.is_repeated:
            getattr(message, field.name).extend(
                draw(st.lists(_scalar(field, overrides), max_size=max_repeated)))
        else:
            setattr(message, field.name, draw(_scalar(field, overrides)))
    return message
