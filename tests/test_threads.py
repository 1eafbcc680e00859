"""unimae.runtime.threads: the OpenMP wait policy set before torch loads, never over the user's choice."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from unimae.runtime.threads import DEFAULT_SPIN, default_spin


def _spin_in_fresh_process(env: dict[str, str]) -> str:
    code = "import os, unimae, torch; print(os.environ.get('GOMP_SPINCOUNT', '-'))"
    clean = {k: v for k, v in os.environ.items() if k not in ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY")}
    out = subprocess.run([sys.executable, "-c", code], env={**clean, **env}, capture_output=True, text=True, check=True)
    return out.stdout.strip()


def test_import_unimae_sets_the_spin_count_before_torch():
    assert _spin_in_fresh_process({}) == DEFAULT_SPIN


@pytest.mark.parametrize("env", [{"GOMP_SPINCOUNT": "123"}, {"OMP_WAIT_POLICY": "passive"}])
def test_the_users_wait_policy_is_kept(env):
    assert _spin_in_fresh_process(env) == env.get("GOMP_SPINCOUNT", "-")


def test_nothing_is_set_once_torch_is_loaded(monkeypatch):
    monkeypatch.delenv("GOMP_SPINCOUNT", raising=False)
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    assert "torch" in sys.modules  # the test session has loaded it: libgomp has read its environment already
    assert default_spin() is False and "GOMP_SPINCOUNT" not in os.environ
