"""Scheduling policies: the registry, each order, victims, and a random-sequence check of the
queue contract (every request leaves once, len is right, pop is what peek said)."""
from __future__ import annotations

import importlib.metadata
import itertools
import math
import pathlib
import tomllib

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from scheduler_service.core import policies
from scheduler_service.core.policies.base import SchedulingPolicy
from scheduler_service.core.policies.fcfs import FCFSPolicy
from scheduler_service.core.request import Request, Sampling, Stopping

ROOT = pathlib.Path(__file__).resolve().parents[2]
BUILTINS = ["edf", "fair", "fcfs", "lpm", "priority", "sjf"]

_ids = itertools.count()


def make_request(arrival: float = 0.0, *, prompt: int = 8, max_new: int = 4, priority: int = 0,
                 deadline: float | None = None, tenant: str = "", generated: int = 0,
                 computed: int = 0, request_id: str | None = None,
                 first_token_due: float | None = None) -> Request:
    request = Request(
        request_id=request_id or f"r{next(_ids)}",
        prompt_token_ids=[2 + i % 100 for i in range(prompt)],
        sampling=Sampling(0.0, 0, 1.0, 0),
        stopping=Stopping(max_new, (), frozenset(), False),
        arrival_time=arrival, priority=priority, deadline=deadline, tenant=tenant,
        first_token_due=first_token_due)
    request.output_token_ids = [50] * generated
    request.num_computed_tokens = computed
    return request


def make_policy(name: str, **options) -> SchedulingPolicy:
    """Every built-in, built the way the scheduler builds it (with a prefix_match_len)."""
    options.setdefault("prefix_match_len", lambda request: 0)
    return policies.create(name, **options)


def drain(policy: SchedulingPolicy, now: float = 0.0) -> list[Request]:
    out = []
    while len(policy):
        expected = policy.peek(now)
        assert policy.pop(now) is expected
        out.append(expected)
    assert policy.peek(now) is None
    return out


class OutOfTreePolicy(FCFSPolicy):
    """A policy that lives outside the package: loaded by dotted path or entry point."""

    name = "out_of_tree"

    def __init__(self, *, flavour: str = "plain") -> None:
        super().__init__()
        self.flavour = flavour


NotAPolicy = object


# ---- registry -------------------------------------------------------------------------------


def test_available_lists_the_builtins():
    assert set(BUILTINS) <= set(policies.available())
    assert policies.available() == sorted(policies.available())


@pytest.mark.parametrize("spec", ["nope", "FCFS", ""])
def test_unknown_name_is_a_value_error_that_lists_the_valid_names(spec):
    with pytest.raises(ValueError, match="valid names") as info:
        policies.create(spec)
    for name in BUILTINS:
        assert name in str(info.value)


@pytest.mark.parametrize("spec", ["no_such_module:Policy", "scheduler_service.core.policies:Nope",
                                  "scheduler_service.core.policies.fcfs.Nope", "a:"])
def test_bad_dotted_path_is_a_value_error_that_lists_the_valid_names(spec):
    with pytest.raises(ValueError, match="valid names: edf, fair, fcfs"):
        policies.create(spec)


@pytest.mark.parametrize("separator", [":", "."])
def test_dotted_path_loads_an_out_of_tree_class(separator):
    policy = policies.create(f"{__name__}{separator}OutOfTreePolicy", flavour="spicy",
                             prefix_match_len=len)
    assert type(policy) is OutOfTreePolicy
    assert policy.flavour == "spicy"
    assert "out_of_tree" not in policies.available()  # loading is not registering


def test_dotted_path_to_something_else_is_a_type_error():
    with pytest.raises(TypeError, match="not a SchedulingPolicy"):
        policies.create(f"{__name__}:NotAPolicy")


def test_create_passes_a_policy_its_own_options():
    assert policies.create("sjf", aging_tokens_per_s=7).aging_tokens_per_s == 7.0
    fair = policies.create("fair", input_weight=3, output_weight=5)
    assert (fair.input_weight, fair.output_weight) == (3.0, 5.0)


