"""Settings a server command refuses before it opens anything: a clear usage error (exit code 2),
not a server that starts and misbehaves."""

from __future__ import annotations

import pytest
from click.testing import CliRunner

from qmq.cli import main


@pytest.mark.parametrize("command", [["broker"], ["delay-server", "--broker", "127.0.0.1:1"]])
@pytest.mark.parametrize("max_lag", ["0s", "0ms"])
def test_a_max_lag_of_zero_is_refused(tmp_path, command: list[str], max_lag: str) -> None:
    """With --max-lag 0 no replica is ever in sync: a replicated group would refuse every send."""
    data_dir = tmp_path / "data"
    result = CliRunner().invoke(main, [*command, "--data-dir", str(data_dir), "--max-lag", max_lag])
    assert result.exit_code == 2, result.output
    assert "Invalid value for '--max-lag': must be longer than 0" in result.output
    assert not data_dir.exists()
