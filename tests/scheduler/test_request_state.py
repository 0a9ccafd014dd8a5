"""A Request as the engine core gets it from a frontend process: pickled over the link."""
import dataclasses
import pickle

import pytest

from factories import make_request

from scheduler_service.core.request import RequestStatus


def test_a_request_round_trips_without_its_process_objects():
    request = make_request(12, 5, request_id="a", stop=("x",), priority=2, tenant="t")
    request.output_token_ids.extend([7, 8])
    request.status = RequestStatus.RUNNING
    sink = request.outputs
    copy = pickle.loads(pickle.dumps(request, protocol=pickle.HIGHEST_PROTOCOL))
    for field in dataclasses.fields(request):
        if field.name not in ("outputs", "guide", "slot_view"):
            assert getattr(copy, field.name) == getattr(request, field.name), field.name
    assert copy.guide is None and copy.slot_view is None
    assert copy.outputs is not sink  # this process's own sink


def test_a_request_has_no_instance_dict():
    """Its attributes are slots, made or unpickled: the engine core reads a dozen of them per
    sequence per step, and an instance dict of this many names is a table of its own in each
    request (an unpickled one's names were new strings too: reads at less than half speed)."""
    made = make_request(4, 2)
    copy = pickle.loads(pickle.dumps(made, protocol=pickle.HIGHEST_PROTOCOL))
    for request in (made, copy):
        assert not hasattr(request, "__dict__")
        with pytest.raises(AttributeError):
            request.not_a_field = 1


def test_the_guides_markers_travel_and_the_guide_stays():
    class Guide:
        markers = ("<think>", "</think>")

    request = make_request(4, 2)
    request.guide = Guide()
    copy = pickle.loads(pickle.dumps(request, protocol=pickle.HIGHEST_PROTOCOL))
    assert copy.guide is None and copy.guide_markers == Guide.markers
    assert request.guide_markers is None
