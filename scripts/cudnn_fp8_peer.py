"""cuDNN's FP8 (e4m3) attention forward, as a peer for the e4m3 benchmarks (issue 10: "if cuDNN's FP8
SDPA from nvidia-cudnn-frontend can be installed on the GPU machine, compare in the same run").

PyTorch's SDPA has no FP8 path; this builds cuDNN's ``sdpa_fp8`` graph through the cuDNN frontend's
Python API (``pip install nvidia-cudnn-frontend``, or ``bash scripts/fetch_peer_wheels.sh`` for a machine
without an index: device_check.sh installs from ``.wheels/``). The backend library is the libcudnn that
torch loaded.

What cuDNN computes here: e4m3 Q, K, V in flashgen's BSHD layout (given to cuDNN as (b, h, s, d) with
BSHD strides), per-tensor fp32 descales of 1 (q, k, v, s) and scales of 1 (s, o), softmax_scale
1/sqrt(head_dim), causal top-left (equal to FA3's bottom-right at seqlen_q == seqlen_k, the only
shapes benchmarked), no LSE (inference). On Hopper cuDNN writes O in e4m3 (flashgen writes bf16, twice
the bytes); the amax outputs are written too (one float each). ``check`` compares cuDNN's O with
flashgen's on the same inputs, so a table never times a graph that computes something else.

Usage (a library for scripts/fp8_bench.py): ``fn, why = cudnn_fp8_fn(q8, k8, v8, causal)``; ``fn`` is
None when cuDNN cannot serve the call, and ``why`` says why."""
from __future__ import annotations

import functools
import math


def _cudnn():
    try:
        import cudnn  # nvidia-cudnn-frontend
    except Exception as e:  # not installed, or no libcudnn to load
        return None, f"cudnn frontend not importable ({type(e).__name__}: {e})"
    return cudnn, ""


@functools.lru_cache(maxsize=None)
def _handle(device_index: int):
    """One cuDNN handle per device for the benchmark process (a handle per graph would leak one per point)."""
    cudnn, _ = _cudnn()
    return cudnn.create_handle()


def available() -> str:
    """'' when the frontend imports, else the reason (for a table's header)."""
    return _cudnn()[1]


def cudnn_fp8_fn(q8, k8, v8, causal: bool):
    """A zero-argument callable running cuDNN's FP8 SDPA forward on q8, k8, v8 ((batch, seqlen, heads,
    head_dim) torch.float8_e4m3fn, contiguous, equal shapes), writing a fresh e4m3 O held by the
    callable (``fn.out``, BSHD); or (None, reason) when cuDNN has no plan for it. Returns (fn, reason)."""
    import torch

    cudnn, why = _cudnn()
    if cudnn is None:
        return None, why
    b, s, h, d = q8.shape
    dims, strides = (b, h, s, d), (s * h * d, d, h * d, 1)  # BSHD memory seen as (b, h, s, d)
    e4m3, f32 = cudnn.data_type.FP8_E4M3, cudnn.data_type.FLOAT
    try:
        handle = _handle(q8.device.index)
        cudnn.set_stream(handle=handle, stream=torch.cuda.current_stream(q8.device).cuda_stream)
        graph = cudnn.pygraph(io_data_type=e4m3, intermediate_data_type=f32, compute_data_type=f32, handle=handle)
        tq, tk, tv = (graph.tensor(name=n, dim=dims, stride=strides, data_type=e4m3) for n in ("q", "k", "v"))
        scalar = dict(dim=(1, 1, 1, 1), stride=(1, 1, 1, 1), data_type=f32)
        names = ("descale_q", "descale_k", "descale_v", "descale_s", "scale_s", "scale_o")
        sc = {n: graph.tensor(name=n, **scalar) for n in names}
        o, _, amax_s, amax_o = graph.sdpa_fp8(q=tq, k=tk, v=tv, **sc, is_inference=True,
                                               attn_scale=1.0 / math.sqrt(d), use_causal_mask=causal, name="sdpa_fp8")
        o.set_output(True).set_dim(dims).set_stride(strides).set_data_type(e4m3)
        for t in (amax_s, amax_o):
            t.set_output(True).set_dim((1, 1, 1, 1)).set_stride((1, 1, 1, 1)).set_data_type(f32)
        graph.validate()
        graph.build_operation_graph()
        graph.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
        graph.check_support()
        graph.build_plans()
    except Exception as e:  # cudnnGraphNotSupportedError and friends: no plan for this shape
        return None, f"cuDNN has no FP8 plan ({type(e).__name__}: {str(e).splitlines()[0][:160]})"
    out = torch.empty_like(q8)
    ones = {n: torch.ones(1, 1, 1, 1, device=q8.device) for n in names}
    amax = [torch.empty(1, 1, 1, 1, device=q8.device) for _ in range(2)]
    pack = {tq: q8, tk: k8, tv: v8, o: out, amax_s: amax[0], amax_o: amax[1], **{sc[n]: ones[n] for n in names}}
    ws = torch.empty(graph.get_workspace_size(), device=q8.device, dtype=torch.uint8)

    def fn():
        graph.execute(pack, ws, handle=handle)
        return out

    fn.out = out
    return fn, ""


def check(fn, reference) -> float:
    """Largest |cuDNN O - reference| over the elements (reference: flashgen's O on the same inputs,
    any float dtype), after one run of ``fn``; e4m3 O carries about 2^-4 relative rounding."""
    fn()
    return float((fn.out.float() - reference.float()).abs().max())
