"""Developer tasks (arguments after `--` go to the command, e.g. `nox -s quick -- -k cli`):

- `nox -s lint tests oldest_triton`: what `.ci/run` runs, one after another (the sessions below).
- `nox -s lint`: ruff (check, format --check), then the import contracts of pyproject.toml
  (`lint-imports`: the rooms of docs/architecture.md and the way imports go between them).
- `nox -s tests`: the whole test suite on CPU ranks (Triton interpreter), 8 to 17 minutes on 2
  cores, by the machine (docs/testing.md); it names each test as it runs, lists the skipped
  ones with their reasons at the end, then the 15 slowest.
- `nox -s quick`: the tests not marked slow (`pytest -m "not slow"`), in about 3 minutes.
- `nox -s oldest_triton`: every kernel under the oldest Triton supported (3.6) with the NumPy
  that pip resolves, the kernels' tests not marked slow: 4 minutes with the installs, fresh.
- `nox -s bench`: the benchmark (GPUs). `nox -s demo`: one MoE layer on CPU ranks.
"""

from pathlib import Path

import nox

nox.options.default_venv_backend = "venv"
nox.options.reuse_venv = "yes"  # installs still run each time, so venvs stay up to date
nox.options.sessions = ["lint", "tests"]

CPU_TORCH = "torch==2.13.0"  # installed first so that the CPU wheel is the one used
# tests/test_megatron.py runs on the real package. Its wheels declare Requires-Python >= 3.12,
# but a cp311 wheel is published and its core needs only torch, numpy and packaging, which run
# here on 3.11: --ignore-requires-python for that, --no-deps so that pip leaves the CPU torch
# alone (it would otherwise resolve torch again and may fetch the CUDA wheels).
MEGATRON = "megatron-core==0.19.2"
# tests/test_block_scaled.py checks the MXFP8 / NVFP4 reference against torchao's own quantizers
# (its prototype API: an exact version). --no-deps: torchao needs nothing else to import, and pip
# must leave the CPU torch alone.
TORCHAO = "torchao==0.18.0"
LINT_PATHS = ["src", "tests", "bench", "examples", "noxfile.py"]
# The private_modules contract type of pyproject.toml came with import-linter 2.17.
IMPORT_LINTER = "import-linter>=2.17"


# Each test's name as it runs (-v), why tests were skipped (-ra), the slowest 15.
PYTEST_REPORT = ["-v", "-ra", "--durations=15"]


def _install_for_tests(session: nox.Session) -> None:
    session.install(CPU_TORCH)
    # [cu13] too, for NVSHMEM's device bitcode: the kernels of the path across nodes are
    # compiled for sm_90 with it linked (tests/test_sm90_compile.py). No CUDA torch comes with it.
    session.install("-e", ".[test,cu13,bench]")
    session.install("--no-deps", "--ignore-requires-python", MEGATRON, "packaging>=24.2")
    session.install("--no-deps", TORCHAO)


@nox.session
def tests(session: nox.Session) -> None:
    """Run the whole test suite with CPU ranks under the Triton interpreter."""
    _install_for_tests(session)
    session.run("pytest", *PYTEST_REPORT, *session.posargs, env={"TRITON_INTERPRET": "1"})


@nox.session
def quick(session: nox.Session) -> None:
    """Run the tests not marked slow, as `tests` does."""
    _install_for_tests(session)
    session.run(
        "pytest", "-m", "not slow", *PYTEST_REPORT, *session.posargs, env={"TRITON_INTERPRET": "1"}
    )


# The oldest Triton this project supports: with NumPy 2.4 and later its interpreter needs what
# runtime/triton_compat.py gives it.
OLDEST_TRITON = "triton==3.6.0"
KERNEL_TESTS = [
    "tests/test_primitives.py", "tests/test_dispatch_combine.py", "tests/test_fp8.py",
    "tests/test_sm90_compile.py::test_low_latency_kernels_compile_for_sm90",
    "tests/test_experts.py",
]  # fmt: skip


@nox.session
def oldest_triton(session: nox.Session) -> None:
    """Run the kernels' tests not marked slow on CPU ranks under Triton 3.6."""
    _install_for_tests(session)
    session.install("--no-deps", OLDEST_TRITON)
    session.run(
        "pytest", "-m", "not slow", *PYTEST_REPORT, *(session.posargs or KERNEL_TESTS),
        env={"TRITON_INTERPRET": "1"},
    )  # fmt: skip


@nox.session
def lint(session: nox.Session) -> None:
    """ruff check, ruff format --check, then the import contracts of pyproject.toml."""
    session.install("ruff", IMPORT_LINTER)
    paths = [p for p in LINT_PATHS if Path(p).exists()]
    session.run("ruff", "check", *paths)
    session.run("ruff", "format", "--check", *paths)
    # import-linter reads the source and imports nothing of it: src/ on the path is enough, so
    # this session installs neither the package nor torch.
    session.run("lint-imports", env={"PYTHONPATH": "src"})


@nox.session
def bench(session: nox.Session) -> None:
    """Benchmark on GPUs: torch from PyPI (a CUDA build), then the extra of its CUDA major."""
    session.install("-e", ".[bench]")
    cuda = session.run("python", "-c", "import torch; print(torch.version.cuda)", silent=True)
    if cuda.strip() == "None":
        session.error("the benchmark needs a CUDA build of torch")
    session.install("-e", f".[bench,cu{cuda.split('.')[0].strip()}]")
    session.run("python", "-m", "hybrid_ep_triton", "bench", *session.posargs)


@nox.session
def demo(session: nox.Session) -> None:
    """Run the demo."""
    session.install(CPU_TORCH)
    session.install("-e", ".")
    session.run("hybrid-ep", "demo", *session.posargs)
