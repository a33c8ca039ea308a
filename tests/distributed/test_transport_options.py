"""The broker's redelivery backstop follows the setting: a short visibility timeout (what
tests/docker uses to see a killed attempt's message handed out again) is also swept for often
enough, and the default keeps kombu's own pace."""

from __future__ import annotations

import pytest

from core.settings import Settings
from worker.celery_app import make_celery


@pytest.mark.parametrize(
    ("timeout_s", "sweep_s"),
    [(12 * 3600.0, 100), (20.0, 10), (3.0, 1)],
)
def test_deliveries_past_the_timeout_are_looked_for_at_least_twice_per_timeout(
    timeout_s: float, sweep_s: int
) -> None:
    settings = Settings(executor="celery", broker_visibility_timeout_s=timeout_s)
    options = make_celery(settings).conf.broker_transport_options
    assert options["visibility_timeout"] == timeout_s
    sweep = options["unacked_restore_interval"] * options["unacked_restore_throttle"]
    assert sweep == sweep_s and sweep <= max(1.0, timeout_s / 2)


def test_the_visibility_timeout_must_be_positive() -> None:
    with pytest.raises(ValueError, match="broker_visibility_timeout_s"):
        Settings(broker_visibility_timeout_s=0)
