"""The CUDA packages of a GPU rank must all be built for torch's CUDA major version.

A GPU rank loads torch (``torch.version.cuda``), NVSHMEM (``nvidia-nvshmem-cuXX``, and its
Python package ``nvshmem4py-cuXX``) and cuda-python (``cuda-python``, ``cuda-bindings``, whose
major version is CUDA's) into one process. pip installs a mix of majors side by side without a
word (``nvidia-nvshmem-cu12`` and ``-cu13`` even write the same files), and a mix fails later,
deep inside NVSHMEM or the driver. ``check_cuda_packages`` reads the installed versions
(``importlib.metadata``) before NVSHMEM is first imported, and names the packages that disagree
and the pip command that fixes it.

``pip install hybrid-ep-triton`` installs none of these packages: CPU ranks need none. The extras
``[cu12]`` and ``[cu13]`` (pyproject.toml) install those of one CUDA major, to match torch's.
"""

from importlib import metadata, util

CUDA_MAJORS = (12, 13)  # of the extras [cu12] and [cu13]
NVSHMEM_PACKAGES = ("nvshmem4py-cu{}", "nvidia-nvshmem-cu{}")  # one name per CUDA major
CUDA_PYTHON_PACKAGES = ("cuda-python", "cuda-bindings")  # one name, versioned as CUDA is


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
