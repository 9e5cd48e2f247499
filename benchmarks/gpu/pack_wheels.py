"""The wheelhouse: the wheels a bare GPU host lacks, pinned, downloaded where pip works, checked complete.

requirements.txt    one exact pin a line: what ships (adding a package is one line)
host-packages.txt   what the host's image already holds (a version where one was read), and the date it was read

`prepare` downloads the pins for CPython 3.12 on x86-64 manylinux into the wheelhouse (default .whl/), removes
any other wheel there (two versions of one package stop the install), checks, and stamps the commit into
`commit.json` beside the wheels, since the host may get the tree without .git. `check`: every requirement of
our pyproject (dependencies and every extra) and of every shipped wheel is shipped or on the host, in a version
that satisfies it where the version is known; one wheel a pin and none else; platform tags the host takes; the
total under the size budget. Needs `packaging` (pip's own copy will do); the runner on the host does not.
"""

from __future__ import annotations

import email.parser
import hashlib
import json
import re
import subprocess
import sys
import time
import zipfile
from dataclasses import dataclass
from pathlib import Path

try:
    from packaging.requirements import Requirement
    from packaging.version import Version
except ImportError:  # pragma: no cover - where only pip's vendored copy is there
    from pip._vendor.packaging.requirements import Requirement
    from pip._vendor.packaging.version import Version

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
PINS = HERE / "requirements.txt"
HOST = HERE / "host-packages.txt"
WHEELHOUSE = REPO / ".whl"
COMMIT_FILE = "commit.json"
BUDGET_MIB = 40.0
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64",
             "manylinux1_x86_64")
# The host's interpreter, for environment markers (extras evaluate false: only what is always required counts).
HOST_MARKERS = {"python_version": "3.12", "python_full_version": "3.12.3", "sys_platform": "linux",
                "platform_system": "Linux", "platform_machine": "x86_64", "os_name": "posix",
                "implementation_name": "cpython", "platform_python_implementation": "CPython", "extra": ""}
_PYTHON_TAGS = {"py3", "py312", "cp312"}
_ABI_TAGS = {"none", "abi3", "cp312"}


def normalize(name: str) -> str:
    """PEP 503 name: `Huggingface_Hub` and `huggingface-hub` are one package."""
    return re.sub(r"[-_.]+", "-", name).lower()


def read_pins(path=PINS) -> dict[str, str]:
    """{name: version} from `name==version` lines (comments after #); anything else, or a name twice, raises."""
    pins = {}
    for number, line in enumerate(Path(path).read_text().splitlines(), 1):
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        match = re.fullmatch(r"([A-Za-z0-9][A-Za-z0-9._-]*)==([A-Za-z0-9.+!_-]+)", line)
        if not match:
            raise ValueError(f"{path}:{number}: {line!r} is not an exact pin NAME==VERSION")
        name = normalize(match[1])
        if name in pins:
            raise ValueError(f"{path}:{number}: {name} is pinned twice")
        pins[name] = match[2]
    return pins


def read_host(path=HOST) -> tuple[str, dict[str, str | None]]:
    """(date read, {name: version or None}) from the host list: `# read: DATE`, then `name[==version]` lines."""
    date, packages = "unknown", {}
    for line in Path(path).read_text().splitlines():
        if match := re.match(r"#\s*read:\s*(\S+)", line):
            date = match[1]
        line = line.split("#", 1)[0].strip()
        if line:
            name, _, version = line.partition("==")
            packages[normalize(name)] = version or None
    return date, packages


# extras the GPU pack never installs: `clients` (lm-eval, guidellm) and `lint` (ruff) serve CPU tests only, which
# `pytest -m gpu` skips (tests/test_server_clients.py and tests/test_lint.py skip themselves where they are missing,
# outside CI); `structured` (llguidance) neither: its tests are CPU ones too, and its wheel is manylinux_2_31,
# outside the pack's PLATFORMS
NOT_ON_THE_GPU_HOST = {"clients", "lint", "structured"}


