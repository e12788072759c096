"""vLLM's own weight-transfer contract tests pass with weight_sync's backends registered.

``tests/distributed/test_weight_transfer.py`` of the installed vLLM's sdist (PyPI) runs in a subprocess
whose conftest registers weight_sync's worker and trainer engines first; the same tests must pass (those
needing a GPU skip themselves) as they do without weight_sync. The sdist is fetched with pip once and
cached under the virtual environment (``<venv>/vllm-sdist``); where it cannot be fetched the test skips
saying why.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

vllm = pytest.importorskip("vllm")
pytest.importorskip("ray")  # the upstream module imports it
pytestmark = [pytest.mark.vllm, pytest.mark.slow]

VERSION = vllm.__version__.split("+")[0]
CACHE = Path(sys.prefix) / "vllm-sdist"
MEMBER = f"vllm-{VERSION}/tests/distributed/test_weight_transfer.py"

CONFTEST = '''
from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory, WeightTransferTrainerFactory

from weight_sync.integrations.vllm.plugin import register

register()
assert "weight_sync" in WeightTransferEngineFactory._registry
assert "weight_sync" in WeightTransferTrainerFactory._registry
'''


def _pip(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pip", *args], capture_output=True, text=True, timeout=900,
                          env=env)


def fetch_contract_tests() -> Path:
    """The upstream test module, from the cached sdist (fetched with pip on first use)."""
    tarball = CACHE / f"vllm-{VERSION}.tar.gz"
    if not tarball.exists():
        # pip prepares an sdist's metadata before it saves it; vLLM's setup needs setuptools-rust and
        # setuptools-scm, and with no device targeted it would append '+empty' to the version that the
        # pin then rejects, hence the override. Nothing is built or installed into the environment.
        tools = CACHE / "build-tools"
        got = _pip("install", "-q", "--target", str(tools), "setuptools-rust", "setuptools-scm")
        if got.returncode != 0:
            pytest.skip(f"cannot install the tools to fetch vLLM {VERSION}'s sdist: {got.stderr[-500:]}")
        env = {**os.environ, "PYTHONPATH": str(tools), "VLLM_TARGET_DEVICE": "empty",
               "VLLM_VERSION_OVERRIDE": VERSION}
        got = _pip("download", "-q", "--no-deps", "--no-binary", ":all:", "--no-build-isolation",
                   f"vllm=={VERSION}", "-d", str(CACHE), env=env)
        if got.returncode != 0 or not tarball.exists():
            pytest.skip(f"vLLM {VERSION}'s sdist could not be fetched from PyPI with pip: {got.stderr[-500:]}")
    out = CACHE / f"contract-{VERSION}"
    target = out / "test_weight_transfer.py"
    if not target.exists():
        out.mkdir(parents=True, exist_ok=True)
        with tarfile.open(tarball) as tar:
            member = tar.getmember(MEMBER)
            source = tar.extractfile(member)
            assert source is not None, f"{tarball}: {MEMBER} is not a regular file"
            target.write_bytes(source.read())
    return target


def _run(module: Path, directory: Path, with_weight_sync: bool) -> tuple[int, dict[str, int], str]:
    directory.mkdir()
    (directory / module.name).write_bytes(module.read_bytes())
    if with_weight_sync:
        (directory / "conftest.py").write_text(CONFTEST)
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0",
           "PYTHONPATH": os.pathsep.join([str(Path(__file__).parents[3]), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--rootdir",
                           str(directory), module.name], cwd=directory, env=env, capture_output=True, text=True,
                          timeout=900)
    counts = {kind: int(n) for n, kind in re.findall(r"(\d+) (passed|failed|skipped|errors?)", proc.stdout)}
    return proc.returncode, counts, proc.stdout[-3000:]


def test_vllms_weight_transfer_contract_tests_pass_with_weight_sync_registered(tmp_path) -> None:
    module = fetch_contract_tests()
    rc, counts, out = _run(module, tmp_path / "with_weight_sync", with_weight_sync=True)
    assert rc == 0, out
    assert counts.get("passed", 0) > 0 and not counts.get("failed") and not counts.get("error"), out
    base_rc, base, base_out = _run(module, tmp_path / "plain", with_weight_sync=False)
    assert base_rc == 0, base_out
    assert counts == base, f"with weight_sync: {counts}; plain vLLM: {base}"
