"""The CUDA packages of a GPU rank must all be built for torch's CUDA major version.

A GPU rank loads torch (``torch.version.cuda``), NVSHMEM (``nvidia-nvshmem-cuXX``, and its
Python package ``nvshmem4py-cuXX``) and cuda-python (``cuda-python``, ``cuda-bindings``, whose
major version is CUDA's) into one process. pip installs a mix of majors side by side without a
word (``nvidia-nvshmem-cu12`` and ``-cu13`` even write the same files), and a mix fails later,
deep inside NVSHMEM or the driver. ``check_cuda_packages`` reads the installed versions
(``importlib.metadata``) before NVSHMEM is first imported, and names the packages that disagree
and the pip command that fixes it. ``check_device_bitcode`` likewise names a Triton whose LLVM
cannot read the installed NVSHMEM's device bitcode, which the kernels across nodes link.

``pip install hybrid-ep-triton`` installs none of these packages: CPU ranks need none. The extras
``[cu12]`` and ``[cu13]`` (pyproject.toml) install those of one CUDA major, to match torch's.
"""

import re
from importlib import metadata, util

CUDA_MAJORS = (12, 13)  # of the extras [cu12] and [cu13]
NVSHMEM_PACKAGES = ("nvshmem4py-cu{}", "nvidia-nvshmem-cu{}")  # one name per CUDA major
CUDA_PYTHON_PACKAGES = ("cuda-python", "cuda-bindings")  # one name, versioned as CUDA is
# (NVSHMEM version, the oldest Triton that reads its device bitcode): each release of NVSHMEM
# writes its bitcode with a newer LLVM (3.4.5: LLVM 18.1.1, 3.5.21: 18.1.8, 3.6.5 and 3.7.2:
# 21.1.0, 3.8.0: 22.1.8), which an older LLVM cannot read. The kernels across nodes compile
# for sm_90 with Triton 3.6.0, 3.7.1, 3.8.0 and 3.9.0 against each, except Triton 3.6.0 with
# NVSHMEM 3.8.0, which fails at the first launch ("Failed to parse library").
BITCODE_NEEDS_TRITON = (((3, 8), (3, 7)),)


def _installed_version(name: str) -> str | None:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def installed_cuda_packages() -> dict[str, tuple[str, int]]:
    """name: (version, CUDA major) of each package above that is installed."""
    found = {}
    for major in CUDA_MAJORS:
        for pattern in NVSHMEM_PACKAGES:
            name = pattern.format(major)
            if version := _installed_version(name):
                found[name] = (version, major)
    for name in CUDA_PYTHON_PACKAGES:
        if version := _installed_version(name):
            found[name] = (version, int(version.split(".")[0]))
    return found


def check_cuda_packages(torch_version: str, torch_cuda: str | None) -> None:
    """ImportError, saying what to install or uninstall, unless NVSHMEM's Python package is
    there and every package above that is installed is for torch's CUDA major.

    ``torch_version``, ``torch_cuda``: ``torch.__version__`` and ``torch.version.cuda``.
    """
    if torch_cuda is None:
        raise ImportError(
            f"hybrid_ep_triton needs a CUDA build of torch on GPUs; torch {torch_version} has "
            "none (torch.version.cuda is None)"
        )
    want = int(torch_cuda.split(".")[0])
    torch_is = f"torch {torch_version} is built for CUDA {torch_cuda}"
    if want not in CUDA_MAJORS:
        raise ImportError(
            f"hybrid_ep_triton runs on CUDA {' or '.join(map(str, CUDA_MAJORS))}, but {torch_is}: "
            "install a torch built for one of them"
        )
    extra = f"pip install 'hybrid-ep-triton[cu{want}]'"
    found = installed_cuda_packages()
    # A build of nvshmem4py that pip did not install under a wheel's name says no CUDA major:
    # it is taken as it is.
    has_nvshmem4py = any(name.startswith("nvshmem4py-") for name in found)
    if not has_nvshmem4py and util.find_spec("nvshmem") is None:
        raise ImportError(
            "hybrid_ep_triton needs NVSHMEM on GPUs, which `pip install hybrid-ep-triton` leaves "
            f"out: install the extra of torch's CUDA major ({torch_is}): {extra} (from a clone: "
            f"pip install -e '.[cu{want}]'). The extras: "
            + ", ".join(f"[cu{major}] for CUDA {major}" for major in CUDA_MAJORS)
            + "."
        )
    wrong = [name for name, (_, major) in found.items() if major != want]
    if not wrong:
        return
    # Packages of NVSHMEM of two majors install the same files: once the other major's is
    # uninstalled, the one of torch's major needs its files written again.
    overwritten = []
    for name in wrong:
        for pattern in NVSHMEM_PACKAGES:
            twin = pattern.format(want)
            if name == pattern.format(found[name][1]) and twin in found:
                overwritten.append(f"'{twin}=={found[twin][0]}'")
    steps = [f"pip uninstall -y {' '.join(wrong)}"]
    if overwritten:
        steps.append(f"pip install --force-reinstall --no-deps {' '.join(overwritten)}")
    steps.append(extra)
    listed = "\n".join(
        f"  {name} {version}: CUDA {major}" + ("" if major == want else "  <- not torch's")
        for name, (version, major) in found.items()
    )
    raise ImportError(
        f"hybrid_ep_triton: {torch_is}, but not every CUDA package installed is for CUDA "
        f"{want}; they load into one process, so they must agree:\n{listed}\n"
        f"Fix (the packages of torch's CUDA major stay):\n  {' && '.join(steps)}"
    )


def _major_minor(version: str) -> tuple[int, int]:
    major, minor = re.match(r"(\d+)\.(\d+)", version).groups()
    return int(major), int(minor)


def check_device_bitcode(triton_version: str) -> None:
    """ImportError, saying what to install, where Triton ``triton_version`` cannot read the
    device bitcode of the NVSHMEM installed (``nvidia-nvshmem-cuXX``), which the kernels across
    nodes link (``BITCODE_NEEDS_TRITON``)."""
    triton = _major_minor(triton_version)
    for name, (version, _) in installed_cuda_packages().items():
        if not name.startswith("nvidia-nvshmem-"):
            continue
        nvshmem = _major_minor(version)
        for first_nvshmem, needs_triton in BITCODE_NEEDS_TRITON:
            if nvshmem >= first_nvshmem and triton < needs_triton:
                below = ".".join(map(str, first_nvshmem))
                raise ImportError(
                    f"Triton {triton_version} cannot read the device bitcode of {name} "
                    f"{version} (written by a newer LLVM than Triton's), which the kernels "
                    f"across nodes link: pip install '{name}<{below}' (torch 2.11's CUDA "
                    f"wheels pin 3.4.5), or a Triton from {'.'.join(map(str, needs_triton))} on"
                )