def project_requirements(pyproject=REPO / "pyproject.toml") -> list[tuple[str, str]]:
    """[(requirement, who needs it)]: the project's dependencies and every optional extra's."""
    import tomllib

    project = tomllib.loads(Path(pyproject).read_text())["project"]
    out = [(r, "pyproject") for r in project.get("dependencies", [])]
    for extra, reqs in project.get("optional-dependencies", {}).items():
        if extra not in NOT_ON_THE_GPU_HOST:
            out += [(r, f"pyproject [{extra}]") for r in reqs]
    return out


@dataclass(frozen=True)
class Wheel:
    path: Path
    name: str       # normalized
    version: str
    requires: tuple[str, ...]

    @property
    def size(self) -> int:
        return self.path.stat().st_size


def read_wheel(path) -> Wheel:
    """Name, version and Requires-Dist of a wheel, from its METADATA."""
    path = Path(path)
    with zipfile.ZipFile(path) as zf:
        metadata = next((n for n in zf.namelist() if re.fullmatch(r"[^/]+\.dist-info/METADATA", n)), None)
        if metadata is None:
            raise ValueError(f"{path.name}: no .dist-info/METADATA")
        message = email.parser.BytesParser().parsebytes(zf.read(metadata), headersonly=True)
    return Wheel(path, normalize(message["Name"]), message["Version"], tuple(message.get_all("Requires-Dist") or ()))


def wheel_tag_problem(filename: str) -> str | None:
    """Why the host (CPython 3.12, x86-64 Linux) would refuse this wheel, or None."""
    parts = filename[:-len(".whl")].split("-")
    if len(parts) < 5:
        return f"{filename}: not a wheel file name"
    pythons, abis, platforms = (set(p.split(".")) for p in parts[-3:])
    if not pythons & _PYTHON_TAGS or not abis & _ABI_TAGS:
        return f"{filename}: built for {parts[-3]}-{parts[-2]}, not CPython 3.12"
    if "any" not in platforms and not any(p.startswith("manylinux") and p.endswith("x86_64") for p in platforms):
        return f"{filename}: platform {parts[-1]}, not x86-64 manylinux"
    return None


def check(wheel_dir, pins: dict[str, str], host: dict[str, str | None], project: list[tuple[str, str]],
          budget_mib: float = BUDGET_MIB) -> tuple[list[Wheel], list[str]]:
    """(the wheels, the problems): empty problems means the wheelhouse is complete and installable."""
    problems = []
    wheels = []
    for path in sorted(Path(wheel_dir).glob("*.whl")):
        try:
            wheels.append(read_wheel(path))
        except (ValueError, zipfile.BadZipFile, KeyError) as e:
            problems.append(f"{path.name}: unreadable ({e})")
    shipped = {}
    for wheel in wheels:
        if tag := wheel_tag_problem(wheel.path.name):
            problems.append(tag)
        if wheel.name in shipped:
            problems.append(f"{wheel.name}: two wheels ({shipped[wheel.name].path.name}, {wheel.path.name})")
        shipped[wheel.name] = wheel
        if wheel.name not in pins:
            problems.append(f"{wheel.path.name}: not pinned in {PINS.name} (remove it, or pin it)")
        elif pins[wheel.name] != wheel.version:
            problems.append(f"{wheel.path.name}: version {wheel.version}, pinned {pins[wheel.name]}")
    for name in pins:
        if name not in shipped:
            problems.append(f"{name}=={pins[name]}: pinned but no wheel (run prepare)")
    needs = project + [(r, f"{w.name} {w.version}") for w in wheels for r in w.requires]
    available = {**{n: (v, "on the host") for n, v in host.items()},
                 **{n: (w.version, "shipped") for n, w in shipped.items()}}
    problems += [f"{p}: pin it in {PINS.name}" if p.endswith("missing") else p for p in unmet(needs, available)]
    total = sum(w.size for w in wheels)
    if total > budget_mib * 2**20:
        problems.append(f"wheels total {total / 2**20:.1f} MiB, over the {budget_mib:g} MiB budget")
    return wheels, problems


