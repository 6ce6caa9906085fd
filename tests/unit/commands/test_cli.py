"""Every command's --help renders (argparse formats help strings with %)."""

from __future__ import annotations

import pytest

from exporter.commands.cli import main


@pytest.mark.parametrize(
    "argv",
    [
        [],
        ["serve"],
        ["demo"],
        ["probe"],
        ["sim-engine"],
        ["ctl"],
        ["ctl", "status"],
        ["ctl", "reset-prefix-cache"],
    ],
)
def test_help(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as done:
        main([*argv, "--help"])
    assert done.value.code == 0
    assert "usage: vllm-dp-exporter" in capsys.readouterr().out
