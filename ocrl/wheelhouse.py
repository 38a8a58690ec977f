"""`./run.sh wheelhouse DIR`: the wheels ocrl needs that a target environment lacks, for a
machine that cannot reach a package registry (an air-gapped GPU box), and `./run.sh offline DIR`
to install them there.

On the connected machine, pip resolves ocrl's requirements (pyproject's dependencies plus the
chosen extras) for the target's Python and platform, with every package the target already has
pinned to the version it has (`--have`: a `pip freeze` of the target, or a list of names for
packages whose version is unknown). A pin that cannot hold (ocrl needs a newer transformers than
the target's, say) is released and the wheelhouse carries the newer version, which shadows the
target's once the install dir is first on PYTHONPATH. What the target already has at the resolved
version is left out. The result has one wheel per package and a `manifest.json`.

This module runs pip and reads pyproject.toml; it knows nothing of serving or training.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import tempfile
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# The manylinux tags a current x86_64 Linux box accepts; pip matches each tag exactly.
PLATFORMS = ["manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_24_x86_64", "manylinux_2_17_x86_64",
             "manylinux2014_x86_64", "manylinux1_x86_64", "linux_x86_64"]  # fmt: skip


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def public(version: str) -> str:
    """2.11.0+cu130 -> 2.11.0: the target's local build tag is not on an index."""
    return version.split("+", 1)[0]


def read_have(path: Path) -> dict[str, str]:
    """A target's packages: `name==version` lines (pip freeze), or bare names (any version)."""
    have: dict[str, str] = {}
    for raw in path.read_text().splitlines():
        line = raw.split("#", 1)[0].strip()
        if not line or line.startswith("-"):
            continue
        if " @ " in line:  # installed from a file or URL: the name is known, the version is not
            have[canonical(line.split(" @ ", 1)[0])] = ""
            continue
        name, _, version = line.partition("==")
        if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]*", name.strip()):
            raise ValueError(f"{path}: cannot read {raw!r} (expected name==version or a name)")
        have[canonical(name.strip())] = public(version.strip())
    return have


def requirements(extras: list[str]) -> list[str]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    wanted = list(project["dependencies"])
    for extra in extras:
        if extra not in project.get("optional-dependencies", {}):
            raise ValueError(f"pyproject.toml has no extra {extra!r}")
        wanted += project["optional-dependencies"][extra]
    return wanted


def target_flags(python: str, platforms: list[str]) -> list[str]:
    abi = "cp" + python.replace(".", "")
    flags = ["--only-binary=:all:", "--python-version", python, "--implementation", "cp", "--abi", abi, "--abi", "abi3", "--abi", "none"]
    for platform in platforms:
        flags += ["--platform", platform]
    return flags


def unmet(wanted: list[str], pins: dict[str, str]) -> list[str]:
    """Pins that fail one of ocrl's own requirements (the target's transformers is too old, say)."""
    from packaging.requirements import Requirement

    out = []
    for line in wanted:
        requirement = Requirement(line)
        name = canonical(requirement.name)
        if name in pins and not requirement.specifier.contains(pins[name], prereleases=True):
            out.append(name)
    return out


def met(line: str, have: dict[str, str]) -> bool:
    from packaging.requirements import Requirement

    requirement = Requirement(line)
    if requirement.marker is not None and not requirement.marker.evaluate({"sys_platform": "linux"}):
        return True  # not needed on a Linux target
    version = have.get(canonical(requirement.name))
    if version is None:
        return False
    return version == "" or requirement.specifier.contains(version, prereleases=True)


def resolve(wanted: list[str], have: dict[str, str], flags: list[str], *, keep=("torch",), log=print) -> list[tuple[str, str]]:
    """pip's resolution for the target: [(name, version)] of every package ocrl needs there.
    A pin in `keep` is never released (a second torch would be gigabytes): its conflict is an error."""
    pins = {name: version for name, version in have.items() if version}
    released = unmet(wanted, pins)
    # What the target has at a fitting version is not resolved again: its own dependencies (torch's
    # CUDA libraries) are the target's business, and an index may not even hold them.
    wanted = [line for line in wanted if met(line, have) is False]
    for attempt in range(8):
        if released:
            if held := sorted(set(released) & set(keep)):
                raise RuntimeError(f"the target's {', '.join(f'{n}=={pins[n]}' for n in held)} does not fit ocrl's requirements")
            log(f"wheelhouse: the target's {', '.join(f'{n}=={pins[n]}' for n in sorted(released))} does not fit ocrl's "
                f"requirements; carrying a version that does")  # fmt: skip
            for name in released:
                pins.pop(name)
        with tempfile.TemporaryDirectory() as tmp:
            constraints = Path(tmp, "constraints.txt")
            constraints.write_text("".join(f"{name}=={version}\n" for name, version in sorted(pins.items())))
            report = Path(tmp, "report.json")
            cmd = [sys.executable, "-m", "pip", "install", "--disable-pip-version-check", "--dry-run",
                   "--ignore-installed", "--target", str(Path(tmp, "target")), "--report", str(report),
                   "-c", str(constraints), *flags, *wanted]  # fmt: skip
            done = subprocess.run(cmd, capture_output=True, text=True)
            if done.returncode == 0:
                items = json.loads(report.read_text())["install"]
                return [(canonical(i["metadata"]["name"]), i["metadata"]["version"]) for i in items]
        # pip lists the requirements that clash after "The conflict is caused by:"
        said = done.stdout + done.stderr
        cause = said.partition("The conflict is caused by:")[2].partition("To fix this")[0]
        released = sorted({canonical(w) for w in re.findall(r"[A-Za-z0-9][A-Za-z0-9._-]*[A-Za-z0-9]", cause)} & set(pins))
        if not released:
            raise RuntimeError(f"pip could not resolve ocrl's requirements for the target:\n{said[-3000:]}")
    raise RuntimeError("pip could not resolve ocrl's requirements for the target (too many conflicting pins)")


