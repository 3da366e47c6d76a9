"""The generic family machinery (docs/CONTRACTS.md): the params ABI (one schema, a C++ rendering
checked by the real compiler, the host packer), manifest v2, dispatch by (family, key), the family
registry, the rule that the generic code names no family, and `flashgen add-variant combine`.

CPU only; the ABI compile test runs the real nvcc (host + device front end, no GPU)."""
from __future__ import annotations

import ast
import ctypes
import json
import re
import shlex
import struct
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent / "fixtures"))
from fgutil import REPO, SMALL_FWD, cli, compiles, fake_cuda, make_project, read_manifest  # noqa: E402

from flashgen import launch  # noqa: E402
from flashgen.dispatch import MissingVariantError, add_variant_command, full_key, select_variant  # noqa: E402
from flashgen.generator import families  # noqa: E402
from flashgen.generator.families import bwd as bwd_mod  # noqa: E402
from flashgen.generator.families import combine as combine_mod  # noqa: E402
from flashgen.generator.abi import TYPES, Field, params_struct, render_decls  # noqa: E402
from flashgen.generator.build import build, plan_variants, write_outputs  # noqa: E402
from flashgen.generator.config import load_variants  # noqa: E402
from flashgen.generator.errors import ConfigError, ToolchainError  # noqa: E402
from flashgen.generator.families import bwd as bwd_mod  # noqa: E402
from flashgen.generator.families import combine as combine_mod  # noqa: E402
from flashgen.generator.families import fwd as fwd_mod  # noqa: E402
from flashgen.generator.project import Project  # noqa: E402
from flashgen.generator.render import template_vars  # noqa: E402
from flashgen.generator.toolchain import find_nvcc  # noqa: E402
from flashgen.manifest import (Kernel, Manifest, ManifestError, Variant, load_manifest,  # noqa: E402
                               parse_manifest, read_fatbin)

COMBINE_CFG = """\
family: combine
default_build: true
matrix:
  dtype: [fp32, bf16]
"""

# a struct that exercises every alignment rule: i32 before a pointer (4 bytes of padding), i64 after
# an i32 (padding again), a trailing f32 (4 bytes of tail padding up to the 8-byte alignment)
MIX = params_struct(
    "Mix",
    ("a", "i32"),
    ("p", "ptr", "const float*"),
    ("b", "i32"),
    ("c", "i64"),
    ("u", "u32"),
    ("d", "f32"),
    ("e", "i32"),
)
MIX_OFFSETS = {"a": 0, "p": 8, "b": 16, "c": 24, "u": 32, "d": 36, "e": 40}
MIX_SIZE = 48

# ==================================================================================== params ABI


def test_layout_natural_alignment_and_tail_padding():
    lay = MIX.layout()
    assert lay["struct"] == "Mix" and lay["size"] == MIX_SIZE
    assert lay["fields"] == [[f.name, f.type, MIX_OFFSETS[f.name]] for f in MIX.fields]
    # tail padding up to the largest member's alignment
    assert params_struct("T", ("x", "i64"), ("y", "i32")).layout()["size"] == 16
    assert params_struct("T", ("x", "i32"), ("y", "i32"), ("z", "i32")).layout()["size"] == 12  # 4-aligned: none
    assert params_struct("T", ("x", "f32"), ("p", "ptr")).layout()["fields"][1] == ["p", "ptr", 8]
    # the same numbers as the host C compiler's ABI (ctypes lays out structs like C)
    ct = {"i32": ctypes.c_int32, "u32": ctypes.c_uint32, "i64": ctypes.c_int64, "f32": ctypes.c_float,
          "ptr": ctypes.c_void_p}

    for s in (MIX, fwd_mod.PARAMS, combine_mod.PARAMS):
        C = type(s.name, (ctypes.Structure,), {"_fields_": [(f.name, ct[f.type]) for f in s.fields]})
        lay = s.layout()
        assert lay["size"] == ctypes.sizeof(C), s.name
        assert [off for _, _, off in lay["fields"]] == [getattr(C, f.name).offset for f in s.fields], s.name


def test_family_structs_layouts():
    fwd = fwd_mod.PARAMS.layout()
    # 64 + the e4m3 descales, direct-store O, L2 sections, tile counter, PackGQA's group and tile queries,
    # vt_global's preprocess (V and its strides, V^T, its keys per row), varlen's arrays and lse strides (appended:
    # every earlier field keeps its offset), a KV cache's batch index, left padding and page table, split-KV, the
    # causal order's last L2 section (appended too)
    assert fwd["struct"] == "FwdParams" and fwd["size"] == 352
    assert fwd["fields"][0] == ["lse", "ptr", 0] and fwd["fields"][-29:] == [
        ["head_dim_v", "i32", 160], ["section_heads", "i32", 164], ["stream_tile_counter", "ptr", 168], ["group", "i32", 176],
        ["tile_queries", "i32", 180], ["v", "ptr", 184], ["v_stride_batch", "i64", 192], ["v_stride_seq", "i64", 200],
        ["v_stride_head", "i64", 208], ["vt", "ptr", 216], ["vt_seqlen", "i32", 224], ["cu_seqlens_q", "ptr", 232],
        ["cu_seqlens_k", "ptr", 240], ["seqused_q", "ptr", 248], ["seqused_k", "ptr", 256],
        ["lse_stride_batch", "i64", 264], ["lse_stride_head", "i64", 272], ["kv_batch_idx", "ptr", 280],
        ["leftpad_k", "ptr", 288], ["page_table", "ptr", 296], ["page_table_stride", "i32", 304],
        ["page_size", "i32", 308], ["page_box", "i32", 312], ["num_splits", "i32", 316], ["o_stride_split", "i64", 320],
        ["lse_stride_split", "i64", 328], ["split_mul", "u32", 336], ["split_shift", "u32", 340],
        ["tail_section", "i32", 344]]
    assert ["sink", "ptr", 56] in fwd["fields"] and ["q_descale", "ptr", 64] in fwd["fields"]
    offs = {n: o for n, _, o in fwd["fields"]}
    assert (offs["softmax_scale"], offs["softcap_scale"], offs["window_left"], offs["window_right"]) == (40, 44, 48, 52)
    comb = combine_mod.PARAMS.layout()
    assert comb["struct"] == "CombineParams" and comb["size"] == 152
    offs = {n: o for n, _, o in comb["fields"]}
    assert (offs["out_partial"], offs["lse"], offs["op_stride_split"], offs["num_splits"], offs["vec4"],
            offs["one_pass"]) == (0, 24, 32, 120, 140, 144)


def test_field_types_checked():
    with pytest.raises(ValueError) as ei:
        Field("x", "f64")
    assert "x" in str(ei.value) and "'f64'" in str(ei.value) and all(t in str(ei.value) for t in TYPES)


def test_cpp_rendering_declares_struct_and_asserts_every_offset():
    text = render_decls([MIX, MIX, fwd_mod.PARAMS])
    assert text.startswith("namespace flashgen {") and text.rstrip().endswith("}  // namespace flashgen")
    assert text.count("struct Mix {") == 1 and text.count("struct FwdParams {") == 1  # deduplicated by name
    assert "  const float* p;" in text and "  long long c;" in text and "  unsigned int u;" in text
    assert f"static_assert(sizeof(Mix) == {MIX_SIZE}," in text
    for name, off in MIX_OFFSETS.items():
        assert f"static_assert(offsetof(Mix, {name}) == {off}," in text
    for name, _, off in fwd_mod.PARAMS.layout()["fields"]:
        assert f"static_assert(offsetof(FwdParams, {name}) == {off}," in text


