"""The CUDA packages of GPU ranks: the extras [cu12] and [cu13] of pyproject.toml resolve on the
package index; before NVSHMEM is first imported, their CUDA majors are checked against torch's
(the installed versions faked through importlib.metadata); NVSHMEM's device bitcode is found in
the layouts that both majors' wheels install, and a Triton too old to read it is refused."""

from __future__ import annotations

import json
import subprocess
import sys
from importlib import metadata, util
from pathlib import Path

import pytest
from packaging.requirements import Requirement

from hybrid_ep_triton.runtime.cuda_packages import (
    CUDA_MAJORS,
    CUDA_PYTHON_PACKAGES,
    NVSHMEM_PACKAGES,
    check_cuda_packages,
    check_device_bitcode,
)

PYPROJECT = Path(__file__).resolve().parents[1] / "pyproject.toml"
_REAL_VERSION = metadata.version


def _extras() -> dict[str, list[str]]:
    tomllib = pytest.importorskip("tomllib", reason="tomllib needs Python 3.11")
    return tomllib.loads(PYPROJECT.read_text())["project"]["optional-dependencies"]


def _fake_version(versions: dict[str, str]):
    """importlib.metadata.version, seeing exactly ``versions`` (name: version) of the CUDA
    packages."""

    def version(name: str) -> str:
        if name in versions:
            return versions[name]
        if name.startswith(("nvshmem4py", "nvidia-nvshmem")) or name in CUDA_PYTHON_PACKAGES:
            raise metadata.PackageNotFoundError(name)
        return _REAL_VERSION(name)

    return version


def _installed(monkeypatch, versions: dict[str, str]) -> None:
    monkeypatch.setattr(metadata, "version", _fake_version(versions))


def _of_major(major: int) -> dict[str, str]:
    """What ``pip install 'hybrid-ep-triton[cuXX]'`` installs, at the versions it resolves to."""
    cuda_python = "12.9.0" if major == 12 else "13.4.4"
    return {
        f"nvshmem4py-cu{major}": "0.4.1",
        f"nvidia-nvshmem-cu{major}": "3.8.0",
        "cuda-python": cuda_python,
        "cuda-bindings": cuda_python,
    }


@pytest.mark.parametrize("major", CUDA_MAJORS)
def test_packages_of_torchs_cuda_major_pass(monkeypatch, major):
    _installed(monkeypatch, _of_major(major))
    check_cuda_packages(f"2.11.0+cu{major}0", f"{major}.0")
    check_cuda_packages(f"2.11.0+cu{major}8", f"{major}.8")


def test_nvshmem_of_another_major_names_the_packages_and_the_fix(monkeypatch):
    nvshmem_12 = {k: v for k, v in _of_major(12).items() if k not in CUDA_PYTHON_PACKAGES}
    cuda_python_13 = {k: v for k, v in _of_major(13).items() if k in CUDA_PYTHON_PACKAGES}
    _installed(monkeypatch, {**nvshmem_12, **cuda_python_13})
    with pytest.raises(ImportError) as error:
        check_cuda_packages("2.11.0+cu130", "13.0")
    message = str(error.value)
    assert "torch 2.11.0+cu130 is built for CUDA 13.0" in message, message
    assert "  nvshmem4py-cu12 0.4.1: CUDA 12  <- not torch's" in message, message
    assert "  nvidia-nvshmem-cu12 3.8.0: CUDA 12  <- not torch's" in message, message
    assert "  cuda-python 13.4.4: CUDA 13\n" in message, message
    fix = (
        "pip uninstall -y nvshmem4py-cu12 nvidia-nvshmem-cu12"
        " && pip install 'hybrid-ep-triton[cu13]'"
    )
    assert message.endswith(f"\n  {fix}"), message


