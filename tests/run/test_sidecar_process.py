"""The trainer's handle on the sidecar subprocess: the admin token reaches it whatever it looks like,
and never on the command line."""

from __future__ import annotations

import httpx

from agl_trainer.run.sidecar_client import SidecarAdmin, SidecarProcess
from agl_testing.fake_vllm import FakeVLLM


async def test_an_admin_token_starting_with_a_dash_works_and_stays_off_the_command_line(tmp_path) -> None:
    token = "-Xy_secret-token"  # token_urlsafe() can start with "-": once it broke start-up
    with FakeVLLM() as engine:
        sidecar = SidecarProcess([engine.base_url], "http://127.0.0.1:9", admin_token=token, log_path=tmp_path / "log")
        assert token not in sidecar.command()
        sidecar.start()
        try:
            async with SidecarAdmin(sidecar.url, token) as admin:
                state = await admin.state()
            assert state.paused is False
            refused = httpx.get(f"{sidecar.url}/agl/v1/state", headers={"authorization": "Bearer wrong"})
            assert refused.status_code == 401
        finally:
            sidecar.stop()
