"""Claude Code's declared tree, as 2.1.328 sends it (tests/fixtures/claude-code-2.1.328/subagents):
every call carries `X-Claude-Code-Session-Id`; a sub-agent's calls `x-claude-code-agent-id`, and
from the second level on `x-claude-code-parent-agent-id`; the main thread sends no agent id. The
main agent is its session, and a first-level sub-agent's parent is that session."""

from __future__ import annotations

import pytest
from agl_sidecar import inputs
from agl_sidecar.calls.attribution import resolve

from tests.harnesses.support import captured

SESSION = "00000000-0000-4000-8000-000000000000"


def declared(headers: dict[str, str]) -> tuple[str | None, str | None]:
    identity = resolve({k.lower(): v for k, v in headers.items()}, "r", None, {})
    return identity.agent_id, identity.parent_agent_id


def test_the_captured_sub_agent_run_declares_a_tree_of_depth_three() -> None:
    pairs = [declared(request["headers"]) for request in captured("subagents")]
    main, one, two, three = pairs[0], pairs[1], pairs[2], pairs[3]
    assert main == (SESSION, None)
    assert one[1] == SESSION and two[1] == one[0] and three[1] == two[0]
    assert len({main[0], one[0], two[0], three[0]}) == 4
    # each agent's later calls declare it again: three returns, then two, one and the main thread
    assert pairs[4:] == [three, two, one, main]


def test_agl_s_own_headers_still_win_over_claude_code_s() -> None:
    headers = {"X-Claude-Code-Session-Id": SESSION, "x-claude-code-agent-id": "sub"}
    assert declared(headers) == ("sub", SESSION)
    assert declared({**headers, "x-agl-agent-id": "planner", "x-agl-parent-agent-id": "root"}) == ("planner", "root")
    assert declared({"x-claude-code-agent-id": "sub"}) == ("sub", None)  # no session: no parent to name
    assert declared({}) == (None, None)


def test_a_session_id_a_span_cannot_carry_is_refused_naming_the_header() -> None:
    with pytest.raises(inputs.BadInput) as info:
        declared({"X-Claude-Code-Session-Id": "s" * 300})
    assert info.value.param == "x-claude-code-session-id"
