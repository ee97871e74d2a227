"""tools/prebuild: the kernel builds a run records (HEP_RECORD_BUILDS) are compiled ahead into
Triton's cache, where a later run finds them; checked without a GPU, compiling for sm_90."""

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from hybrid_ep_triton.tools import cli
from hybrid_ep_triton.tools import prebuild as prebuild_module
from hybrid_ep_triton.tools.prebuild import distinct_builds, prebuild, read_records

# Run without the interpreter, which compiles nothing. "record HIDDEN...": compile, without
# launching, the launches of quantize_fp8's kernel for 16 tokens of each hidden size;
# "prebuild RECORDS": tools.prebuild of RECORDS (JSON lines) with 2 workers.
_SCRIPT = """
import json, sys
import torch
import hybrid_ep_triton.ops.launch  # records builds (HEP_RECORD_BUILDS), as in every run
from hybrid_ep_triton.tools.prebuild import compile_only_for
compile_only_for(90)
from hybrid_ep_triton.kernels.quantize import quantize_fp8_kernel
from hybrid_ep_triton.tools import prebuild as prebuild_module
from hybrid_ep_triton.tools.prebuild import distinct_builds, prebuild, read_records

if __name__ != "__main__":  # a prebuild worker
    pass
elif sys.argv[1] == "record":
    for hidden in map(int, sys.argv[2:]):
        x = torch.zeros(16, hidden, dtype=torch.bfloat16)
        values = torch.empty(16, hidden, dtype=torch.uint8)
        scales = torch.empty(16, hidden // 128, dtype=torch.float32)
        quantize_fp8_kernel.warmup(x, x.stride(0), values, scales, 16, hidden, BLOCK_T=16,
                                   GROUPS=8, grid=(1,))
else:
    print(json.dumps(prebuild(read_records(sys.argv[2:]), 2, arch=90)._asdict()))
"""


