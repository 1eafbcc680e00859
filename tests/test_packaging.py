"""The wheel: it carries the repository's released adapters, and a release name resolves in a wheel install."""

import hashlib
import json
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
RELEASES = sorted(p.name for p in (ROOT / "releases").iterdir() if (p / "unimae.json").is_file())


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """A wheel built from a copy of the project's sources (so the build leaves nothing in the checkout)."""
    src = tmp_path_factory.mktemp("project")
    for name in ("pyproject.toml", "setup.py", "MANIFEST.in", "README.md"):
        shutil.copy(ROOT / name, src / name)
    for name in ("src", "releases"):
        shutil.copytree(ROOT / name, src / name, ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    out = tmp_path_factory.mktemp("wheel")
    cmd = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", str(src), "-w", str(out)]
    subprocess.run(cmd, check=True, capture_output=True, text=True)
    (found,) = out.glob("unimae-*.whl")
    return found


def test_the_wheel_carries_every_release_byte_for_byte(wheel):
    assert RELEASES, "the repository has releases to carry"
    with zipfile.ZipFile(wheel) as zf:
        names = set(zf.namelist())
        for release in RELEASES:
            for file in sorted((ROOT / "releases" / release).iterdir()):
                packed = f"unimae/_releases/{release}/{file.name}"
                assert packed in names, packed
                assert _sha(zf.read(packed)) == _sha(file.read_bytes()), packed


def test_a_release_name_resolves_in_a_wheel_install(wheel, tmp_path):
    target = tmp_path / "site"
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(target), str(wheel)],
        check=True, capture_output=True, text=True,
    )  # fmt: skip
    code = (
        "import json, unimae.release as r; "
        f"print(json.dumps([r.available_releases(), r.resolve_adapter({RELEASES[0]!r}), r.__file__]))"
    )
    env = {"PYTHONPATH": str(target), "PATH": "/usr/bin:/bin"}
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True, env=env)
    names, folder, module = json.loads(out.stdout)
    assert Path(module).is_relative_to(target), "the installed copy, not the checkout, was imported"
    assert names == RELEASES
    assert Path(folder) == target / "unimae" / "_releases" / RELEASES[0]
