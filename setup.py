"""Build hook (the project's metadata is in pyproject.toml): a wheel carries the repository's released adapters,
``releases/<name>/``, as package data in ``unimae/_releases/``, so that a release name resolves after ``pip install``
as it does in a checkout (:func:`unimae.release.release_roots`). An editable install reads ``releases/`` itself."""

import shutil
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

RELEASES = Path(__file__).resolve().parent / "releases"


class BuildWithReleases(build_py):
    """``build_py`` plus a copy of every release folder (one with ``unimae.json``) into ``unimae/_releases``."""

    def run(self):
        super().run()
        if self.editable_mode or not RELEASES.is_dir():
            return
        target = Path(self.build_lib) / "unimae" / "_releases"
        for folder in sorted(p for p in RELEASES.iterdir() if (p / "unimae.json").is_file()):
            shutil.copytree(folder, target / folder.name, dirs_exist_ok=True)


setup(cmdclass={"build_py": BuildWithReleases})