def test_an_option_the_policy_does_not_take_is_a_type_error_naming_it():
    with pytest.raises(TypeError, match="aging_token_per_s; it takes: aging_tokens_per_s"):
        policies.create("sjf", aging_token_per_s=7)
    with pytest.raises(TypeError, match="does not take max_scan; it takes: no options"):
        policies.create("fcfs", max_scan=3)


@pytest.mark.parametrize("name", BUILTINS)
def test_every_policy_accepts_the_scheduler_options(name):
    policy = policies.create(name, prefix_match_len=lambda request: 0)
    assert isinstance(policy, SchedulingPolicy) and policy.name == name


def test_lpm_needs_prefix_match_len():
    with pytest.raises(TypeError, match="prefix_match_len"):
        policies.create("lpm")


@pytest.mark.parametrize("name, options", [("sjf", {"aging_tokens_per_s": -1}),
                                           ("fair", {"output_weight": -1}),
                                           ("lpm", {"max_scan": -1, "prefix_match_len": len})])
def test_bad_option_values_are_value_errors_naming_the_option(name, options):
    field = next(key for key in options if key != "prefix_match_len")
    with pytest.raises(ValueError, match=field):
        policies.create(name, **options)


def test_register_refuses_a_taken_name_and_a_non_policy():
    class Impostor(FCFSPolicy):
        name = "fcfs"

    with pytest.raises(ValueError, match="already taken by scheduler_service.core.policies.fcfs"):
        policies.register(Impostor)
    with pytest.raises(TypeError):
        policies.register(object)
    assert policies.resolve("fcfs") is FCFSPolicy


def test_describe_has_one_line_per_policy():
    lines = policies.describe().splitlines()
    assert [line.split()[0] for line in lines] == policies.available()
    assert all(len(line.split()) > 2 for line in lines)


def _pyproject_entry_points() -> dict[str, str]:
    with open(ROOT / "pyproject.toml", "rb") as f:
        project = tomllib.load(f)["project"]
    return project["entry-points"][policies.ENTRY_POINT_GROUP]


def test_pyproject_lists_every_builtin_under_its_registered_name():
    entry_points = _pyproject_entry_points()
    assert sorted(entry_points) == BUILTINS
    for name, value in entry_points.items():
        assert policies.resolve(value) is policies.resolve(name)


