"""The library's own tensors never take torch's default device or dtype: programs set them
(DeepEP's test programs run under ``torch.set_default_device("cuda")`` and
``torch.set_default_dtype(torch.bfloat16)``, where a pinned host tensor made without
``device="cpu"`` fails and float32 scratch made without a dtype becomes bf16). Checked on the
source, since a CPU machine cannot make cuda the default device: every torch factory call in
the layers that run in a user's process names its device, and its dtype where the default
dtype would choose it."""

import ast
from pathlib import Path

import hybrid_ep_triton

_PACKAGE = Path(hybrid_ep_triton.__file__).parent
# The layers a user's call runs through (kernels/ makes no tensors; tools/ and moe.py make
# their own inputs; reference.py is the tests' plain-torch model).
_LAYERS = ["runtime", "ops", "deep_ep", "buffer.py", "megatron.py", "__init__.py"]
_FACTORIES = {
    "zeros",
    "empty",
    "ones",
    "full",
    "tensor",
    "as_tensor",
    "arange",
    "rand",
    "randn",
    "randint",
    "randperm",
    "eye",
    "linspace",
    "empty_strided",
}
# Factories whose dtype is the default float dtype unless given (arange and randint, randperm
# of integers are int64 whatever the default).
_FLOAT_DEFAULT = {"zeros", "empty", "ones", "rand", "randn", "eye", "linspace", "empty_strided"}


def _factory_calls():
    for layer in _LAYERS:
        top = _PACKAGE / layer
        files = [top] if top.suffix == ".py" else sorted(top.rglob("*.py"))
        yield from (call for path in files for call in _calls_in(path))


def _calls_in(path: Path):
    """(where, keyword names, function) of each torch factory call in ``path``."""
    for node in ast.walk(ast.parse(path.read_text())):
        func = getattr(node, "func", None)
        if (
            isinstance(node, ast.Call)
            and isinstance(func, ast.Attribute)
            and isinstance(func.value, ast.Name)
            and func.value.id == "torch"
            and func.attr in _FACTORIES
        ):
            named = {k.arg for k in node.keywords}
            yield f"{path.relative_to(_PACKAGE)}:{node.lineno} torch.{func.attr}", named, func


def test_layers_name_the_device_and_dtype_of_every_tensor_they_make():
    calls = list(_factory_calls())
    assert len(calls) > 10  # the scan sees the layers' calls
    no_device = [where for where, named, _ in calls if not named & {"device", None}]
    no_dtype = [
        where
        for where, named, func in calls
        if func.attr in _FLOAT_DEFAULT and not named & {"dtype", None}
    ]
    assert not no_device, f"factory calls on torch's default device: {no_device}"
    assert not no_dtype, f"factory calls of torch's default dtype: {no_dtype}"
