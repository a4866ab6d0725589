"""Policy versions across resumes: a resume to a lower version (a new run on an attached sidecar, a
trainer resumed from an older checkpoint) starts the switch record afresh, so a call's span names
only the switches it lived through, its versions non-decreasing from its entry version."""

from __future__ import annotations

import httpx
from hypothesis import given, settings
from hypothesis import strategies as st

from agl import semconv
from agl_sidecar.proxy.gate import Gate
from agl_sidecar.calls.switches import version_runs

MESSAGES = [{"role": "user", "content": "go"}]


def test_a_streamed_call_after_a_lower_resume_is_all_of_the_new_runs_version(fake, make_sidecar, otlp_sink):
    sidecar = make_sidecar(upstream=[fake.base_url], otlp_endpoint=otlp_sink.endpoint)
    admin = httpx.Client(base_url=sidecar.url, timeout=30)
    assert admin.post(semconv.ADMIN_PAUSE_PATH, json={"mode": "keep"}).status_code == 200
    assert admin.post(semconv.ADMIN_RESUME_PATH, json={"policy_version": 100, "switch": True}).status_code == 200
    assert admin.post(semconv.ADMIN_RESUME_PATH, json={"policy_version": 3}).json()["policy_version"] == 3
    body = {"model": "tiny", "messages": MESSAGES, "max_tokens": 6, "stream": True}
    answer = httpx.post(f"{sidecar.url}/rollouts/lower/v1/chat/completions", json=body, timeout=30)
    assert answer.status_code == 200
    (span,) = otlp_sink.wait_for(lambda spans: len(spans) >= 1)
    assert span.attributes[semconv.POLICY_VERSION] == 3
    assert semconv.COMPLETION_POLICY_VERSIONS not in span.attributes  # every token is version 3's


def test_a_switch_to_a_lower_version_is_refused_naming_the_fix(fake, make_sidecar):
    sidecar = make_sidecar(upstream=[fake.base_url])
    admin = httpx.Client(base_url=sidecar.url, timeout=30)
    assert admin.post(semconv.ADMIN_RESUME_PATH, json={"policy_version": 7}).status_code == 200
    admin.post(semconv.ADMIN_PAUSE_PATH, json={"mode": "keep"})
    refused = admin.post(semconv.ADMIN_RESUME_PATH, json={"policy_version": 5, "switch": True})
    assert refused.status_code == 400
    assert "policy_version 5" in refused.json()["error"] and "without" in refused.json()["error"]
    assert admin.get(semconv.ADMIN_STATE_PATH).json()["policy_version"] == 7  # nothing changed


# One step of the trainer's side: a keep switch to a version (the engine's progress of each call in
# flight, or no word), a plain resume to any version, or a call entering.
_steps = st.lists(
    st.one_of(
        st.tuples(st.just("switch"), st.integers(0, 12), st.booleans()),
        st.tuples(st.just("plain"), st.integers(0, 12), st.just(False)),
        st.tuples(st.just("enter"), st.just(0), st.just(False)),
    ),
    max_size=30,
)


@settings(max_examples=300, deadline=None)
@given(_steps, st.integers(1, 40))
def test_a_calls_versions_are_the_switches_it_lived_through(steps, length):
    gate = Gate(max_hold_s=1.0)
    calls: list[tuple[str, int, object, list[int]]] = []  # id, entry version, its log, versions switched to since
    for n, (kind, version, engine_word) in enumerate(steps):
        if kind == "enter":
            calls.append((f"chatcmpl-{n}", gate.policy_version, gate.switches, []))
        elif kind == "plain":
            gate.resume(version)
        elif version >= gate.policy_version:  # a switch moves forward (the admin API refuses the rest)
            progress = {call_id: 1 + n % length for call_id, *_ in calls} if engine_word else None
            before = gate.policy_version
            gate.resume(version, switch=True, progress=progress)
            if version != before:
                for _, _, _, lived in calls:
                    lived.append(version)
    for call_id, entry, log, lived in calls:
        runs = version_runs(log, entry, call_id, None, length)  # type: ignore[arg-type]
        if runs is None:
            continue
        versions = runs[1::2]
        assert versions[0] == entry
        assert all(a <= b for a, b in zip(versions, versions[1:], strict=False))
        assert set(versions[1:]) <= set(lived)