def _install_fake_distribution(directory: pathlib.Path, entry_points: dict[str, str]) -> None:
    """What `pip install` leaves in site-packages, reduced to what importlib.metadata reads."""
    dist_info = directory / "planserve_policy_plugin-1.0.dist-info"
    dist_info.mkdir()
    (dist_info / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: planserve-policy-plugin\nVersion: 1.0\n")
    lines = [f"[{policies.ENTRY_POINT_GROUP}]"]
    lines += [f"{name} = {value}" for name, value in entry_points.items()]
    (dist_info / "entry_points.txt").write_text("\n".join(lines) + "\n")


def test_entry_points_resolve(tmp_path, monkeypatch):
    """The pyproject table as installed metadata, plus one plugin name the registry lacks."""
    entry_points = dict(_pyproject_entry_points(), out_of_tree=f"{__name__}:OutOfTreePolicy")
    _install_fake_distribution(tmp_path, entry_points)
    monkeypatch.syspath_prepend(str(tmp_path))

    found = {ep.name: ep for ep in importlib.metadata.entry_points(
        group=policies.ENTRY_POINT_GROUP)}
    for name in BUILTINS:
        assert found[name].load() is policies.resolve(name)
    assert "out_of_tree" in policies.available()
    assert "out_of_tree" in policies.describe()
    policy = policies.create("out_of_tree", flavour="mild", prefix_match_len=len)
    assert type(policy) is OutOfTreePolicy and policy.flavour == "mild"
    with pytest.raises(ValueError, match="out_of_tree"):  # now listed among the valid names
        policies.create("nope")


def test_a_broken_entry_point_does_not_break_describe(tmp_path, monkeypatch):
    _install_fake_distribution(tmp_path, {"broken": "no_such_module_xyz:Policy"})
    monkeypatch.syspath_prepend(str(tmp_path))
    assert "broken" in policies.available()
    assert "failed to load" in policies.describe()


def _installed_planserve() -> bool:
    try:
        importlib.metadata.distribution("planserve")
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


@pytest.mark.skipif(not _installed_planserve(), reason="planserve is not pip-installed")
def test_installed_metadata_declares_the_builtins():
    dist = importlib.metadata.distribution("planserve")
    names = {ep.name for ep in dist.entry_points if ep.group == policies.ENTRY_POINT_GROUP}
    assert names == set(BUILTINS), "stale metadata: pip install --no-build-isolation -e ."


# ---- every policy: the queue contract --------------------------------------------------------


@pytest.mark.parametrize("name", BUILTINS)
def test_remove_from_the_middle(name):
    policy = make_policy(name)
    requests = [make_request(float(i)) for i in range(5)]
    for request in requests:
        policy.add(request)
    policy.remove(requests[2])
    assert len(policy) == 4
    assert set(policy) == set(requests) - {requests[2]}
    assert drain(policy) == [requests[i] for i in (0, 1, 3, 4)]


@pytest.mark.parametrize("name", BUILTINS)
def test_errors_on_empty_pop_unknown_remove_and_double_add(name):
    policy = make_policy(name)
    assert policy.peek(0.0) is None and len(policy) == 0 and list(policy) == []
    with pytest.raises(IndexError):
        policy.pop(0.0)
    request = make_request()
    with pytest.raises(ValueError):
        policy.remove(request)
    policy.add(request)
    with pytest.raises(ValueError, match="already waiting"):
        policy.add(request)
    assert len(policy) == 1


@pytest.mark.parametrize("name", BUILTINS)
def test_many_removes_keep_the_order(name):
    """Enough lazy deletions to compact the heap; the survivors still come out in order."""
    policy = make_policy(name)
    requests = [make_request(float(i)) for i in range(400)]
    for request in reversed(requests):
        policy.add(request)
    for request in requests[::3] + requests[1::3]:
        policy.remove(request)
    assert drain(policy) == requests[2::3]


# ---- fcfs ---------------------------------------------------------------------------------


def test_fcfs_is_arrival_order_with_preempted_first():
    policy = make_policy("fcfs")
    late, early = make_request(2.0), make_request(1.0)
    resumed_late, resumed_early = make_request(0.5), make_request(0.1)
    policy.add(late)
    policy.add(early)
    policy.add_preempted(resumed_late)
    policy.add_preempted(resumed_early)
    assert drain(policy) == [resumed_early, resumed_late, early, late]


def test_fcfs_victim_is_the_latest_arrival_and_it_never_preempts_for_waiting():
    policy = make_policy("fcfs")
    running = [make_request(1.0), make_request(3.0), make_request(2.0)]
    assert policy.select_victim(running) is running[1]
    assert not policy.may_preempt_for(make_request(0.0, priority=9), running[1])


# ---- first-token targets (ttft_target_ms / x-slo-ttft-ms), under every policy ----------------


def _due(arrival: float, target_s: float | None, **fields) -> Request:
    return make_request(arrival, first_token_due=None if target_s is None else arrival + target_s,
                        **fields)


@pytest.mark.parametrize("name", BUILTINS)
def test_the_earliest_first_token_target_goes_first_then_untargeted_by_arrival(name):
    # Every request ranks equal by the policy's own rule (sjf: equal sizes, no aging).
    policy = make_policy(name, **({"aging_tokens_per_s": 0.0} if name == "sjf" else {}))
    loose = _due(0.0, 5.0)  # due at 5.0
    untargeted_early, untargeted_late = _due(0.5, None), _due(0.7, None)
    tight = _due(1.0, 0.5)  # arrived last, due first (1.5)
    for request in (untargeted_late, loose, untargeted_early, tight):
        policy.add(request)
    assert drain(policy) == [tight, loose, untargeted_early, untargeted_late]


def test_a_preempted_request_still_goes_ahead_of_a_fresh_one_with_a_target():
    policy = make_policy("fcfs")
    fresh, resumed = _due(0.0, 0.001), _due(5.0, None)
    policy.add(fresh)
    policy.add_preempted(resumed)
    assert drain(policy) == [resumed, fresh]


def test_priority_ranks_before_the_first_token_target():
    policy = make_policy("priority")
    urgent_low = _due(0.0, 0.01, priority=0)
    relaxed_high = _due(1.0, 60.0, priority=5)
    tight_high = _due(2.0, 0.5, priority=5)
    for request in (urgent_low, relaxed_high, tight_high):
        policy.add(request)
    assert drain(policy) == [tight_high, relaxed_high, urgent_low]


def test_fair_orders_by_target_within_a_tenant_never_across_shares():
    policy = make_policy("fair")
    a_loose, a_tight = _due(0.0, 9.0, tenant="a"), _due(1.0, 0.1, tenant="a")
    b_tight = _due(0.5, 0.01, tenant="b")
    for request in (a_loose, a_tight, b_tight):
        policy.add(request)
    policy.on_scheduled(make_request(tenant="b"), 100)  # b has had far more service
    assert drain(policy) == [a_tight, a_loose, b_tight]


# ---- priority -----------------------------------------------------------------------------


def test_priority_beats_arrival():
    policy = make_policy("priority")
    low, high, mid = make_request(0.0, priority=0), make_request(5.0, priority=2), \
        make_request(1.0, priority=1)
    for request in (low, high, mid):
        policy.add(request)
    assert drain(policy) == [high, mid, low]


def test_priority_preempted_goes_ahead_of_equal_priority_but_not_higher():
    policy = make_policy("priority")
    fresh = make_request(0.0, priority=1)
    higher = make_request(9.0, priority=2)
    resumed = make_request(5.0, priority=1)
    lower_resumed = make_request(1.0, priority=0)
    policy.add(fresh)
    policy.add(higher)
    policy.add_preempted(resumed)
    policy.add_preempted(lower_resumed)
    assert drain(policy) == [higher, resumed, fresh, lower_resumed]


def test_priority_victim_is_the_lowest_priority_then_the_latest_arrival():
    policy = make_policy("priority")
    running = [make_request(1.0, priority=0), make_request(2.0, priority=0),
               make_request(3.0, priority=1)]
    assert policy.select_victim(running) is running[1]


def test_priority_may_preempt_only_a_strictly_lower_priority():
    policy = make_policy("priority")
    waiting = make_request(priority=1)
    assert policy.may_preempt_for(waiting, make_request(priority=0))
    assert not policy.may_preempt_for(waiting, make_request(priority=1))
    assert not policy.may_preempt_for(waiting, make_request(priority=2))


def test_priority_handles_a_thousand_waiting():
    policy = make_policy("priority")
    requests = [make_request(float(i), priority=i % 7) for i in range(1000)]
    for request in requests:
        policy.add(request)
    out = drain(policy)
    assert out == sorted(requests, key=lambda r: (-r.priority, r.arrival_time))


# ---- sjf ----------------------------------------------------------------------------------


def test_sjf_shortest_remaining_work_first():
    policy = make_policy("sjf", aging_tokens_per_s=0)
    long = make_request(0.0, prompt=100, max_new=100)
    short = make_request(1.0, prompt=10, max_new=10)
    # 50 + 40 = 90 tokens in all, but 40 are generated already: 50 left to compute + 20 to go.
    half_done = make_request(2.0, prompt=50, max_new=60, generated=40, computed=40)
    for request in (long, short, half_done):
        policy.add(request)
    assert drain(policy) == [short, half_done, long]


def test_sjf_aging_eventually_picks_the_long_one():
    policy = make_policy("sjf", aging_tokens_per_s=100)
    long = make_request(0.0, prompt=1000, max_new=4)  # 1004 tokens
    policy.add(long)
    picked = []
    for second in range(1, 30):
        short = make_request(float(second), prompt=8, max_new=4)  # 12 tokens
        policy.add(short)
        now = second + 0.5
        expected = min(policy, key=lambda r: policy.effective_size(r, now))
        assert policy.peek(now) is expected
        picked.append(policy.pop(now))
        if picked[-1] is long:
            break
    # Every short one that arrived before the long one had waited ~992 tokens' worth (9.92 s).
    assert picked[-1] is long
    assert len(picked) == 10


def test_sjf_without_aging_starves_the_long_one():
    policy = make_policy("sjf", aging_tokens_per_s=0)
    long = make_request(0.0, prompt=1000)
    policy.add(long)
    for second in range(1, 100):
        policy.add(make_request(float(second)))
        assert policy.pop(float(second)) is not long


def test_sjf_preempted_goes_ahead_of_an_equal_fresh_one():
    policy = make_policy("sjf", aging_tokens_per_s=0)
    fresh, resumed = make_request(0.0), make_request(1.0)
    policy.add(fresh)
    policy.add_preempted(resumed)
    assert drain(policy) == [resumed, fresh]


# ---- edf ----------------------------------------------------------------------------------


def test_edf_earliest_deadline_first_then_no_deadline_by_arrival():
    policy = make_policy("edf")
    none_early = make_request(0.0)
    none_late = make_request(1.0)
    due_late = make_request(2.0, deadline=50.0)
    due_soon = make_request(3.0, deadline=10.0)
    for request in (none_late, due_late, none_early, due_soon):
        policy.add(request)
    assert drain(policy) == [due_soon, due_late, none_early, none_late]


def test_edf_preempted_goes_ahead_of_the_same_deadline():
    policy = make_policy("edf")
    fresh, resumed = make_request(0.0, deadline=5.0), make_request(1.0, deadline=5.0)
    policy.add(fresh)
    policy.add_preempted(resumed)
    assert drain(policy) == [resumed, fresh]


def test_edf_victim_is_the_latest_deadline_none_counting_as_latest():
    policy = make_policy("edf")
    running = [make_request(0.0, deadline=9.0), make_request(1.0), make_request(2.0),
               make_request(3.0, deadline=1.0)]
    assert policy.select_victim(running) is running[2]
    assert policy.select_victim([running[0], running[3]]) is running[0]


# ---- fair ---------------------------------------------------------------------------------


def test_fair_picks_the_tenant_with_less_service():
    policy = make_policy("fair")
    a1, a2 = make_request(0.0, tenant="a"), make_request(1.0, tenant="a")
    b1 = make_request(2.0, tenant="b")
    for request in (a1, a2, b1):
        policy.add(request)
    assert policy.pop(0.0) is a1  # equal counters: the earlier head
    policy.on_scheduled(a1, 8)
    assert policy.pop(1.0) is b1
    assert policy.pop(2.0) is a2


def test_fair_counts_prompt_and_output_tokens_with_their_weights():
    policy = make_policy("fair", input_weight=1.0, output_weight=2.0)
    request = make_request(prompt=10, tenant="a", generated=3, computed=6)
    policy.on_scheduled(request, 6)  # 4 prompt tokens, then 2 generated ones
    assert policy.counters["a"] == 4 * 1.0 + 2 * 2.0
    request.num_computed_tokens = 12
    policy.on_scheduled(request, 1)  # a decode
    assert policy.counters["a"] == 10.0


def test_fair_is_fcfs_within_a_tenant_with_preempted_first():
    policy = make_policy("fair")
    first, second, resumed = (make_request(float(i), tenant="a") for i in range(3))
    policy.add(first)
    policy.add(second)
    policy.add_preempted(resumed)
    assert drain(policy) == [resumed, first, second]


def test_fair_lifts_a_returning_tenant_to_the_least_served_active_tenant():
    policy = make_policy("fair")
    a, b = make_request(0.0, tenant="a"), make_request(0.0, tenant="b")
    policy.add(a)
    policy.add(b)
    policy.counters["a"], policy.counters["b"] = 1000.0, 3000.0
    returning = make_request(1.0, tenant="idle")  # served nothing for a long time
    policy.add(returning)
    assert policy.counters["idle"] == 1000.0  # no credit banked for idling
    assert policy.pop(2.0) is a  # tie with "a": the earlier head


def test_fair_lift_with_nobody_waiting_uses_the_tenant_that_left_last():
    policy = make_policy("fair")
    a = make_request(0.0, tenant="a")
    policy.add(a)
    assert policy.pop(0.0) is a
    policy.on_scheduled(a, 500)  # 8 prompt tokens, 492 output tokens
    policy.add(make_request(1.0, tenant="b"))
    assert policy.counters["b"] == policy.counters["a"] == 8 + 492 * 2.0


def test_fair_does_not_lower_a_counter_and_does_not_lift_a_tenant_already_waiting():
    policy = make_policy("fair")
    policy.counters["rich"] = 5000.0
    policy.add(make_request(0.0, tenant="poor"))
    policy.add(make_request(1.0, tenant="rich"))
    assert policy.counters["rich"] == 5000.0
    policy.counters["poor"] = 10.0
    policy.add(make_request(2.0, tenant="poor"))  # "poor" is still waiting: no lift
    assert policy.counters["poor"] == 10.0


def test_fair_victim_is_the_latest_request_of_the_most_served_tenant():
    policy = make_policy("fair")
    policy.counters.update(a=10.0, b=20.0)
    running = [make_request(0.0, tenant="b"), make_request(5.0, tenant="a"),
               make_request(1.0, tenant="b")]
    assert policy.select_victim(running) is running[2]


def test_fair_pop_returns_the_peek_even_if_counters_moved():
    policy = make_policy("fair")
    a, b = make_request(0.0, tenant="a"), make_request(1.0, tenant="b")
    policy.add(a)
    policy.add(b)
    assert policy.peek(7.0) is a
    policy.on_scheduled(make_request(tenant="a"), 100)  # a running request of "a" got tokens
    assert policy.pop(7.0) is a
    assert policy.peek(8.0) is b


# ---- lpm ----------------------------------------------------------------------------------


def test_lpm_prefers_the_longest_cached_prefix_then_arrival():
    matches = {}
    policy = make_policy("lpm", prefix_match_len=lambda r: matches[r.request_id])
    requests = [make_request(float(i), request_id=f"m{i}") for i in range(4)]
    matches.update(m0=0, m1=16, m2=32, m3=16)
    for request in requests:
        policy.add(request)
    assert drain(policy) == [requests[2], requests[1], requests[3], requests[0]]


def test_lpm_asks_the_cache_afresh_but_pop_returns_what_peek_said():
    matches = {"x": 0, "y": 8}
    policy = make_policy("lpm", prefix_match_len=lambda r: matches[r.request_id])
    x, y = make_request(0.0, request_id="x"), make_request(1.0, request_id="y")
    policy.add(x)
    policy.add(y)
    assert policy.peek(0.0) is y
    matches["x"] = 64  # the scheduler allocated between peek and pop
    assert policy.pop(0.0) is y
    policy.add(y)
    assert policy.peek(1.0) is x


def test_lpm_falls_back_to_fcfs_past_max_scan():
    calls = []

    def prefix_match_len(request):
        calls.append(request)
        return int(request.request_id[1:])  # later arrivals match more

    policy = make_policy("lpm", prefix_match_len=prefix_match_len, max_scan=3)
    requests = [make_request(float(i), request_id=f"q{i}") for i in range(5)]
    for request in requests:
        policy.add(request)
    assert policy.pop(0.0) is requests[0]  # 5 waiting > 3: FCFS, no scan
    assert policy.pop(1.0) is requests[1]  # 4 > 3
    assert calls == []
    assert policy.pop(2.0) is requests[4]  # 3 waiting: scanned, longest match wins
    assert len(calls) == 3


def test_lpm_preempted_goes_ahead_of_an_equal_match():
    policy = make_policy("lpm", prefix_match_len=lambda r: 8)
    fresh, resumed = make_request(0.0), make_request(1.0)
    policy.add(fresh)
    policy.add_preempted(resumed)
    assert drain(policy) == [resumed, fresh]


# ---- random sequences -------------------------------------------------------------------------


def _fcfs_rank(request, preempted):
    due = math.inf if request.first_token_due is None else request.first_token_due
    return (0 if preempted else 1, due, request.arrival_time)


def _check_choice(policy, name, chosen, waiting, now, matches):
    """The spec's order, stated independently of the implementation."""
    def best(rank):
        return min(waiting, key=lambda r: rank(r, waiting[r]))

    if name == "fcfs":
        assert chosen is best(_fcfs_rank)
    elif name == "priority":
        assert chosen is best(lambda r, p: (-r.priority,) + _fcfs_rank(r, p))
    elif name == "edf":
        assert chosen is best(lambda r, p: (
            math.inf if r.deadline is None else r.deadline,) + _fcfs_rank(r, p))
    elif name == "sjf":
        sizes = {r: policy.effective_size(r, now) for r in waiting}
        assert sizes[chosen] <= min(sizes.values()) + 1e-6
    elif name == "fair":
        least = min(policy.counters[r.tenant] for r in waiting)
        assert policy.counters[chosen.tenant] == least
        same_tenant = {r: p for r, p in waiting.items() if r.tenant == chosen.tenant}
        assert chosen is min(same_tenant, key=lambda r: _fcfs_rank(r, same_tenant[r]))
    elif name == "lpm":
        if len(waiting) > policy.max_scan:
            assert chosen is best(_fcfs_rank)
        else:
            assert chosen is best(lambda r, p: (-matches[r],) + _fcfs_rank(r, p))


_operations = st.one_of(
    st.tuples(st.sampled_from(["add", "add_preempted"]),
              st.integers(0, 3),  # priority
              st.one_of(st.none(), st.integers(0, 5)),  # deadline
              st.sampled_from(["a", "b", "c"]),  # tenant
              st.integers(1, 40),  # prompt length
              st.integers(0, 64),  # cached prefix
              st.one_of(st.none(), st.integers(0, 8))),  # first-token target, quarter seconds
    st.tuples(st.just("pop")),
    st.tuples(st.just("remove"), st.integers(0, 10**6)),
    st.tuples(st.just("serve"), st.integers(0, 10**6), st.integers(1, 50)),
)


@pytest.mark.parametrize("name", BUILTINS)
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(operations=st.lists(_operations, max_size=80))
def test_random_sequences_keep_the_queue_contract(name, operations):
    matches: dict[Request, int] = {}
    policy = make_policy(name, prefix_match_len=lambda r: matches[r])
    if name == "lpm":
        policy.max_scan = 6  # small, so that both the scan and the fallback run
    waiting: dict[Request, bool] = {}  # request -> came back preempted
    left: list[Request] = []
    added: list[Request] = []
    now = 0.0
    for operation in operations:
        now += 0.25
        kind = operation[0]
        if kind in ("add", "add_preempted"):
            _, priority, deadline, tenant, prompt, cached, target = operation
            request = make_request(now, prompt=prompt, priority=priority, tenant=tenant,
                                   deadline=None if deadline is None else float(deadline),
                                   first_token_due=None if target is None else now + target / 4)
            matches[request] = cached
            getattr(policy, kind)(request)
            waiting[request] = kind == "add_preempted"
            added.append(request)
        elif kind == "pop":
            peeked = policy.peek(now)
            if not waiting:
                assert peeked is None
                continue
            _check_choice(policy, name, peeked, waiting, now, matches)
            assert policy.pop(now) is peeked
            del waiting[peeked]
            left.append(peeked)
        elif kind == "remove" and waiting:
            request = list(waiting)[operation[1] % len(waiting)]
            policy.remove(request)
            del waiting[request]
            left.append(request)
        elif kind == "serve" and added:
            policy.on_scheduled(added[operation[1] % len(added)], operation[2])
        assert len(policy) == len(waiting)
        assert set(policy) == set(waiting)

    left.extend(drain(policy, now))
    assert sorted(map(id, left)) == sorted(map(id, added))  # each left exactly once
    assert len(policy) == 0 and list(policy) == []
