"""The air-gapped install: a wheelhouse built for a target that lacks some of ocrl's packages holds
exactly those, and installs offline into that target so that `python -m ocrl --help` runs.

The target is faked here: a fresh venv that sees this venv's packages except the ones taken out
(linked in one by one, so what it lacks it really lacks). Building the wheelhouse needs a package
registry, as it does for a user (it runs on the connected machine); installing it does not.
"""

from __future__ import annotations

import importlib.metadata
import os
import subprocess
import sys
import venv
from pathlib import Path

from ocrl import wheelhouse

ROOT = Path(__file__).resolve().parent.parent
TAKEN_OUT = {"msgspec", "starlette", "uvicorn"}


def fake_target(tmp_path: Path) -> tuple[Path, dict[str, str]]:
    """A venv holding every package of this one (linked) but TAKEN_OUT and ocrl itself."""
    venv.create(tmp_path / "target", with_pip=False)
    python = tmp_path / "target" / "bin" / "python"
    shared = tmp_path / "shared-site"
    shared.mkdir()
    have = {}
    for dist in importlib.metadata.distributions():
        name = wheelhouse.canonical(dist.metadata["Name"])
        if name in TAKEN_OUT or name == "ocrl" or not dist.files:
            continue
        have[name] = dist.version
        for file in dist.files:
            top = file.parts[0]
            if top.endswith(".pth") or top == ".." or (shared / top).exists():
                continue
            source = Path(dist.locate_file(top))
            if source.exists():
                (shared / top).symlink_to(source)
    site = next((tmp_path / "target" / "lib").glob("python*/site-packages"))
    (site / "shared.pth").write_text(f"{shared}\n")
    return python, have


def ocrl_help(python: Path, *path: Path) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env["PYTHONPATH"] = os.pathsep.join(map(str, [*path, ROOT]))
    return subprocess.run([str(python), "-m", "ocrl", "--help"], capture_output=True, text=True, env=env, cwd=ROOT, timeout=300)


def test_wheelhouse_holds_what_the_target_lacks_and_installs_offline(tmp_path):
    python, have = fake_target(tmp_path)
    without = ocrl_help(python)
    assert without.returncode != 0 and "No module named" in without.stderr  # the target really lacks them

    folder = tmp_path / "wheels"
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    manifest = wheelhouse.build(folder, have, python=version, platforms=wheelhouse.PLATFORMS, extras=[], log=lambda *_: None)
    # exactly the missing packages, one wheel each, at the versions this venv runs
    assert set(manifest["wheels"]) == TAKEN_OUT
    assert sorted(p.name for p in folder.glob("*.whl")) == sorted(w["file"] for w in manifest["wheels"].values())
    assert manifest["total_bytes"] == sum(p.stat().st_size for p in folder.glob("*.whl"))

    target = tmp_path / "offline-site"
    wheelhouse.install(folder, target)
    done = ocrl_help(python, target)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "serve" in done.stdout and "bench" in done.stdout


def test_target_packages_parse_as_freeze_or_names(tmp_path):
    listing = tmp_path / "freeze.txt"
    listing.write_text("# comment\ntorch==2.11.0+cu130\nTyping_Extensions==4.15.0\npeft\nmy-pkg @ file:///x.whl\n-e .\n")
    assert wheelhouse.read_have(listing) == {"torch": "2.11.0", "typing-extensions": "4.15.0", "peft": "", "my-pkg": ""}
    listing.write_text("torch>=2\n")
    try:
        wheelhouse.read_have(listing)
    except ValueError as e:
        assert "torch>=2" in str(e)
    else:
        raise AssertionError("a requirement range is not a package the target has")


def test_what_the_target_has_at_a_fitting_version_is_not_resolved_again():
    have = {"torch": "2.11.0", "transformers": "5.17.0", "peft": ""}
    assert wheelhouse.met("torch>=2.4,<=2.14.1", have) is True  # torch's CUDA deps stay the target's business
    assert wheelhouse.met("transformers>=5.24,<6", have) is False  # too old: the wheelhouse carries a newer one
    assert wheelhouse.met("peft>=0.13", have) is True  # present, version unknown: taken as it is
    assert wheelhouse.met("msgspec>=0.18", have) is False
    assert wheelhouse.met("uvloop>=0.19; sys_platform == 'win32'", {}) is True  # not needed on Linux
    assert wheelhouse.unmet(["transformers>=5.24,<6", "torch>=2.4"], {"transformers": "5.17.0", "torch": "2.11.0"}) == ["transformers"]
    assert wheelhouse.missing([("torch", "2.11.0"), ("msgspec", "0.19.0"), ("peft", "0.17.0")], have) == [("msgspec", "0.19.0")]
