"""A Request as the engine core gets it from a frontend process: pickled over the link."""
import dataclasses
import pickle
import sys

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


def test_its_attribute_names_are_interned_as_pickle_interns_them():
    """Each name in the instance dict is the interned string, as it is for a request made
    here: an unpickled name is a new string otherwise, and every attribute lookup then compares
    characters (the core's per-sequence reads ran at less than half speed)."""
    copy = pickle.loads(pickle.dumps(make_request(4, 2), protocol=pickle.HIGHEST_PROTOCOL))
    assert copy.__dict__
    for name in copy.__dict__:
        assert name is sys.intern(name), name