def test_extra_of_the_other_major_beside_torchs_nvshmem_is_replaced(monkeypatch):
    # torch's CUDA 12 wheels pin nvidia-nvshmem-cu12; [cu13] installed beside them wrote its
    # NVSHMEM over the same files.
    _installed(monkeypatch, {**_of_major(13), "nvidia-nvshmem-cu12": "3.4.5"})
    with pytest.raises(ImportError) as error:
        check_cuda_packages("2.11.0+cu128", "12.8")
    fix = (
        "pip uninstall -y nvshmem4py-cu13 nvidia-nvshmem-cu13 cuda-python cuda-bindings"
        " && pip install --force-reinstall --no-deps 'nvidia-nvshmem-cu12==3.4.5'"
        " && pip install 'hybrid-ep-triton[cu12]'"
    )
    assert str(error.value).endswith(f"\n  {fix}"), str(error.value)
    assert "  nvidia-nvshmem-cu12 3.4.5: CUDA 12\n" in str(error.value)


def test_without_an_extra_both_extras_are_named(monkeypatch):
    _installed(monkeypatch, {})
    real_find_spec = util.find_spec
    monkeypatch.setattr(
        util, "find_spec", lambda name: None if name == "nvshmem" else real_find_spec(name)
    )
    with pytest.raises(ImportError) as error:
        check_cuda_packages("2.11.0+cu130", "13.0")
    message = str(error.value)
    assert "pip install 'hybrid-ep-triton[cu13]'" in message, message
    assert "[cu12] for CUDA 12, [cu13] for CUDA 13" in message, message


@pytest.mark.parametrize("torch_cuda", [None, "11.8"])
def test_torch_without_a_supported_cuda_is_refused(monkeypatch, torch_cuda):
    _installed(monkeypatch, _of_major(13))
    with pytest.raises(
        ImportError, match="CUDA build of torch" if torch_cuda is None else "runs on CUDA 12 or 13"
    ):
        check_cuda_packages("2.11.0", torch_cuda)


def _first_nvshmem_init_body(rank: int, world_size: int) -> list[str]:
    """On a CPU rank: ensure_initialized with torch said to be built for CUDA 12.8, first with
    NVSHMEM of CUDA 13 installed, then of CUDA 12; what each raised, and whether nvshmem was
    imported."""
    import torch

    from hybrid_ep_triton.runtime import nvshmem

    torch.version.cuda = "12.8"
    outcomes = []
    for major in (13, 12):
        metadata.version = _fake_version(_of_major(major))
        try:
            nvshmem.ensure_initialized(None, torch.device("cuda", 0))
        except Exception as e:  # the CPU build of torch then fails to set a CUDA device
            outcomes.append(f"{type(e).__name__}: {e}")
    outcomes.append(f"nvshmem imported: {'nvshmem' in sys.modules}")
    return outcomes


def test_first_nvshmem_init_checks_the_packages_before_importing_nvshmem(launch, device):
    if device == "cuda":
        pytest.skip("fakes torch's CUDA version: CPU ranks only")
    (mismatch, match, imported) = launch(_first_nvshmem_init_body, 1)[0]
    assert mismatch.startswith("ImportError: hybrid_ep_triton: torch"), mismatch
    assert "nvshmem4py-cu13 0.4.1: CUDA 13  <- not torch's" in mismatch, mismatch
    assert not match.startswith("ImportError"), match  # past the check, into torch.cuda
    assert imported == "nvshmem imported: False"


def test_extras_install_the_packages_checked():
    extras = _extras()
    for major in CUDA_MAJORS:
        requirements = [Requirement(r) for r in extras[f"cu{major}"]]
        names = {r.name for r in requirements}
        assert names == {p.format(major) for p in NVSHMEM_PACKAGES} | {"cuda-python"}, names
        (cuda_python,) = (r for r in requirements if r.name == "cuda-python")
        assert cuda_python.specifier.contains(f"{major}.9.0"), cuda_python
        assert not any(cuda_python.specifier.contains(f"{m}.0.0") for m in (major - 1, major + 1))