def _nvcc_compile_all(sources: dict, tmp_path: Path) -> dict:
    """{label: C++ source} -> {label: (returncode, output)}, compiled in parallel with the real nvcc."""
    try:
        nv = find_nvcc()
    except ToolchainError as e:  # CI and dev machines have it; say so loudly if not
        pytest.fail(f"the ABI compile test needs nvcc: {e}")
    procs = {}
    for label, text in sources.items():
        src = tmp_path / f"{label}.cu"
        src.write_text(text)
        procs[label] = subprocess.Popen([nv.path, "-std=c++17", "-c", str(src), "-o", str(tmp_path / f"{label}.o")],
                                        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    return {label: (p.wait(timeout=120), p.stdout.read()) for label, p in procs.items()}


@pytest.mark.slow
def test_cpp_rendering_compiles_and_a_wrong_layout_does_not(tmp_path):
    structs = [MIX, fwd_mod.PARAMS, combine_mod.PARAMS]
    good = render_decls(structs)
    kernel = ('\n__global__ void use(const flashgen::Mix m, const flashgen::FwdParams f, '
              'const flashgen::CombineParams c) {}\n')
    pre = "#include <cstddef>\n"
    wrong_offset = good.replace("offsetof(Mix, c) == 24", "offsetof(Mix, c) == 20")
    wrong_size = good.replace(f"sizeof(Mix) == {MIX_SIZE}", f"sizeof(Mix) == {MIX_SIZE - 4}")
    # the host packs from the layout; a struct body that disagrees with it (two fields swapped) must fail too
    swapped = good.replace("  int b;  // offset 16\n  long long c;  // offset 24\n",
                           "  long long c;  // offset 24\n  int b;  // offset 16\n")
    assert wrong_offset != good and wrong_size != good and swapped != good
    res = _nvcc_compile_all({"good": pre + good + kernel, "offset": pre + wrong_offset + kernel,
                             "size": pre + wrong_size + kernel, "swapped": pre + swapped + kernel}, tmp_path)
    assert res["good"][0] == 0, res["good"][1]
    assert res["offset"][0] != 0 and "Mix.c: offset differs from the host layout" in res["offset"][1]
    assert res["size"][0] != 0 and "Mix: size differs from the host layout" in res["size"][1]
    assert res["swapped"][0] != 0 and "offset differs from the host layout" in res["swapped"][1]


def test_params_packer_bytes_match_struct_offsets():
    lay = MIX.layout()
    values = {"a": -7, "p": 0x7F12_3456_7890, "b": 2**31 - 1, "c": -(2**40) - 3, "u": 2**32 - 2, "d": -1.25, "e": 9}
    pk = launch.ParamsPacker(lay)
    buf = pk.pack(values)
    assert pk.size == len(buf) == MIX_SIZE
    fmt = {"i32": "<i", "u32": "<I", "i64": "<q", "f32": "<f", "ptr": "<Q"}
    covered = set()
    for name, typ, off in lay["fields"]:
        (got,) = struct.unpack_from(fmt[typ], buf, off)
        assert got == values[name], name
        covered |= set(range(off, off + struct.calcsize(fmt[typ])))
    assert all(buf[i] == 0 for i in range(MIX_SIZE) if i not in covered)  # padding is zero
    # the family structs, as the manifest records them
    fl = fwd_mod.PARAMS.layout()
    fb = launch.ParamsPacker(fl).pack({"lse": 0xDEAD0000, "seqlen_q": 5, "seqlen_k": 7, "heads": 4, "heads_k": 2,
                                       "batch": 2, "num_m_blocks": 1, "num_tiles": 8, "scale_log2": 0.5,
                                       "softmax_scale": 0.25, "softcap_scale": 0.125, "window_left": 3,
                                       "window_right": -4, "sink": 0xBEEF00, "q_descale": 0, "q_descale_stride_batch": 0,
                                       "q_descale_stride_head": 0, "q_descale_stride_block": 0, "q_descale_head_div": 1,
                                       "k_descale": 0, "k_descale_stride_batch": 0, "k_descale_stride_head": 0,
                                       "k_descale_stride_block": 0, "v_descale": 0, "v_descale_stride_batch": 0,
                                       "v_descale_stride_head": 0, "o": 0, "o_stride_batch": 0, "o_stride_seq": 0,
                                       "o_stride_head": 0, "head_dim_v": 64, "section_heads": 3, "group": 2, "tile_queries": 128,
                                       "stream_tile_counter": 0xC0FFEE00, "v": 0xABC000, "v_stride_batch": 1 << 33,
                                       "v_stride_seq": 4096, "v_stride_head": 128, "vt": 0xDEF000, "vt_seqlen": 1040,
                                       "cu_seqlens_q": 0x1000, "cu_seqlens_k": 0x2000, "seqused_q": 0, "seqused_k": 0x3000,
                                       "lse_stride_batch": 0, "lse_stride_head": 1 << 34, "kv_batch_idx": 0x4000,
                                       "leftpad_k": 0, "page_table": 0x5000, "page_table_stride": 7, "page_size": 16,
                                       "page_box": 16, "num_splits": 3, "o_stride_split": 1 << 35,
                                       "lse_stride_split": 12345, "split_mul": 0xAAAAAAAB, "split_shift": 1,
                                       "tail_section": 5})
    assert struct.unpack_from("<QQQiii", fb, 280) == (0x4000, 0, 0x5000, 7, 16, 16)
    assert struct.unpack_from("<iqqIIi", fb, 316) == (3, 1 << 35, 12345, 0xAAAAAAAB, 1, 5)
    assert len(fb) == 352 and struct.unpack_from("<iQii", fb, 164) == (3, 0xC0FFEE00, 2, 128)
    assert struct.unpack_from("<QqqqQi", fb, 184) == (0xABC000, 1 << 33, 4096, 128, 0xDEF000, 1040)
    assert struct.unpack_from("<QQQQqq", fb, 232) == (0x1000, 0x2000, 0, 0x3000, 0, 1 << 34)
    assert struct.unpack_from("<Q", fb, 0) == (0xDEAD0000,)
    assert struct.unpack_from("<i", fb, 20) == (2,) and struct.unpack_from("<fff", fb, 36) == (0.5, 0.25, 0.125)
    assert struct.unpack_from("<iiQ", fb, 48) == (3, -4, 0xBEEF00)


def test_params_packer_errors():
    pk = launch.ParamsPacker(MIX.layout())
    with pytest.raises(KeyError) as ei:
        pk.pack({"a": 1, "p": 2, "b": 3, "c": 4, "u": 5, "d": 1.0})  # no "e"
    assert "'e'" in str(ei.value) and "a, p, b, c, u, d, e" in str(ei.value)
    with pytest.raises(struct.error):
        pk.pack({"a": 2**31, "p": 0, "b": 0, "c": 0, "u": 0, "d": 0.0, "e": 0})  # does not fit an i32
    with pytest.raises(ValueError, match="overlaps"):
        launch.ParamsPacker({"struct": "S", "size": 8, "fields": [["x", "i64", 0], ["y", "i32", 4]]})
    with pytest.raises(ValueError, match="layout says 4"):
        launch.ParamsPacker({"struct": "S", "size": 4, "fields": [["x", "i64", 0]]})


def _loaded(tensor_maps=(), layout=None, device=0):
    rec = Kernel(role="main", symbol="flashgen_x_main", threads=128, cluster=(1, 1, 1), smem_bytes=0,
                 tensor_maps=tuple(tensor_maps), params=layout or MIX.layout())
    v = Variant(name="x", family="f", params={}, dispatch={}, kernels=(rec,))
    return launch.LoadedKernel(v, rec, None, device, launch.ParamsPacker(rec.params))


def test_launch_checks_arguments_before_the_driver():
    """The generic launcher's argument errors come before any CUDA call (runs without a GPU)."""
    with pytest.raises(ValueError, match=r"takes tensor maps \['q', 'k'\], got 1"):
        launch.launch(_loaded(("q", "k")), (1, 1, 1), (object(),), {}, 0)
    with pytest.raises(ValueError, match="loaded for cuda:0, not cuda:1"):
        launch.launch(_loaded(), (1, 1, 1), (), {}, 0, device=1)
    with pytest.raises(KeyError, match="'a' not given"):
        launch.launch(_loaded(), (1, 1, 1), (), {}, 0)
    with pytest.raises(ValueError, match="dtype 'fp64'"):
        launch.tensor_map(0x1000, "fp64", (64, 8), (128,), (64, 8))
    with pytest.raises(ValueError, match="swizzle 16"):
        launch.tensor_map(0x1000, "bf16", (64, 8), (128,), (64, 8), swizzle=16)
    with pytest.raises(ValueError, match="rank"):
        launch.tensor_map(0x1000, "bf16", (64, 8), (128, 256), (64, 8))


# ==================================================================================== manifest v2


@pytest.mark.parametrize("schema", [1, 3, None])
def test_runtime_refuses_other_manifest_schemas(tmp_path, schema):
    path = tmp_path / "kernels" / "manifest.json"
    path.parent.mkdir()
    data = {"arch": "sm_90a", "variants": []} | ({} if schema is None else {"schema": schema})
    path.write_text(json.dumps(data))
    with pytest.raises(ManifestError) as ei:
        parse_manifest(path)
    msg = str(ei.value)
    assert str(path) in msg and f"schema {schema!r}" in msg and "reads schema 2" in msg
    assert "rebuild" in msg and "`flashgen build`" in msg


def test_malformed_v2_record_names_the_manifest(tmp_path):
    path = tmp_path / "manifest.json"
    path.write_text(json.dumps({"schema": 2, "variants": [{"name": "x", "family": "fwd", "params": {},
                                                             "dispatch": {}, "fatbin": "fatbin/x.fatbin"}]}))
    with pytest.raises(ManifestError) as ei:
        parse_manifest(path)
    assert "malformed" in str(ei.value) and str(path) in str(ei.value) and "kernels" in str(ei.value)


@pytest.fixture
def two_family_build(tmp_path, monkeypatch):
    """A fixture project with fwd (8 default variants) and combine (2) configs, built with the fake nvcc."""
    proj = make_project(tmp_path, {"fwd.yaml": SMALL_FWD, "combine.yaml": COMBINE_CFG})
    _, log = fake_cuda(tmp_path, monkeypatch)
    vs = load_variants(proj)
    res = build(proj, vs, log=lambda s: None)
    assert res.failed == [] and len(res.compiled) == 10 == len(compiles(log))
    return proj, vs


def test_manifest_v2_round_trip(two_family_build):
    proj, vs = two_family_build
    nvcc = find_nvcc()
    plans, errors = plan_variants(proj, vs, nvcc)
    assert errors == []
    before = proj.manifest_path.read_text()
    written = write_outputs(proj, plans, nvcc)  # publishing again from the cache gives the same manifest
    assert proj.manifest_path.read_text() == before and read_manifest(proj) == written
    assert written["schema"] == 2 and written["arch"] == "sm_90a"
    m = parse_manifest(proj.manifest_path)
    assert len(m.variants) == 10 and m.nvcc_version == written["nvcc"]["version"]
    by_name = {v.name: v for v in vs}
    for rv, rec in zip(m.variants, written["variants"]):
        v = by_name[rv.name]
        assert rv.name == rec["name"] and rv.family == v.family and rv.params == v.params
        assert rv.dispatch == v.dispatch == families.get(v.family).dispatch(v.params)
        assert rv.default is v.default is True
        assert rv.fatbin == proj.fatbin_dir / f"{v.name}.fatbin"
        assert read_fatbin(rv.fatbin, rv.sha256).startswith(b"FATBIN:" + v.symbol("main").encode())
        assert len(rv.kernels) == len(v.kernels) == 1
        for rk, spec in zip(rv.kernels, v.kernels):
            assert rk == rv.kernel(spec.role)
            assert (rk.role, rk.symbol, rk.threads, rk.cluster, rk.smem_bytes, rk.tensor_maps) == \
                (spec.role, v.symbol(spec.role), spec.threads, tuple(spec.cluster), spec.smem_bytes,
                 tuple(spec.tensor_maps))
            assert rk.params == spec.params.layout() and rk.registers == 168 and rk.spill_bytes == 0
            assert launch.ParamsPacker(rk.params).size == spec.params.layout()["size"]
    comb = [v for v in m.variants if v.family == "combine"]
    assert {v.dispatch["dtype"] for v in comb} == {"fp32", "bf16"} and all(set(v.dispatch) == {"dtype"} for v in comb)
    k = comb[0].kernel("main")
    assert k.tensor_maps == () and k.params["struct"] == "CombineParams" and k.smem_bytes == 0 and k.threads == combine_mod.FAMILY.knob_defaults()["threads"]
    f = next(v for v in m.variants if v.family == "fwd").kernel("main")
    assert f.tensor_maps == ("q", "k", "v", "o") and f.params["struct"] == "FwdParams" and f.smem_bytes > 0
    with pytest.raises(KeyError, match="has no kernel 'tail'.*main"):
        comb[0].kernel("tail")


def test_runtime_dispatches_from_the_built_manifest(two_family_build, monkeypatch):
    proj, vs = two_family_build
    monkeypatch.setenv("FLASHGEN_KERNEL_DIR", str(proj.build_dir))
    v = select_variant("combine", {"dtype": "bf16"})
    assert v.family == "combine" and v.params["dtype"] == "bf16" and load_manifest().path == proj.manifest_path
    w = select_variant("fwd", {"dtype": "fp16", "head_dim": 64, "head_dim_v": 64, "causal": True, "local": False, "softcap": False})
    assert w.family == "fwd" and (w.params["block_m"], w.params["consumer_wgs"]) == (192, 3)
    with pytest.raises(MissingVariantError, match="flashgen add-variant combine --dtype fp16"):
        select_variant("combine", {"dtype": "fp16"})


# ==================================================================================== dispatch


def _variant(name, family, dispatch, default=False):
    return Variant(name=name, family=family, params={"family": family, **dispatch}, dispatch=dict(dispatch),
                   kernels=(), fatbin=Path(f"/x/{name}.fatbin"), sha256="0" * 64, default=default)


FWD_KEY = {"dtype": "bf16", "head_dim": 128, "head_dim_v": 128, "causal": True}


def _manifest(*variants):
    return Manifest(path=Path("/somewhere/manifest.json"), variants=tuple(variants))


def test_select_variant_by_family_and_key_prefers_default():
    other = {**FWD_KEY, "causal": False}
    m = _manifest(_variant("fwd_a", "fwd", FWD_KEY), _variant("fwd_b", "fwd", FWD_KEY, default=True),
                  _variant("fwd_c", "fwd", FWD_KEY), _variant("fwd_d", "fwd", other),
                  _variant("combine_z", "combine", {"dtype": "bf16"}),
                  _variant("other_y", "other", {"dtype": "bf16"}, default=True))
    assert select_variant("fwd", FWD_KEY, manifest=m).name == "fwd_b"  # the default, not the first by name
    assert select_variant("fwd", dict(reversed(list(FWD_KEY.items()))), manifest=m).name == "fwd_b"  # key order
    assert select_variant("fwd", other, manifest=m).name == "fwd_d"
    assert select_variant("combine", {"dtype": "bf16"}, manifest=m).name == "combine_z"  # not other_y's family
    m2 = _manifest(_variant("fwd_c", "fwd", FWD_KEY), _variant("fwd_a", "fwd", FWD_KEY))
    assert select_variant("fwd", FWD_KEY, manifest=m2).name == "fwd_a"  # no default: first by name
    with pytest.raises(MissingVariantError):  # a dispatch key only matches within its family
        select_variant("fwd", {"dtype": "bf16"}, manifest=m)


def test_missing_variant_error_names_family_key_and_command():
    m = _manifest(_variant("fwd_b", "fwd", FWD_KEY, default=True), _variant("combine_z", "combine", {"dtype": "bf16"}))
    key = {"dtype": "fp16", "head_dim": 96, "head_dim_v": 96, "causal": False}
    with pytest.raises(MissingVariantError) as ei:
        select_variant("fwd", key, manifest=m)
    msg = str(ei.value)
    assert "no built fwd variant serves dtype=fp16, head_dim=96, head_dim_v=96, causal=false" in msg
    assert "dtype=bf16, head_dim=128, head_dim_v=128, causal=true" in msg and "/somewhere/manifest.json" in msg
    assert ("flashgen add-variant fwd --dtype fp16 --head-dim 96 --head-dim-v 96 --no-causal "
            "--block-m 128 --block-n 128 --consumer-wgs 2") in msg
    with pytest.raises(MissingVariantError) as ei:
        select_variant("combine", {"dtype": "fp32"}, manifest=m)
    msg = str(ei.value)
    assert "no built combine variant serves dtype=fp32" in msg and "built combine variants: dtype=bf16" in msg
    d = combine_mod.FAMILY.knob_defaults()
    assert f"flashgen add-variant combine --dtype fp32 --block-m {d['block_m']} --threads {d['threads']}" in msg


@pytest.mark.parametrize("family,key", [
    ("fwd", {"dtype": "bf16", "head_dim": 256, "head_dim_v": 256, "causal": True, "local": False, "softcap": False}),
    ("fwd", {"dtype": "fp16", "head_dim": 64, "head_dim_v": 64, "causal": False, "local": False, "softcap": False}),
    ("fwd", {"dtype": "bf16", "head_dim": 192, "head_dim_v": 192, "causal": False, "local": True, "softcap": True}),
    ("combine", {"dtype": "fp16"}),
    ("quant", {"dtype": "fp16"}),
])
def test_suggested_command_runs_and_serves_the_key(tmp_path, monkeypatch, family, key):
    """The command a MissingVariantError prints is valid and adds a variant with exactly that key."""
    proj = make_project(tmp_path, {"fwd.yaml": SMALL_FWD})
    fake_cuda(tmp_path, monkeypatch)
    argv = shlex.split(add_variant_command(family, key))
    assert argv[:3] == ["flashgen", "add-variant", family]
    full = full_key(family, key)  # the variant's dispatch has the keys with defaults too (fwd's pack_gqa)
    before = [v for v in load_variants(proj) if v.family == family and v.dispatch == full]
    r = cli([*argv[1:], "--no-build"], proj.root)
    assert r.exit_code == 0, r.output
    added = [v for v in load_variants(proj) if v.family == family and v.dispatch == full]
    assert len(added) == 1
    # a point the configs already make is reported, not appended a second time
    assert (proj.configs_dir / f"{family}_extra.yaml").exists() == (not before)
    assert ("already configured" in r.output) == bool(before)


# ==================================================================================== registry


def test_families_registry():
    assert {"fwd", "combine"} <= set(families.names())
    for name in families.names():
        fam = families.get(name)
        assert isinstance(fam, families.Family) and fam.name == name and fam.template == f"{name}.cu.j2"
        assert set(fam.dispatch_keys) <= set(fam.names()) and set(fam.tile_match) <= set(fam.names("axis"))
        assert fam.param_keys[0] == "family"
    with pytest.raises(KeyError) as ei:
        families.get("attention")
    assert "'attention'" in str(ei.value) and "fwd" in str(ei.value) and "combine" in str(ei.value)


@pytest.mark.parametrize("text,needle", [
    ("family: attention\nmatrix: {dtype: bf16}\n", "family = 'attention': not allowed; allowed: bwd, combine, fwd, quant"),
    ("matrix: {dtype: bf16}\n", "missing required key 'family'; allowed: bwd, combine, fwd, quant"),
])
def test_unknown_family_in_config_exits_2(tmp_path, text, needle):
    proj = make_project(tmp_path, {"x.yaml": text})
    with pytest.raises(ConfigError) as ei:
        load_variants(proj)
    assert any(p.startswith("configs/x.yaml") and needle in p for p in ei.value.problems), ei.value.problems
    r = cli(["build"], proj.root)
    assert r.exit_code == 2 and needle in r.stderr and "Traceback" not in r.output
    assert not proj.build_dir.exists()


def test_template_vars_contract():
    """What every template sees (CONTRACTS §2), for a variant of each family of the real configs."""
    vs = load_variants(Project(REPO))
    for family in ("fwd", "combine"):
        v = next(v for v in vs if v.family == family)
        tv = template_vars(v)
        assert {k: tv[k] for k in v.params} == v.params and tv["name"] == v.name and tv["family"] == family
        assert all(tv[k] == x for k, x in v.resources.items())
        (role,) = tv["kernels"]
        k = tv["kernels"][role]
        spec = v.kernels[0]
        assert k == {"symbol": f"flashgen_{v.name}_{role}", "threads": spec.threads, "smem_bytes": spec.smem_bytes,
                     "cluster": list(spec.cluster), "params_struct": spec.params.name}
        assert tv["params_decls"] == render_decls([spec.params])
        assert isinstance(tv["smem"], dict) and "smem_bytes" in tv


def test_register_splits_fit_the_launch_allocation():
    """Every warp-specialized variant's setmaxnreg split fits the registers its CTA is launched with
    (65536 / threads, rounded down to 8, per thread): setmaxnreg.inc waits until the other warpgroups
    have released enough, so an over-full split (e4m3 with 32 / 240: 65536 > 64512) hangs every launch."""
    seen = 0
    for v in load_variants(Project(REPO)):
        r = v.resources
        if "producer_regs" not in r:
            continue
        main = next(k for k in v.kernels if k.role == "main")
        launch_regs = 65536 // main.threads // 8 * 8
        consumers = main.threads // 128 - 1
        assert 128 * r["producer_regs"] + 128 * consumers * r["consumer_regs"] <= launch_regs * main.threads, v.name
        seen += 1
    assert seen > 100


def test_register_split_rule():
    """fwd.register_split: FA3's 24 / 240 only for e4m3 tiles whose accumulators do not fit 232 - 32
    (head_dim 256 at block_n 128, head_dim 128 at block_n 224); other e4m3 and PackGQA tiles keep 40 / 232, 16-bit ones 24 / 240,
    3 consumer warpgroups 32 / 160. The rendered kernel takes the 24-register transposer (its key-group
    loop) exactly when the producer has 24 registers."""
    from flashgen.generator.families import fwd as fwd_mod

    def split(**kw):
        p = dict(dtype="e4m3", head_dim=256, head_dim_v=256, block_n=128, consumer_wgs=2)
        p.update(kw)
        return fwd_mod.register_split(p)

    assert split() == (24, 240)
    assert split(block_n=64) == (40, 232)
    assert split(head_dim=128, head_dim_v=128, block_n=192) == (40, 232)
    assert split(dtype="bf16") == (24, 240)
    assert split(dtype="bf16", pack_gqa=True, head_dim=128, head_dim_v=128) == (40, 232)
    assert split(head_dim=64, head_dim_v=64, consumer_wgs=3) == (32, 160)
    # vt_global: no transposer in the producer warpgroup, so FA3's 24 / 240 at every 2-warpgroup tile
    assert split(head_dim=128, head_dim_v=128, block_n=192, vt_global=True) == (24, 240)
    assert split(head_dim=64, head_dim_v=64, consumer_wgs=3, vt_global=True) == (32, 160)
    wide = [v for v in load_variants(Project(REPO)) if v.family == "fwd" and v.params["dtype"] == "e4m3"
            and v.resources["producer_regs"] == 24 and not v.params.get("vt_global")]
    assert wide and all((v.params["head_dim"], v.params["block_n"]) in ((256, 128), (128, 224)) for v in wide)
    assert split(head_dim=128, head_dim_v=128, block_n=224) == (24, 240)  # FA3's 128 x 224: 204 registers
    src = (REPO / "templates" / "fwd.cu.j2").read_text()
    assert "(kProducerRegs <= 24)>" in src  # VTransposer's kGroupLoop


def test_register_rule_without_overlap_leaves_p_out():
    """Without intra-warpgroup overlap S is dead while P is live (P takes S's registers), so the
    accumulator rule counts S and O only: cuDNN's FP8 tile (64 x 256 per consumer warpgroup at
    head_dim 128) and 16-bit hd64 128x256 are feasible then, and not with the overlap."""
    from flashgen.generator.families import fwd as fwd_mod

    base = dict(family="fwd", dtype="e4m3", head_dim=128, head_dim_v=128, causal=False, block_m=128, block_n=256,
                stages=2, consumer_wgs=2, pingpong=True, overlap=True, persistent=True, vt_global=True)

    def block_n_problem(**kw):
        return "block_n" in {k for k, _, _ in fwd_mod.FAMILY.problems({**base, **kw})}

    assert block_n_problem()  # 128 + 64 + 32 = 224 > 240 - 32
    assert not block_n_problem(overlap=False)  # 128 + 64 = 192
    assert fwd_mod.register_split({**base, "overlap": False}) == (24, 240)
    assert block_n_problem(dtype="bf16", head_dim=64, head_dim_v=64, vt_global=False)  # 128 + 32 + 64
    assert not block_n_problem(dtype="bf16", head_dim=64, head_dim_v=64, vt_global=False, overlap=False)
    assert block_n_problem(head_dim=256, head_dim_v=256, overlap=False)  # 128 + 128 = 256 even without P


def test_two_q_buffers_where_they_fit():
    """q_stages 2 doubles Q's region; it is feasible wherever shared memory holds it, except with
    PackGQA. Where O no longer fits beside two Q buffers it is staged in Q's (hd256 128x48: the
    next tile's Q loads into the other buffer); q_stages 1 keeps the layout as it was."""
    from flashgen.generator.families import fwd as fwd_mod

    base = dict(family="fwd", dtype="bf16", head_dim=64, head_dim_v=64, causal=True, block_m=128, block_n=128,
                stages=2, consumer_wgs=2, pingpong=True, overlap=True, persistent=True)

    def problems(**kw):
        return {k for k, _, _ in fwd_mod.FAMILY.problems({**base, **kw})}

    one, two = fwd_mod.smem_layout(base), fwd_mod.smem_layout({**base, "q_stages": 2})
    assert two["q"]["bytes"] == 2 * one["q"]["bytes"] == 2 * 128 * 64 * 2 and two["o"]["bytes"] > 0
    assert not problems(q_stages=2)
    assert "q_stages" in problems(q_stages=2, pack_gqa=True)
    hd256 = dict(head_dim=256, head_dim_v=256)
    # hd256 128x48: one Q buffer and a separate O, or two Q buffers with O staged in Q's (same bytes)
    l1 = fwd_mod.smem_layout({**base, **hd256, "block_n": 48})
    l2 = fwd_mod.smem_layout({**base, **hd256, "block_n": 48, "q_stages": 2})
    assert l1["o"]["bytes"] == 128 * 256 * 2 and l2["o"]["bytes"] == 0
    assert l2["q"]["bytes"] == 2 * l1["q"]["bytes"] and not problems(q_stages=2, block_n=48, **hd256)
    # hd256 128x80: two Q buffers exceed 227 KB even without a separate O
    assert problems(q_stages=2, block_n=80, **hd256) == {"smem_bytes"}
    assert not problems(q_stages=1, block_n=80, **hd256)
    src = (REPO / "templates" / "fwd.cu.j2").read_text()
    assert "using QState = PipeState<kQStages>;" in src and "tile_slots[q_st.stage]" in src


def test_smem_layout_is_the_feasibility_layout():
    """The shared-memory regions the template gets are the ones feasibility checked: in address
    order, contiguous, smem_bytes = end of the last one + 1024, and infeasible exactly above the limit."""
    for v in load_variants(Project(REPO)):
        r = v.resources
        if v.family == "bwd":
            main = next(k for k in v.kernels if k.role == "main")
            assert r["smem"] == bwd_mod.smem_layout(v.params, r["ds_buffers"], r["dq_buffers"])
            end = 0
            for region in r["smem"].values():
                assert region["offset"] == end
                end += region["bytes"]
            assert r["smem_bytes"] == end + 1024 == main.smem_bytes <= bwd_mod.SMEM_LIMIT
            assert all(k.smem_bytes == 0 for k in v.kernels if k.role != "main")
            # main and post are programmatic dependents of the kernel before each (PDL: bwd.py)
            assert {k.role: k.pdl for k in v.kernels} == {"pre": False, "main": True, "post": True}
            continue
        if v.family != "fwd":
            assert r["smem"] == {} and r["smem_bytes"] == 0 == v.kernels[0].smem_bytes
            continue
        regions = ["q", "k", "v", "vt", "o", "bars"] if v.params["dtype"] == "e4m3" else ["q", "k", "v", "o", "bars"]
        assert r["smem"] == fwd_mod.smem_layout(v.params) and list(r["smem"]) == regions
        if v.params["dtype"] == "e4m3":  # V^T ring: head_dim rows x block_n padded to 128 byte columns
            assert r["smem"]["vt"]["bytes"] == v.params["stages"] * r["head_dim_v_padded"] * r["block_n_vt"]
            assert r["block_n_vt"] % 128 == 0
            # O: a bf16 staging tile when it fits beside the rings (8f867cd), else none (stored from registers)
            o_bytes = v.params["block_m"] * r["head_dim_v_padded"] * 2
            rest = sum(x["bytes"] for k, x in r["smem"].items() if k != "o") + fwd_mod.ALIGN_SLACK_BYTES
            assert r["smem"]["o"]["bytes"] == (o_bytes if rest + o_bytes <= fwd_mod.SMEM_LIMIT else 0)
            # vt_global: no V ring (V^T is TMA-loaded into the vt ring)
            assert (r["smem"]["v"]["bytes"] == 0) == bool(v.params.get("vt_global"))
        # Q/K/V rows: 64 bytes for e4m3 head_dim <= 64 (not padded to 128: that doubled both GEMMs), else 128
        hd, e = v.params["head_dim"], 1 if v.params["dtype"] == "e4m3" else 2
        assert r["qk_row_bytes"] == (64 if e == 1 and hd <= 64 else 128) == fwd_mod.operand_row_bytes(hd, v.params["dtype"])
        assert r["head_dim_padded"] == -(-hd // (r["qk_row_bytes"] // e)) * (r["qk_row_bytes"] // e)
        assert r["smem"]["q"]["bytes"] == v.params.get("q_stages", 1) * v.params["block_m"] * r["head_dim_padded"] * e
        end = 0
        for region in r["smem"].values():
            assert region["offset"] == end
            end += region["bytes"]
        assert r["smem_bytes"] == end + 1024 == v.kernels[-1].smem_bytes <= fwd_mod.SMEM_LIMIT
        assert r["separate_o"] == (r["smem"]["o"]["bytes"] > 0)
    base = dict(family="fwd", dtype="bf16", head_dim=128, head_dim_v=128, causal=False, block_m=128, block_n=128,
                stages=2, consumer_wgs=2, pingpong=True, overlap=True, persistent=True)
    for bn, st in ((128, 3), (176, 2), (176, 3), (256, 2)):
        p = {**base, "block_n": bn, "stages": st}
        over = fwd_mod.FAMILY.resources(p)["smem_bytes"] > fwd_mod.SMEM_LIMIT
        assert ("smem_bytes" in {k for k, _, _ in fwd_mod.FAMILY.problems(p)}) == over
    assert not fwd_mod.FAMILY.resources({**base, "block_n": 176})["separate_o"]  # O shares Q's buffer there


# ============================================================================ generic code is generic

GENERIC = [f"generator/{m}.py" for m in ("config", "naming", "render", "build", "abi", "project", "ptxas", "sass",
                                         "toolchain", "fsutil", "errors", "tunetable")]
GENERIC += ["generator/families/__init__.py", "runtime/manifest.py", "runtime/dispatch.py", "runtime/launch.py",
            "runtime/cli.py", "runtime/tuning.py"]
FAMILY_LITERAL = re.compile(r"""(["'])(fwd|combine|quant|varlen_prep)\1""")


def _is_family_expr(node) -> bool:
    """``family``, ``x.family``, ``p["family"]``, ``x.get("family")``."""
    if isinstance(node, ast.Name):
        return node.id == "family"
    if isinstance(node, ast.Attribute):
        return node.attr == "family"
    if isinstance(node, ast.Subscript):
        return isinstance(node.slice, ast.Constant) and node.slice.value == "family"
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "get":
        return bool(node.args) and isinstance(node.args[0], ast.Constant) and node.args[0].value == "family"
    return False


def _has_str_literal(node) -> bool:
    return any(isinstance(n, ast.Constant) and isinstance(n.value, str) for n in ast.walk(node))


@pytest.mark.parametrize("rel", GENERIC)
def test_generic_code_names_no_family(rel):
    """Nothing outside a family's four pieces names it (CONTRACTS §1): no "fwd"/"combine" literal and
    no comparison of a family against a literal in the generic generator and runtime modules.
    (Comparing two family values, as dispatch does to filter by the requested family, is generic.)"""
    text = (REPO / rel).read_text()
    hits = [f"{rel}:{text.count(chr(10), 0, m.start()) + 1}: {m.group(0)}" for m in FAMILY_LITERAL.finditer(text)]
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.Compare):
            sides = [node.left, *node.comparators]
            others = [s for s in sides if not _is_family_expr(s)]
            if len(others) < len(sides) and any(_has_str_literal(s) for s in others):
                hits.append(f"{rel}:{node.lineno}: {ast.unparse(node)}")
    assert hits == []


def test_the_detector_detects():
    """The check above finds what it looks for (so an empty result means something)."""
    bad = 'if v.family == "fwd":\n    pass\nif p["family"] in ("x", "y"):\n    pass\nfam = get("combine")\n'
    assert len(FAMILY_LITERAL.findall(bad)) == 2
    cmps = [n for n in ast.walk(ast.parse(bad)) if isinstance(n, ast.Compare)]
    assert all(any(_is_family_expr(s) for s in [c.left, *c.comparators]) for c in cmps) and len(cmps) == 2


def test_every_package_is_in_the_wheel():
    """pyproject's package list covers every Python package of runtime/ and generator/ (the family
    modules included): an installed wheel must be able to import flashgen.generator.families."""
    cfg = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    pkg_dir = cfg["package-dir"]
    listed = set(cfg["packages"])
    want = set()
    for dotted, d in pkg_dir.items():
        for init in (REPO / d).rglob("__init__.py"):
            rel = init.parent.relative_to(REPO / d)
            want.add(".".join([dotted, *rel.parts]))
    assert "flashgen.generator.families" in want
    assert sorted(want - listed) == []


# ==================================================================================== add-variant combine


def test_add_variant_combine_writes_its_config(tmp_path, monkeypatch):
    proj = make_project(tmp_path)
    _, log = fake_cuda(tmp_path, monkeypatch)
    r = cli(["add-variant", "combine", "--dtype", "bf16", "--block-m", "16", "--no-build"], proj.root)
    assert r.exit_code == 0, r.output
    path = proj.configs_dir / "combine_extra.yaml"
    data = yaml.safe_load(path.read_text())
    assert data["family"] == "combine" and len(data["extra"]) == 1
    assert {k: data["extra"][0][k] for k in ("dtype", "block_m")} == {"dtype": "bf16", "block_m": 16}
    (v,) = [v for v in load_variants(proj) if v.family == "combine"]
    assert v.params == {"family": "combine", "dtype": "bf16", "block_m": 16,
                        "threads": combine_mod.FAMILY.knob_defaults()["threads"]} and not v.default
    assert v.name in r.output and "configs/combine_extra.yaml" in r.output
    assert compiles(log) == [] and not proj.manifest_path.exists()  # --no-build
    # and with the build: the manifest lists it under its family, ready for dispatch
    r = cli(["add-variant", "combine", "--dtype", "fp16", "--block-m", "8", "--threads", "128"], proj.root)
    assert r.exit_code == 0, r.output
    (e,) = read_manifest(proj)["variants"]
    assert e["family"] == "combine" and e["dispatch"] == {"dtype": "fp16"} and e["default"] is False
    assert e["kernels"][0]["threads"] == 128 and e["kernels"][0]["params"]["struct"] == "CombineParams"
    assert compiles(log) == [e["kernels"][0]["symbol"]]


@pytest.mark.parametrize("block_m,allowed", [
    (48, "a power of 2 in [4, 64]"),
    (128, "a power of 2 in [4, 64]"),
    (64, "at most 32"),  # the family's feasibility: 256 splits x 64 rows of fp32 scales > 48 KB static smem
])
def test_add_variant_combine_invalid_block_m(tmp_path, monkeypatch, block_m, allowed):
    proj = make_project(tmp_path)
    _, log = fake_cuda(tmp_path, monkeypatch)
    r = cli(["add-variant", "combine", "--dtype", "bf16", "--block-m", str(block_m)], proj.root)
    assert r.exit_code == 2, r.output
    assert "block_m" in r.stderr and f"= {block_m}" in r.stderr and allowed in r.stderr, r.stderr
    assert "configs/combine_extra.yaml" in r.stderr and "Traceback" not in r.output
    assert not (proj.configs_dir / "combine_extra.yaml").exists() and compiles(log) == []


def test_add_variant_config_of_another_family(tmp_path, monkeypatch):
    proj = make_project(tmp_path)
    fake_cuda(tmp_path, monkeypatch)
    fwd_cfg = proj.configs_dir / "fwd.yaml"
    before = fwd_cfg.read_text()
    r = cli(["add-variant", "combine", "--dtype", "bf16", "--config", "configs/fwd.yaml", "--no-build"], proj.root)
    assert r.exit_code == 2, r.output
    assert "configs/fwd.yaml" in r.stderr and "'fwd'" in r.stderr and "'combine'" in r.stderr, r.stderr
    assert fwd_cfg.read_text() == before
    (proj.configs_dir / "c.yaml").write_text(COMBINE_CFG)
    r = cli(["add-variant", "fwd", "--dtype", "bf16", "--head-dim", "64", "--block-m", "192", "--block-n", "128",
             "--consumer-wgs", "3", "--config", "configs/c.yaml", "--no-build"], proj.root)
    assert r.exit_code == 2 and "'combine'" in r.stderr and "'fwd'" in r.stderr, r.stderr
    assert (proj.configs_dir / "c.yaml").read_text() == COMBINE_CFG


def test_add_variant_help_lists_families_and_keys():
    r = cli(["add-variant", "--help"])
    assert r.exit_code == 0 and "fwd" in r.output and "combine" in r.output
    r = cli(["add-variant", "combine", "--help"])
    assert r.exit_code == 0 and "--block-m" in r.output and "--threads" in r.output and "--head-dim" not in r.output
    r = cli(["add-variant", "nope", "--dtype", "bf16"])
    assert r.exit_code == 2 and "nope" in r.output


def _bwd_params(**kw):
    p = {"dtype": "bf16", "head_dim": 256, "causal": False, "local": False, "softcap": False,
         "block_m": 64, "block_n": 64, "slice": 256, "stages": 2}
    p.update(kw)
    return p


def test_bwd_role_tiles_rules_and_resources():
    """block_n 64 (the role tiles): block_m 64 and slice = head_dim padded, or a problem naming the
    key; their resources: one dS^T buffer, no dQ staging tiles, the 16-bit P^T region, 32 / 232
    registers, fitting 227 KB at head_dim 256 with 2 stages; the suggested tile at 192 and 256."""
    fam = bwd_mod.FAMILY
    assert fam.problems(_bwd_params()) == []
    assert fam.problems(_bwd_params(head_dim=192, slice=192)) == []
    assert [k for k, _, _ in fam.problems(_bwd_params(block_m=128))] == ["block_m"]
    assert [k for k, _, _ in fam.problems(_bwd_params(slice=128))] == ["slice"]
    r = fam.resources(_bwd_params())
    assert (r["ds_buffers"], r["dq_buffers"], r["num_slices"]) == (1, 0, 1)
    assert (r["producer_regs"], r["consumer_regs"]) == (32, 232)
    assert 128 * 32 + 256 * 232 <= 65536
    assert r["smem"]["pd"]["bytes"] == 64 * 64 * 2 and r["smem"]["k"]["bytes"] == 64 * 256 * 2
    assert r["smem_bytes"] <= bwd_mod.SMEM_LIMIT
    old = fam.resources(_bwd_params(block_n=128, slice=128, stages=1))  # the slice tile keeps its layout
    assert old["smem"]["pd"]["bytes"] == 0 and (old["producer_regs"], old["consumer_regs"]) == (24, 240)
    assert old["num_slices"] == 2
    for d in (192, 256):
        t = fam.suggest({"dtype": "fp16", "head_dim": d, "causal": True})
        assert (t["block_m"], t["block_n"], t["slice"], t["stages"]) == (64, 64, d, 2)
    t = fam.suggest({"dtype": "fp16", "head_dim": 160, "causal": True})  # rounds up to 192's tile
    assert (t["block_n"], t["slice"]) == (64, 192)


def test_bwd_ds_pairs_are_the_hd256_role_tiles_not_local():
    """ds_pairs (2-CTA clusters exchanging dS^T, templates/bwd.cu.j2 kPairs): the role tiles at head_dim
    256 without a window, causal or not, softcap or not; their main kernel a (2, 1, 1) cluster whose
    shared memory (the peer's K half beside the role tile's layout) fills the 227 KB (but for the
    barriers' spare bytes), with the
    P^T buffer (which receives the peer's dS^T) and the K half 1024-byte aligned SW128 tiles. Not
    head_dim 192, local tiles or block_n 128."""
    fam = bwd_mod.FAMILY
    for causal in (False, True):
        for softcap in (False, True):
            r = fam.resources(_bwd_params(causal=causal, softcap=softcap))
            assert r["ds_pairs"] and r["cluster"] == (2, 1, 1)
            assert bwd_mod.SMEM_LIMIT - bwd_mod.BARRIER_BYTES <= r["smem_bytes"] <= bwd_mod.SMEM_LIMIT
            assert r["smem"]["kp"]["bytes"] == 64 * 128 * 2
            assert r["smem"]["kp"]["offset"] % 1024 == 0 and r["smem"]["pd"]["offset"] % 1024 == 0
            main = {k.role: k for k in fam.kernels(_bwd_params(causal=causal, softcap=softcap), r)}["main"]
            assert main.cluster == (2, 1, 1) and main.smem_bytes == r["smem_bytes"]
    from flashgen.generator.render import CLUSTER_DEFINE, render
    for v in load_variants(Project(REPO)):  # the cluster variants' sources mask the CTA rank (ptx.cuh)
        if v.family == "bwd" and v.params["head_dim"] in (192, 256) and not v.params["softcap"]:
            src = render(v, REPO / "templates")
            assert src.startswith(CLUSTER_DEFINE) == v.resources["ds_pairs"], v.name
            assert src.count("FLASHGEN_CLUSTER_LAUNCH") == (1 if v.resources["ds_pairs"] else 0), v.name
    for p in (_bwd_params(head_dim=192, slice=192), _bwd_params(local=True),
              _bwd_params(head_dim=128, block_n=128, slice=128)):
        r = fam.resources(p)
        assert not r["ds_pairs"] and r["cluster"] == (1, 1, 1) and r["smem"]["kp"]["bytes"] == 0, p


def test_bwd_kv_reg_steps_fit_the_role_tiles():
    """kv_reg_steps: the role tiles hold K's / V's first k-steps in registers (KV_REG_STEPS: all 12 at
    head_dim 192, 5 of 16 at 256, in every role variant of the default build, causal, softcap or local),
    the block_n 128 tiles none; the rendered main kernel says so (kKRegSteps, kVRegSteps)."""
    from flashgen.generator.families.bwd import kv_reg_steps
    from flashgen.generator.render import render

    seen = set()
    for v in load_variants(Project(REPO)):
        if v.family != "bwd":
            continue
        want = {192: (12, 12), 256: (5, 5)}.get(v.params["head_dim"], (0, 0)) if v.params["block_n"] == 64 else (0, 0)
        assert kv_reg_steps(v.params) == want == tuple(v.resources["kv_reg_steps"]), v.name
        if (v.params["head_dim"], v.params["local"]) not in seen:
            seen.add((v.params["head_dim"], v.params["local"]))
            src = render(v, REPO / "templates")
            assert f"constexpr int kKRegSteps = {want[0]};" in src and f"constexpr int kVRegSteps = {want[1]};" in src
    assert {(192, True), (256, True), (128, False)} <= seen
    assert kv_reg_steps(_bwd_params(head_dim=128, block_n=128, slice=128)) == (0, 0)


def test_bwd_default_build_uses_role_tiles_above_128():
    """configs/bwd.yaml: head dims 192 and 256 on role tiles, the others on block_n 128."""
    for v in load_variants(Project(REPO)):
        if v.family == "bwd":
            assert (v.params["block_n"] == 64) == (v.params["head_dim"] >= 192), v.name


def test_first_block_skip_is_the_hd256_causal_tiles_up_to_block_n_64():
    """fwd.first_block_skip applies to the configured causal 16-bit tiles with block_n <= 64 (hd256 128x48 at
    2 and 3 stages, 128x64, and the softcap 128x64 tile) and to no tile with half_first (which takes over
    from block_n 64 where the skip does not apply), exponential turns, PackGQA, a window or FP8."""
    from flashgen.generator.families.fwd import first_block_skip, half_first

    vs = [v for v in load_variants(Project(REPO)) if v.family == "fwd"]
    skip = [v for v in vs if first_block_skip(v.params)]
    assert {(v.params["dtype"], v.params["head_dim"], v.params["block_m"], v.params["block_n"], v.params["stages"],
             v.params["softcap"]) for v in skip} == (
        {(dt, 256, 128, 48, st, False) for dt in ("bf16", "fp16") for st in (2, 3)}
        | {(dt, 256, 128, 64, 2, sc) for dt in ("bf16", "fp16") for sc in (False, True)})
    assert all(v.params["causal"] and not (v.params["local"] or v.params["pack_gqa"]) for v in skip)
    assert not any(half_first(v.params) or v.params.get("exp_turns") for v in skip)
    base = dict(family="fwd", dtype="bf16", head_dim=256, head_dim_v=256, causal=True, block_m=128, block_n=48,
                stages=2, consumer_wgs=2, pingpong=True, overlap=True, persistent=True)
    assert first_block_skip(base) and first_block_skip({**base, "block_n": 64})
    assert not half_first(base) and not half_first({**base, "block_n": 64})
    assert not first_block_skip({**base, "block_n": 80}) and half_first({**base, "block_n": 80})
    assert not first_block_skip({**base, "causal": False})
    assert not first_block_skip({**base, "dtype": "e4m3"}) and not first_block_skip({**base, "local": True})
    assert half_first({**base, "dtype": "e4m3", "block_n": 64})
    # spec_max (head dims up to 128) keeps a 64-key tile on half_first
    hd128 = {**base, "head_dim": 128, "head_dim_v": 128, "block_n": 64}
    assert not first_block_skip(hd128) and half_first(hd128)


def test_bwd_block_m_80_is_the_plain_non_causal_hd128_tile():
    """block_m 80 (dq_swap: FA3's non-causal head_dim 128 tile, dQ computed transposed) is feasible
    for the plain non-causal mask, with dS^T double-buffered in the 32-byte swizzle and 20 KB dQ
    staging tiles inside 227 KB; causal, local or softcap variants of it are refused before any
    compilation (built and GPU-tested for the plain mask only), naming block_m."""
    fam = bwd_mod.FAMILY
    base = {"family": "bwd", "dtype": "bf16", "head_dim": 128, "causal": False, "local": False, "softcap": False,
            "block_m": 80, "block_n": 128, "slice": 128, "stages": 2}
    assert fam.problems(base) == [] and bwd_mod.dq_swap(base)
    r = fam.resources(base)
    assert (r["ds_buffers"], r["dq_buffers"], r["dq_swap"]) == (2, 2, True)
    assert r["smem"]["ds"]["bytes"] == 2 * 128 * 80 * 2 and r["smem"]["dq"]["bytes"] == 2 * 64 * 80 * 4
    assert r["smem_bytes"] <= bwd_mod.SMEM_LIMIT
    for kw in ({"causal": True}, {"local": True}, {"softcap": True}):
        bad = fam.problems({**base, **kw})
        assert [k for k, _, _ in bad] == ["block_m"] and "non-causal" in bad[0][2], kw


def test_rowsum_mma_is_e4m3_only():
    """rowsum_mma (fwd.py): refused for 16-bit dtypes before anything compiles (they ran 1-13 % slower
    with it, H200) and with exp_turns (ptxas issued the turn's pass before the exponentials), accepted
    for e4m3; it names its variants `rsm` and keeps spec_max off."""
    from flashgen.generator.families import fwd as fwd_mod
    from flashgen.generator.naming import variant_name

    base = dict(family="fwd", dtype="bf16", head_dim=64, head_dim_v=64, causal=False, local=False, softcap=False,
                pack_gqa=False, block_m=192, block_n=128, stages=2, q_stages=1, consumer_wgs=3, pingpong=True,
                overlap=True, persistent=True, late_pv_wait=True, exp_turns=False, vt_global=False)
    bad = fwd_mod.FAMILY.problems({**base, "rowsum_mma": True})
    assert [(k, v) for k, v, _ in bad] == [("rowsum_mma", True)] and "e4m3" in bad[0][2]
    assert fwd_mod.FAMILY.problems({**base, "dtype": "e4m3", "rowsum_mma": True}) == []
    bad = fwd_mod.FAMILY.problems({**base, "dtype": "e4m3", "rowsum_mma": True, "exp_turns": True})
    assert [(k, v) for k, v, _ in bad] == [("rowsum_mma", True)] and "exp_turns" in bad[0][2]
    assert fwd_mod.spec_max(base) and not fwd_mod.spec_max({**base, "rowsum_mma": True})
    assert "_ps_rsm_" in variant_name({**base, "dtype": "e4m3", "rowsum_mma": True})