def missing(resolved: list[tuple[str, str]], have: dict[str, str]) -> list[tuple[str, str]]:
    """What the target lacks: packages it has not got, or has at another version."""
    out = []
    for name, version in resolved:
        if name in have and (not have[name] or public(have[name]) == public(version)):
            continue
        out.append((name, version))
    return sorted(out)


def build(folder: Path, have: dict[str, str], *, python: str, platforms: list[str], extras: list[str], log=print) -> dict:
    folder.mkdir(parents=True, exist_ok=True)
    for stale in folder.glob("*.whl"):
        stale.unlink()  # one build per folder: one version of each package, no strays
    flags = target_flags(python, platforms)
    wanted = requirements(extras)
    log(f"wheelhouse: resolving {len(wanted)} requirements for Python {python} on {platforms[0]} "
        f"(the target has {len(have)} packages)")  # fmt: skip
    needed = missing(resolve(wanted, have, flags, log=log), have)
    if not needed:
        log("wheelhouse: the target already has everything ocrl needs")
    else:
        log(f"wheelhouse: downloading {len(needed)} wheels: {' '.join(f'{n}=={v}' for n, v in needed)}")
        cmd = [sys.executable, "-m", "pip", "download", "--disable-pip-version-check", "--quiet", "--no-deps",
               "-d", str(folder), *flags, *(f"{n}=={v}" for n, v in needed)]  # fmt: skip
        subprocess.run(cmd, check=True)
    wanted_files: dict[str, Path] = {}
    for wheel in sorted(folder.glob("*.whl")):
        name = canonical(wheel.name.split("-")[0])
        if name in wanted_files:
            raise RuntimeError(f"two wheels of {name}: {wanted_files[name].name} and {wheel.name}")
        wanted_files[name] = wheel
    absent = sorted({n for n, _ in needed} - set(wanted_files))
    if absent:
        raise RuntimeError(f"pip downloaded no wheel for {', '.join(absent)}")
    manifest = {
        "python": python, "platforms": platforms, "extras": extras,
        "wheels": {name: {"file": w.name, "bytes": w.stat().st_size} for name, w in sorted(wanted_files.items())},
        "total_bytes": sum(w.stat().st_size for w in wanted_files.values()),
    }  # fmt: skip
    (folder / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
    log(f"wheelhouse: {len(wanted_files)} wheels, {manifest['total_bytes'] / 2**20:.1f} MiB in {folder}")
    return manifest


def install(folder: Path, target: Path, *, python: str = sys.executable) -> list[str]:
    """Unpack every wheel of `folder` into `target` (put it first on PYTHONPATH), never touching
    the network: `python` is the target's own interpreter, whose packages stay as they are."""
    wheels = sorted(folder.glob("*.whl"))
    if not wheels:
        raise RuntimeError(f"no wheels in {folder}")
    cmd = [python, "-m", "pip", "install", "--disable-pip-version-check", "--quiet", "--no-index", "--no-deps",
           "--no-compile", "--no-cache-dir", "--upgrade", "--target", str(target), *map(str, wheels)]  # fmt: skip
    subprocess.run(cmd, check=True)
    return [w.name for w in wheels]


def main(argv: list[str]) -> int:
    import argparse

    parser = argparse.ArgumentParser(prog="./run.sh wheelhouse", description=__doc__.split("\n\n")[0])
    parser.add_argument("dir", type=Path, help="where the wheels go")
    parser.add_argument("--have", type=Path, help="the target's packages: a `pip freeze` of it, or one name per line")
    parser.add_argument("--python", default=f"{sys.version_info.major}.{sys.version_info.minor}", help="the target's Python (e.g. 3.12)")
    parser.add_argument("--platform", action="append", help=f"a wheel platform tag the target accepts (repeatable; default {PLATFORMS[0]} and older)")
    parser.add_argument("--extras", default="dev", help="comma-separated extras of ocrl to include (default dev: the tests need it)")
    args = parser.parse_args(argv)
    try:
        have = read_have(args.have) if args.have else {}
        build(args.dir, have, python=args.python, platforms=args.platform or PLATFORMS,
              extras=[e for e in args.extras.split(",") if e])  # fmt: skip
    except (ValueError, RuntimeError, OSError, subprocess.CalledProcessError) as e:
        print(f"ocrl wheelhouse: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
