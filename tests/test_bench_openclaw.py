"""`bench openclaw` finds the OpenClaw CLI and a recent enough node, or says what is missing
(the run itself needs npm and minutes, so it is never part of the test suite)."""

from __future__ import annotations

import pytest

from ocrl.bench.openclaw import Refused, checks, find_openclaw


def _fake_install(folder, node_version: str):
    bin_dir = folder / "node_modules" / ".bin"
    bin_dir.mkdir(parents=True)
    (bin_dir / "openclaw").write_text("#!/bin/sh\n")
    node_dir = folder / "node_modules" / "node" / "bin"
    node_dir.mkdir(parents=True)
    node = node_dir / "node"
    node.write_text(f"#!/bin/sh\necho {node_version}\n")
    node.chmod(0o755)


def test_a_folder_without_openclaw_is_refused_with_the_install_command(tmp_path):
    with pytest.raises(Refused, match="npm install openclaw@2026.9.6"):
        find_openclaw(str(tmp_path))


def test_a_node_older_than_24_16_is_refused(tmp_path):
    _fake_install(tmp_path, "v20.20.2")
    with pytest.raises(Refused, match="v20.20.2 .* too old"):
        find_openclaw(str(tmp_path))


def test_the_bundled_node_is_put_first_on_the_path(tmp_path):
    _fake_install(tmp_path, "v24.21.0")
    cli, env = find_openclaw(str(tmp_path))
    assert cli == [str(tmp_path / "node_modules" / ".bin" / "openclaw")]
    assert env["PATH"].startswith(str(tmp_path / "node_modules" / "node" / "bin"))


def test_a_5xx_or_housekeeping_kept_as_main_fails_the_run():
    good = {"statuses": {200: 14}, "main_turns": 8, "main_sessions": 1, "requests_with_tool_results": 1,
            "compaction_summaries": 1, "side_turns": 3, "housekeeping_kept_as_main": 0,
            "turns_after_compaction_in_session": 1, "samples": 7, "next_states_with_envelope": 0}  # fmt: skip
    assert all(ok for _, ok in checks(good))
    failed = dict(checks({**good, "statuses": {200: 13, 502: 1}, "housekeeping_kept_as_main": 1}))
    assert failed["no 5xx"] is False and failed["housekeeping served as side turns"] is False
    assert failed["one session for the conversation"] is True