def _pip(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "pip", *args, "--retries", "1", "--timeout", "30"],
        capture_output=True,
        text=True,
        timeout=600,
    )


@pytest.mark.slow
@pytest.mark.skipif(sys.platform != "linux", reason="NVSHMEM's wheels are for Linux")
@pytest.mark.parametrize("major", CUDA_MAJORS)
def test_extra_resolves_on_the_package_index(tmp_path, major):
    # The extra's own requirements and theirs (no torch: it is not among them); pip downloads
    # the wheels to read their metadata where the index does not serve it apart.
    probe = _pip("index", "versions", "cuda-python")
    if probe.returncode:
        pytest.skip(f"pip reaches no package index: {probe.stderr.strip().splitlines()[-1]}")
    report = tmp_path / "report.json"
    requirements = _extras()[f"cu{major}"]
    r = _pip(
        "install",
        "--dry-run",
        "--ignore-installed",
        "--quiet",
        "--report",
        str(report),
        *requirements,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    resolved = {
        item["metadata"]["name"].lower(): item["metadata"]["version"]
        for item in json.loads(report.read_text())["install"]
    }
    for pattern in NVSHMEM_PACKAGES:
        assert pattern.format(major) in resolved, resolved
    for name in CUDA_PYTHON_PACKAGES:
        assert resolved[name].split(".")[0] == str(major), resolved
    assert "torch" not in resolved, resolved


@pytest.mark.parametrize(
    "files, found",
    [
        # NVSHMEM 3.5 and later, both nvidia-nvshmem-cu12 and -cu13 (3.8.0's wheels): one file
        # per architecture.
        (
            [f"libnvshmem_device_sm_{a}.bc" for a in (75, 80, 89, 90, 100)],
            "libnvshmem_device_sm_90.bc",
        ),
        (["libnvshmem_device.bc"], "libnvshmem_device.bc"),  # NVSHMEM 3.4: one for all
    ],
)
def test_device_bitcode_is_found_in_the_wheels_layout(tmp_path, monkeypatch, files, found):
    init_fini = pytest.importorskip("nvshmem.core.init_fini", reason="needs nvshmem4py")
    from hybrid_ep_triton.runtime.nvshmem_bitcode import bitcode_file

    # The layout under site-packages of either major's wheel: nvidia/nvshmem/{include,lib}.
    root = tmp_path / "nvidia" / "nvshmem"
    (root / "include").mkdir(parents=True)
    (root / "include" / "nvshmem.h").touch()
    (root / "lib").mkdir()
    for name in files:
        (root / "lib" / name).touch()
    monkeypatch.setattr(init_fini, "find_nvidia_header_directory", lambda _: str(root / "include"))
    assert bitcode_file(arch="90") == str(root / "lib" / found)


@pytest.mark.parametrize("major", CUDA_MAJORS)
@pytest.mark.parametrize(
    "triton, nvshmem, readable",
    [
        ("3.6.0", "3.8.0", False),
        ("3.6.0", "3.7.2", True),
        ("3.6.0", "3.4.5", True),
        ("3.7.1", "3.8.0", True),
        ("3.9.0", "3.8.0", True),
        ("3.6.1+git1a2b3c", "3.10.1", False),
    ],
)
def test_a_triton_too_old_for_nvshmems_bitcode_is_refused(
    monkeypatch, major, triton, nvshmem, readable
):
    name = f"nvidia-nvshmem-cu{major}"
    _installed(monkeypatch, dict(_of_major(major), **{name: nvshmem}))
    if readable:
        check_device_bitcode(triton)
        return
    with pytest.raises(ImportError) as info:
        check_device_bitcode(triton)
    message = str(info.value)
    for part in (f"Triton {triton}", f"{name} {nvshmem}", f"pip install '{name}<3.8'", "3.7"):
        assert part in message, message