def _run(tmp_path: Path, cache: str, *args: str, record_into: Path | None = None) -> str:
    unset = ("TRITON_INTERPRET", "HEP_RECORD_BUILDS")
    env = {k: v for k, v in os.environ.items() if k not in unset}
    env["TRITON_CACHE_DIR"] = str(tmp_path / cache)
    if record_into is not None:
        env["HEP_RECORD_BUILDS"] = str(record_into)
    script = tmp_path / "builds.py"
    script.write_text(_SCRIPT)
    result = subprocess.run(
        [sys.executable, str(script), *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout


def _files(directory: Path) -> list[Path]:
    return sorted(f for f in directory.rglob("*") if f.is_file())


def test_recorded_builds_are_compiled_ahead_and_found(tmp_path):
    records = tmp_path / "records"
    # 1024 and 7168 columns are one specialisation (multiples of 16), 1152 + 8 another.
    _run(tmp_path, "first", "record", "1024", "7168", "1160", record_into=records)
    (written,) = records.glob("builds-*.jsonl")
    lines = written.read_text().splitlines()
    assert len(lines) == 2 and len(read_records([records, written])) == 2
    assert {json.loads(line)["name"] for line in lines} == {
        "hybrid_ep_triton.kernels.quantize.quantize_fp8_kernel"
    }
    # A record of the kernel as it was before a parameter went: skipped, and said why.
    old = json.loads(lines[0])
    old["signature"] = {"gone_ptr": "*fp32", **old["signature"]}
    stale = tmp_path / "stale.jsonl"
    elsewhere = dict(old, name="subprocess.run")  # refused before anything imports it
    stale.write_text(json.dumps(old) + "\n" + json.dumps(elsewhere) + "\n")

    report = json.loads(_run(tmp_path, "ahead", "prebuild", str(records), str(stale)))
    assert report["built"] == 2 and len(report["stale"]) == 1, report
    assert report["refused"] == ["subprocess.run: not a kernel of hybrid_ep_triton.kernels"]
    assert report["stale"][0].startswith("hybrid_ep_triton.kernels.quantize.quantize_fp8_kernel")
    built = _files(tmp_path / "ahead")
    assert [f for f in built if f.suffix == ".cubin"], built
    # A run of the same launches compiles nothing: every build is in the cache already.
    _run(tmp_path, "ahead", "record", "7168", "1160")
    assert _files(tmp_path / "ahead") == built


def test_prebuild_refuses_the_interpreter_and_no_records(tmp_path, capsys):
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("the suite runs under the interpreter")
    with pytest.raises(ValueError, match="TRITON_INTERPRET"):
        prebuild(["{}"], 1)
    assert cli.main(["prebuild", str(tmp_path)]) == 2
    assert "no records in" in capsys.readouterr().err
    (tmp_path / "one.jsonl").write_text("{}\n")
    assert cli.main(["prebuild", "--arch", "sm_90", str(tmp_path / "one.jsonl")]) == 2
    assert "TRITON_INTERPRET" in capsys.readouterr().err


def test_records_merge_into_one_compressed_file(tmp_path, capsys):
    """`hybrid-ep prebuild --merge-into`: the distinct records of files and directories at
    any depth (a run's processes each write their own), compressed where the name says so."""
    ranks = tmp_path / "builds" / "soak"
    ranks.mkdir(parents=True)
    (ranks / "builds-1.jsonl").write_text('{"name": "a"}\n{"name": "b"}\n')
    (ranks / "builds-2.jsonl").write_text('{"name": "b"}\n\n{"name": "c"}\n')
    earlier = tmp_path / "earlier.jsonl"
    earlier.write_text('{"name": "c"}\n{"name": "d"}\n')
    merged = tmp_path / "soak.jsonl.xz"
    assert (
        cli.main(["prebuild", str(earlier), str(tmp_path / "builds"), "--merge-into", str(merged)])
        == 0
    )
    assert read_records([merged]) == [
        '{"name": "c"}',
        '{"name": "d"}',
        '{"name": "a"}',
        '{"name": "b"}',
    ]
    assert merged.read_bytes()[:6] == b"\xfd7zXZ\x00"
    assert cli.main(["prebuild", str(tmp_path / "nothing")]) == 2
    assert "no such file or directory" in capsys.readouterr().err


def _record(rank_class: str, hidden_class: str = "16") -> str:
    """A record of kernel ``k(x_ptr, rank, hidden)`` as Triton serialises it: ``rank`` of the
    class of 0 ("16", a multiple of 16), of 1 ("1", a constant) or of any other rank ("")."""
    classes = {"16": [["tt.divisibility", 16]], "": []}
    signature = {"x_ptr": "*bf16", "rank": "i32", "hidden": "i32"}
    constant_keys, constant_vals, attrs = [], [], [[[0], classes["16"]]]
    for index, (name, cls) in enumerate((("rank", rank_class), ("hidden", hidden_class)), 1):
        if cls == "1":
            signature[name] = "constexpr"
            constant_keys.append([index])
            constant_vals.append(1)
        else:
            attrs.append([[index], classes[cls]])
    return json.dumps(
        {
            "name": "fake_kernels.k",
            "signature": signature,
            "constant_keys": constant_keys,
            "constant_vals": constant_vals,
            "attrs_keys": [key for key, _ in attrs],
            "attrs_vals": [value for _, value in attrs],
            "options": {"num_warps": 4},
            "key": f"rank {rank_class}",
        }
    )


def test_records_that_differ_only_in_an_unspecialised_parameter_are_one_build(monkeypatch):
    """Records of rank 0, rank 1 and another rank, before the kernel took ``rank`` as
    do_not_specialize, are one build now; ``hidden``, still specialised, keeps its classes."""
    params = [
        SimpleNamespace(name=name, do_not_specialize=name == "rank")
        for name in ("x_ptr", "rank", "hidden")
    ]
    fake = SimpleNamespace(k=SimpleNamespace(params=params))
    monkeypatch.setattr(
        prebuild_module, "import_module", lambda name: fake if name == "fake_kernels" else None
    )
    records = [_record(rank) for rank in ("16", "1", "")] + [_record("", "1"), _record("16", "")]
    builds = [json.loads(record) for record in distinct_builds(records)]
    assert len(builds) == 3, builds
    for build in builds:
        assert build["signature"]["rank"] == "i32" and [1] not in build["constant_keys"]
        assert [1] not in build["attrs_keys"]
    assert [b["signature"]["hidden"] for b in builds] == ["i32", "constexpr", "i32"]
    assert [b["attrs_vals"][-1] for b in builds if [2] in b["attrs_keys"]] == [
        [["tt.divisibility", 16]],
        [],
    ]
    # A kernel that no longer imports: its records are kept as they are.
    monkeypatch.setattr(prebuild_module, "import_module", lambda name: 1 / 0)
    assert distinct_builds(records) == records


def test_records_of_other_modules_or_libraries_are_refused_before_import(tmp_path, monkeypatch):
    """A record from a shared folder names a module to import and files to link: only this
    library's kernels, linking only NVSHMEM's device library and Triton's libdevice, are built;
    any other is refused by name, and nothing it names is imported or read."""
    marker = tmp_path / "imported"
    (tmp_path / "planted.py").write_text(f"open({str(marker)!r}, 'w').close()\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    kernel = "hybrid_ep_triton.kernels.quantize.quantize_fp8_kernel"
    libdevice = ["libdevice", "/elsewhere/triton/backends/nvidia/lib/libdevice.10.bc"]

    def record(name: str, *libraries: list[str]) -> str:
        return json.dumps({"name": name, "options": {"extern_libs": [*libraries, libdevice]}})

    refused = {
        record("planted.k"): "planted.k: not a kernel of hybrid_ep_triton.kernels",
        record("hybrid_ep_triton.kernelsx.k"): "not a kernel of",
        record("hybrid_ep_triton.kernels..planted.k"): "not a kernel of",
        record(kernel, ["planted", f"{tmp_path}/planted.bc"]): "links planted",
        record(kernel, ["libnvshmem_device", f"{tmp_path}/planted.bc"]): "links libnvshmem_device",
        "[1, 2]": "not a record of a kernel build",
    }
    for line, why in refused.items():
        assert why in prebuild_module.refusal(line), line
    nvshmem = ["libnvshmem_device", "/elsewhere/nvidia/nvshmem/lib/libnvshmem_device_sm_90.bc"]
    assert prebuild_module.refusal(record(kernel, nvshmem)) is None
    monkeypatch.delenv("TRITON_INTERPRET")  # prebuild compiles; here it has nothing to compile
    report = prebuild(list(refused), 1)
    assert report.built == 0 and report.stale == [] and len(report.refused) == len(refused)
    assert not marker.exists()


def test_a_record_links_this_environments_libraries_never_its_recorded_files(monkeypatch):
    """Built, an accepted record links NVSHMEM's library made from this environment's NVSHMEM
    and Triton's own libdevice, whatever paths it recorded; an NVSHMEM file this environment
    lacks makes the build fail, never links the recorded file. (The trimmed library made here:
    tests/test_nvshmem_bitcode.py.)"""
    monkeypatch.setattr("site.getsitepackages", lambda: ["/nowhere/site-packages"])
    recorded = [
        ["libnvshmem_device", "/elsewhere/nvidia/nvshmem/lib/libnvshmem_device.bc"],
        ["libdevice", "/elsewhere/libdevice.10.bc"],
    ]
    data = {"name": "k", "options": {"num_warps": 4, "extern_libs": recorded}}
    with pytest.raises(FileNotFoundError, match="has no libnvshmem_device.bc"):
        prebuild_module.with_local_libraries(data)
    only_libdevice = dict(data, options={"num_warps": 4, "extern_libs": recorded[1:]})
    local = prebuild_module.with_local_libraries(only_libdevice)
    assert local["options"] == {"num_warps": 4, "extern_libs": []}
    plain = {"name": "k", "options": {"num_warps": 4}}
    assert prebuild_module.with_local_libraries(plain) == plain


_KEYS_SCRIPT = """
import json, sys
from triton.runtime.jit import JITCallable
from hybrid_ep_triton.kernels import combine, dispatch, quantize, route
from hybrid_ep_triton.runtime import triton_compat

names = ("route.layout_kernel", "dispatch.dispatch_kernel", "combine.combine_kernel",
         "quantize.quantize_fp8_kernel")
def keys():
    return [eval(name).cache_key for name in names]
settled = keys()
# A state that keys computed in another order leave before Triton 3.8: every function's key
# stale and its callees' constants forgotten.
functions = [v for m in list(sys.modules.values()) for v in vars(m).values()
             if isinstance(v, JITCallable)]
for function in functions:
    function.hash, function.used_global_vals = "stale", {}
stale = keys()
triton_compat._settle_cache_keys()
print(json.dumps({"settled": settled, "stale": stale, "again": keys()}))
"""


def test_kernel_cache_keys_are_settled_whatever_was_computed_before():
    """runtime/triton_compat settles the kernels' Triton cache keys, so that a build compiled in
    one process is found by another whatever each compiled first (before Triton 3.8 a key missed
    the constants of callees whose keys came later: a process that had compiled an
    across-nodes dispatch keyed 29 of 64 layout builds apart). Checked without the
    interpreter: keys from any earlier state settle to those of a fresh import."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    result = subprocess.run(
        [sys.executable, "-c", _KEYS_SCRIPT], env=env, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stdout + result.stderr
    keys = json.loads(result.stdout)
    assert keys["stale"] == ["stale"] * 4
    assert keys["again"] == keys["settled"]
