"""Settings parsed once: CLI values first, the environment as fallback, checked at construction."""
import dataclasses

import pytest

from splitmoe.gateway.settings import ENV_API_KEY, GatewaySettings


def test_cli_values_win_and_the_environment_fills_the_rest():
    s = GatewaySettings.from_env({ENV_API_KEY: "from-env"}, attention_address="h:1", port=None)
    assert s.api_key == "from-env" and s.port == 8000
    assert GatewaySettings.from_env({ENV_API_KEY: "e"}, attention_address="h:1", api_key="cli").api_key == "cli"
    assert GatewaySettings.from_env({}, attention_address="h:1").api_key is None


def test_settings_are_frozen_and_checked():
    s = GatewaySettings(attention_address="h:1")
    with pytest.raises(dataclasses.FrozenInstanceError):
        s.port = 1
    with pytest.raises(ValueError, match="HOST:PORT"):
        GatewaySettings(attention_address="nohost")
    with pytest.raises(ValueError, match="max_body_bytes"):
        GatewaySettings(attention_address="h:1", max_body_bytes=0)