def unmet(needs: list[tuple[str, str]], available: dict[str, tuple[str | None, str]]) -> list[str]:
    """The requirements (those the host's environment selects) that `available` ({name: (version or None,
    where)}) does not meet: missing, or in a version outside the specifier; an unknown version meets any."""
    problems = []
    for text, who in needs:
        req = Requirement(text)
        if req.marker is not None and not req.marker.evaluate(HOST_MARKERS):
            continue
        name = normalize(req.name)
        if name not in available:
            problems.append(f"{req.name} (needed by {who}: {text}): missing")
            continue
        version, where = available[name]
        if version is not None and not req.specifier.contains(Version(version), prereleases=True):
            problems.append(f"{req.name} {version} ({where}) does not satisfy {who}'s {text}")
    return problems


def git_commit(repo=REPO) -> dict:
    """{commit, dirty, diff} of a git checkout (diff: sha256 prefix of `git diff HEAD`), or commit "unknown"."""
    def git(*args):
        return subprocess.run(["git", *args], cwd=repo, capture_output=True, text=True, check=True).stdout
    try:
        commit = git("rev-parse", "HEAD").strip()
        status = git("status", "--porcelain", "--untracked-files=no")
        diff = git("diff", "HEAD")
    except (OSError, subprocess.CalledProcessError):
        return {"commit": "unknown"}
    info = {"commit": commit, "dirty": bool(status.strip())}
    if info["dirty"]:
        info["diff"] = hashlib.sha256(diff.encode()).hexdigest()[:12]
    return info


def pip_download(specs: list[str], dest: Path) -> None:
    """pip download of exact pins for the host: CPython 3.12, x86-64 manylinux or pure Python, no dependencies."""
    platforms = [a for p in PLATFORMS for a in ("--platform", p)]
    subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary=:all:",
                    "--python-version", "3.12", "--implementation", "cp", *platforms, "-d", str(dest), *specs],
                   check=True)


def prepare(wheel_dir=WHEELHOUSE, pins_path=PINS, host_path=HOST, pyproject=REPO / "pyproject.toml",
            budget_mib: float = BUDGET_MIB, download=pip_download, print_fn=print) -> int:
    """Make the wheelhouse hold exactly the pins, check it, stamp the commit; 0 when complete, else 1."""
    wheel_dir = Path(wheel_dir)
    wheel_dir.mkdir(parents=True, exist_ok=True)
    pins = read_pins(pins_path)
    present = {}
    for path in sorted(wheel_dir.glob("*.whl")):
        try:
            wheel = read_wheel(path)
        except (ValueError, zipfile.BadZipFile, KeyError):
            wheel = None
        if wheel is None or pins.get(wheel.name) != wheel.version or wheel.name in present:
            print_fn(f"removing {path.name} (not pinned)")
            path.unlink()
        else:
            present[wheel.name] = wheel
    missing = [f"{name}=={version}" for name, version in pins.items() if name not in present]
    if missing:
        print_fn(f"downloading {' '.join(missing)}")
        download(missing, wheel_dir)
    return report(wheel_dir, pins_path, host_path, pyproject, budget_mib, print_fn, stamp=True)


def report(wheel_dir=WHEELHOUSE, pins_path=PINS, host_path=HOST, pyproject=REPO / "pyproject.toml",
           budget_mib: float = BUDGET_MIB, print_fn=print, stamp=False) -> int:
    """Print the wheels and the problems (and with stamp, write commit.json); 0 when there are none."""
    date, host = read_host(host_path)
    wheels, problems = check(wheel_dir, read_pins(pins_path), host, project_requirements(pyproject), budget_mib)
    for wheel in wheels:
        print_fn(f"  {wheel.path.name:<60}{wheel.size / 2**20:8.2f} MiB")
    total = sum(w.size for w in wheels) / 2**20
    print_fn(f"{len(wheels)} wheels, {total:.2f} MiB (budget {budget_mib:g} MiB); host packages as read {date}")
    if stamp:
        info = {**git_commit(), "written": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                "wheels": [w.path.name for w in wheels]}
        (Path(wheel_dir) / COMMIT_FILE).write_text(json.dumps(info, indent=2) + "\n")
        print_fn(f"commit {info['commit']}{' (dirty)' if info.get('dirty') else ''} -> "
                 f"{Path(wheel_dir) / COMMIT_FILE}")
    for problem in problems:
        print_fn(f"PROBLEM: {problem}")
    print_fn("complete" if not problems else f"{len(problems)} problem(s)")
    return 1 if problems else 0
