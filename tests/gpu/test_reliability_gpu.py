"""Reliability of the launch path: many threads and streams at once, and the caller's CUDA device
and context left as they were.

What each part proves (each can fail on a buggy runtime):

* Threads and streams: 8 Python threads, each on its own torch stream, call flash_attn_func,
  flashgen.dlpack_api.flash_attn_forward, flash_attn_combine and flash_attn_combine_dlpack at once
  over a mix of problems (fp16 / bf16, head_dim 64 / 128 / 256, causal or not, odd lengths, GQA and
  MQA, combine with 2..64 splits into fp32 / bf16 / fp16) and every call reproduces, bit for bit,
  the same call made alone. So no launch state is shared mutably between calls (params buffers,
  argument arrays, tensor maps, kernel and plan caches), and every launch goes to the calling
  thread's current stream: outputs are poisoned with NaN behind a sleep kernel on that stream
  before release, and the next calls reuse those blocks, so a kernel sent to any other stream
  runs before the poison lands and comes out NaN (a launch that never ran shows NaN too). Seen
  failing on an H200 pair with the torch API's stream lookup replaced by one cached per process.
* Current device and context (two GPUs): a call on tensors of the other GPU, through any of the
  four entry points, leaves torch's current device and the driver's current context unchanged,
  with either GPU current, and gives the bits of the same call made on the current GPU; 1000 such
  calls leave one retained primary context per device and no leaked context memory.
* Threads without, or with another, context (one GPU): a thread that never touched CUDA still has
  no current context after 500 launches on either GPU (a push left without its pop would show),
  and after a flash_attn_func call; a thread whose current context is a non-primary one it created
  keeps that context current, and its calls (which run in the primary context, where torch's
  memory lives) are correct. All of these were seen failing with launch.device_context's pop
  removed.

Skipped without an sm_90 GPU (tests/gpu/conftest.py); the two-GPU tests also without a second
sm_90 GPU.
"""

from __future__ import annotations

import math
import random
import threading
import traceback
from functools import partial
from typing import NamedTuple

import pytest

torch = pytest.importorskip("torch")
cu = pytest.importorskip("cuda.bindings.driver")

import flashgen.launch as launch  # noqa: E402
from flashgen import core, dlpack_api  # noqa: E402
from flashgen.combine import attention_combine  # noqa: E402
from flashgen.dispatch import select_variant  # noqa: E402
from flashgen.interface import flash_attn_combine, flash_attn_func  # noqa: E402

from _ref import check_fwd, combine_ref  # noqa: E402  (tests/gpu is on sys.path)

pytestmark = pytest.mark.gpu

_NAME = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32"}
THREADS = 8
CALLS = 200  # per thread and test
BATCH = 8  # calls in flight on a thread's stream between two synchronisations
SLEEP_CYCLES = 2_000_000  # torch.cuda._sleep before each poisoning: about 1 ms at H100/H200 clocks

# forward problems: dtype, head_dim, causal, batch, seqlen_q, seqlen_k, heads, heads_k
FWD = [
    (torch.bfloat16, 128, False, 2, 113, 239, 8, 2),
    (torch.float16, 128, True, 1, 239, 113, 4, 4),  # causal, seqlen_q > seqlen_k: rows that see no key
    (torch.bfloat16, 64, True, 2, 1023, 1023, 4, 2),
    (torch.float16, 64, False, 3, 1, 239, 8, 2),  # one query row (decoding)
    (torch.bfloat16, 256, True, 1, 113, 1023, 8, 2),
    (torch.float16, 256, False, 2, 239, 239, 2, 1),  # MQA
    (torch.bfloat16, 64, False, 1, 1023, 113, 8, 8),
    (torch.float16, 64, True, 2, 113, 113, 4, 1),
    (torch.bfloat16, 256, False, 1, 239, 511, 4, 4),
    (torch.float16, 256, True, 1, 1023, 239, 2, 2),
    (torch.bfloat16, 128, True, 1, 511, 1023, 8, 2),
    (torch.float16, 128, False, 2, 1023, 1023, 4, 4),
]
# combine problems: out dtype, num_splits, batch, seqlen, heads, head_dim
COMBINE = [
    (torch.float32, 3, 2, 113, 8, 128),
    (torch.bfloat16, 17, 1, 239, 4, 64),
    (torch.float16, 5, 3, 1, 8, 256),
    (torch.bfloat16, 2, 2, 1023, 2, 128),
    (torch.float32, 64, 2, 7, 8, 62),  # head_dim % 4 != 0: the kernel's scalar path
]


# --------------------------------------------------------------------------------------
# Problems
# --------------------------------------------------------------------------------------

def _built(family, key) -> bool:
    try:
        select_variant(family, key)
        return True
    except Exception:  # MissingVariantError, or no manifest at all
        return False


def _fwd_built(dtype, d, causal) -> bool:
    return _built("fwd", {"dtype": _NAME[dtype], "head_dim": d, "head_dim_v": d, "causal": causal, "local": False, "softcap": False})


def _combine_built(dtype) -> bool:
    return _built("combine", {"dtype": _NAME[dtype]})


def rnd(*shape, dtype=torch.float32, seed=0, device=0):
    """N(0, 1) from a fixed CPU generator (the same numbers on every GPU), moved to cuda:device."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).to(dtype).to(f"cuda:{device}")


def partials(ns, b, s, h, d, seed, device=0):
    """Combine inputs in FA3's layout (lse_partial the transposed view of a (ns, b, h, s) buffer,
    out_partial of a (ns, b, h, s, d) one); splits ns//2.. of batch 0 saw no key (-inf, NaN
    partials that must not be read); with b > 1, head 0 of the last batch has every split empty."""
    g = torch.Generator().manual_seed(seed)
    op = torch.randn(ns, b, h, s, d, generator=g).transpose(2, 3)
    lp = torch.randn(ns, b, h, s, generator=g).transpose(2, 3)
    lp[ns // 2:, 0] = -math.inf
    op[ns // 2:, 0] = math.nan
    if b > 1:
        lp[:, -1, :, 0] = -math.inf
    return op.to(f"cuda:{device}"), lp.to(f"cuda:{device}")


def _fwd_torch(q, k, v, causal):
    return flash_attn_func(q, k, v, causal=causal, return_attn_probs=True)


def _fwd_dlpack(q, k, v, causal):
    return dlpack_api.flash_attn_forward(q, k, v, causal=causal, stream=torch.cuda.current_stream(q.device))


def _combine_torch(op, lp, dtype):
    return flash_attn_combine(op, lp, out_dtype=dtype)


def _combine_dlpack(op, lp, dtype):
    return dlpack_api.flash_attn_combine_dlpack(op, lp, out_dtype=dtype, stream=torch.cuda.current_stream(op.device))


def check_combine(op, lp, out, lse):
    """The float64 merge: out within 2 x its dtype's rounding of it (+ 1e-5), lse to 1e-5."""
    ref, lse_ref = combine_ref(op, lp)
    err = (out.double() - ref).abs().max().item()
    rounding = (ref.to(out.dtype).double() - ref).abs().max().item()
    assert err <= 2 * rounding + 1e-5, f"max|out - ref| = {err:.3e} > 2 x rounding {rounding:.3e} + 1e-5"
    finite = torch.isfinite(lse_ref)
    assert torch.equal(torch.isfinite(lse), finite), "lse is -inf exactly where the reference is"
    torch.testing.assert_close(lse.double()[finite], lse_ref[finite], atol=1e-5, rtol=1e-5)


class Call(NamedTuple):
    name: str
    run: object  # () -> (out, lse), launched on the current stream; fresh outputs every call
    check: object  # (out, lse) -> None, asserts against a float reference


def make_calls(seed: int, device: int = 0) -> list:
    """Every built problem of FWD and COMBINE, each through its torch and its DLPack entry, on
    inputs drawn from `seed` (allocated here, read-only afterwards)."""
    calls = []
    for i, (dt, d, causal, b, sq, sk, h, hk) in enumerate(FWD):
        if not _fwd_built(dt, d, causal):
            continue
        s = 1000 * seed + 10 * i
        q = rnd(b, sq, h, d, dtype=dt, seed=s, device=device)
        k = rnd(b, sk, hk, d, dtype=dt, seed=s + 1, device=device)
        v = rnd(b, sk, hk, d, dtype=dt, seed=s + 2, device=device)
        name = f"fwd {_NAME[dt]} d{d} {'causal' if causal else 'full'} b{b} q{sq} k{sk} h{h}/{hk}"
        chk = partial(check_fwd, q, k, v, causal)
        calls += [Call(name + " [flash_attn_func]", partial(_fwd_torch, q, k, v, causal), chk),
                  Call(name + " [flash_attn_forward]", partial(_fwd_dlpack, q, k, v, causal), chk)]
    for i, (dt, ns, b, s, h, d) in enumerate(COMBINE):
        if not _combine_built(dt):
            continue
        op, lp = partials(ns, b, s, h, d, seed=1000 * seed + 500 + i, device=device)
        name = f"combine {_NAME[dt]} splits{ns} b{b} s{s} h{h} d{d}"
        chk = partial(check_combine, op, lp)
        calls += [Call(name + " [flash_attn_combine]", partial(_combine_torch, op, lp, dt), chk),
                  Call(name + " [flash_attn_combine_dlpack]", partial(_combine_dlpack, op, lp, dt), chk)]
    if not calls:
        pytest.skip("no forward or combine variant of the test's problems is built")
    return calls


def solo(calls, validate: bool) -> list:
    """Each call alone, on the default stream, synchronised: the bits every later call must
    reproduce. validate=True also checks each result against its float reference."""
    refs = []
    for c in calls:
        out, lse = c.run()
        torch.cuda.synchronize()
        assert not out.isnan().any() and not lse.isnan().any(), f"{c.name}: NaN in the solo result"
        if validate:
            try:
                c.check(out, lse)
            except AssertionError as e:
                raise AssertionError(f"{c.name}: the solo result is wrong: {e}") from None
        refs.append((out, lse))
    return refs


# --------------------------------------------------------------------------------------
# Threads
# --------------------------------------------------------------------------------------

def _max_diff(a, b) -> float:
    return (a.double() - b.double()).abs().nan_to_num(math.inf).max().item() if a.numel() else 0.0


def run_calls(stream, calls, refs, order) -> list:
    """calls[j] for j in order on `stream`, BATCH in flight; after synchronising the stream, each
    result is compared bitwise with refs[j], then poisoned with NaN and released. The poison is
    queued behind a ~1 ms sleep kernel, and the next batch's outputs reuse the released blocks: a
    kernel launched on any stream but the caller's runs before the poison lands and its result is
    overwritten with NaN. Returns the mismatches, described."""
    bad = []
    with torch.cuda.stream(stream):
        for start in range(0, len(order), BATCH):
            pending = [(n, j, *calls[j].run()) for n, j in enumerate(order[start:start + BATCH], start)]
            stream.synchronize()
            for n, j, out, lse in pending:
                want_out, want_lse = refs[j]
                if not (torch.equal(out, want_out) and torch.equal(lse, want_lse)):
                    bad.append(f"call {n} {calls[j].name}: max|diff| out {_max_diff(out, want_out):.3g}, "
                               f"lse {_max_diff(lse, want_lse):.3g}")
            torch.cuda._sleep(SLEEP_CYCLES)
            for _, _, out, lse in pending:
                out.fill_(math.nan)
                lse.fill_(math.nan)
            del pending, out, lse  # released to the allocator, for this stream only
    return bad


def in_threads(n: int, body) -> list:
    """body(i, barrier) in n threads started together; their results, or a failure carrying every
    failed thread's traceback (a failing thread breaks the barrier so the others stop too)."""
    barrier = threading.Barrier(n, timeout=120)
    results, errors = [None] * n, {}

    def wrap(i):
        try:
            results[i] = body(i, barrier)
        except BaseException:
            errors[i] = traceback.format_exc()
            barrier.abort()

    threads = [threading.Thread(target=wrap, args=(i,), name=f"flashgen-test-{i}", daemon=True) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    hung = [i for i, t in enumerate(threads) if t.is_alive()]
    assert not hung, f"threads {hung} still running after 300 s"
    assert not errors, "".join(f"--- thread {i} ---\n{tb}" for i, tb in sorted(errors.items()))
    return results


def assert_no_mismatch(results, calls_per_thread: int):
    counts = {i: len(bad) for i, bad in enumerate(results)}
    first = [f"thread {i}: {b}" for i, bad in enumerate(results) for b in bad[:2]][:8]
    assert not any(counts.values()), (
        f"calls whose bits differ from the same call made alone, per thread (of {calls_per_thread} calls "
        f"each): {counts}; first: " + "; ".join(first))


@pytest.fixture(scope="module")
def shared_set():
    """One problem set (seed 0), its solo results checked against the float references."""
    calls = make_calls(seed=0)
    return calls, solo(calls, validate=True)


@pytest.mark.parametrize("inputs", ["own_per_thread", "shared"])
def test_threads_on_own_streams_reproduce_solo_bits(inputs, shared_set):
    """THREADS threads, each in `with torch.cuda.stream(its own stream)`, make CALLS mixed calls
    (all four entries, every problem, in a per-thread random order), with their own inputs or all
    on one shared read-only problem set; every result is bitwise the solo one."""
    if inputs == "shared":
        sets = [shared_set] * THREADS
    else:
        sets = []
        for i in range(THREADS):
            calls = make_calls(seed=i + 1)
            sets.append((calls, solo(calls, validate=False)))
    streams = [torch.cuda.Stream() for _ in range(THREADS)]
    torch.cuda.synchronize()

    def body(i, barrier):
        calls, refs = sets[i]
        rng = random.Random(i)
        order = rng.sample(range(len(calls)), len(calls))  # every call at least once, then at random
        order = (order + [rng.randrange(len(calls)) for _ in range(CALLS)])[:CALLS]
        barrier.wait()
        return run_calls(streams[i], calls, refs, order)

    assert_no_mismatch(in_threads(THREADS, body), CALLS)


def test_same_inputs_from_all_threads_at_once(shared_set):
    """All threads call the same problem on the same input tensors in lockstep (a barrier before
    each round, every problem and entry one round): the same tensors, tensor maps and cached plans
    serve THREADS x BATCH launches in flight on THREADS streams; every result is the solo bits."""
    calls, refs = shared_set
    rounds = random.Random(7).sample(range(len(calls)), len(calls))
    per_round = -(-CALLS // len(rounds))
    streams = [torch.cuda.Stream() for _ in range(THREADS)]
    torch.cuda.synchronize()

    def body(i, barrier):
        bad = []
        for j in rounds:
            barrier.wait()
            bad += run_calls(streams[i], calls, refs, [j] * per_round)
        return bad

    assert_no_mismatch(in_threads(THREADS, body), per_round * len(rounds))


# --------------------------------------------------------------------------------------
# Devices and contexts
# --------------------------------------------------------------------------------------

def _ok(result, what: str):
    """Unpack a cuda.bindings (err, *values) tuple, failing the test on an error."""
    err, *vals = result
    assert int(err) == 0, f"{what} failed: {err!r}"
    return vals[0] if len(vals) == 1 else tuple(vals)


def current_context() -> int:
    """The calling thread's current CUcontext as an int; 0 when it has none."""
    ctx = _ok(cu.cuCtxGetCurrent(), "cuCtxGetCurrent")
    return 0 if ctx is None else int(ctx)


def primary_context(device: int) -> int:
    """The device's primary context (retained and released again: no net retain)."""
    dev = _ok(cu.cuDeviceGet(device), "cuDeviceGet")
    ctx = _ok(cu.cuDevicePrimaryCtxRetain(dev), "cuDevicePrimaryCtxRetain")
    _ok(cu.cuDevicePrimaryCtxRelease(dev), "cuDevicePrimaryCtxRelease")
    return int(ctx)


def create_context(device: int):
    """A new (non-primary) context on `device`, made current on the calling thread."""
    dev = _ok(cu.cuDeviceGet(device), "cuDeviceGet")
    try:
        return _ok(cu.cuCtxCreate(None, 0, dev), "cuCtxCreate")  # cuda-bindings 13: (params, flags, dev)
    except TypeError:
        return _ok(cu.cuCtxCreate(0, dev), "cuCtxCreate")  # cuda-bindings 12: (flags, dev)


def need_gpus(n: int):
    have = torch.cuda.device_count()
    if have < n:
        pytest.skip(f"needs {n} CUDA GPUs, torch.cuda.device_count() = {have}")
    for i in range(n):
        if torch.cuda.get_device_capability(i)[0] != 9:
            pytest.skip(f"needs {n} sm_90 GPUs; cuda:{i} is sm_{''.join(map(str, torch.cuda.get_device_capability(i)))}")


class Small(NamedTuple):
    """A small forward and combine problem on one device."""
    q: object
    k: object
    v: object
    causal: bool
    op: object
    lp: object
    out_dtype: object


def small(device: int) -> Small:
    """The same small problem (fixed CPU seeds) on cuda:device; shapes have no extent-1 dims."""
    fwd = next(((dt, d, c) for dt, d, c, *_ in FWD if _fwd_built(dt, d, c)), None)
    cdt = next((dt for dt in (torch.bfloat16, torch.float16, torch.float32) if _combine_built(dt)), None)
    if fwd is None or cdt is None:
        pytest.skip("needs a built forward and a built combine variant")
    dt, d, causal = fwd
    op, lp = partials(3, 2, 113, 4, 64, seed=21, device=device)
    return Small(rnd(2, 113, 4, d, dtype=dt, seed=11, device=device), rnd(2, 239, 2, d, dtype=dt, seed=12, device=device),
                 rnd(2, 239, 2, d, dtype=dt, seed=13, device=device), causal, op, lp, cdt)


class Foreign:
    """A DLPack producer exporting a torch tensor whatever device is current, as CuPy and JAX
    arrays do (torch.Tensor.__dlpack__ refuses a tensor of a non-current device). The export
    alone runs with the tensor's device current; torch restores the caller's afterwards."""

    def __init__(self, t):
        self.t, self.dtype, self.shape = t, t.dtype, tuple(t.shape)

    def __dlpack_device__(self):
        return self.t.__dlpack_device__()

    def __dlpack__(self, **kw):
        with torch.cuda.device(self.t.device):
            return self.t.__dlpack__(**kw)


def entry_calls(p: Small) -> dict:
    """The four entry points on p's tensors: name -> () -> (out, lse) on p's device. The DLPack
    calls get Foreign-wrapped inputs and preallocated outputs (rewritten by every call)."""
    dev = p.q.device
    b, sq, h, d = p.q.shape
    _, _, s, hc, dc = p.op.shape
    fwd_out = (torch.empty(b, sq, h, d, dtype=p.q.dtype, device=dev), torch.empty(b, h, sq, device=dev))
    comb_out = (torch.empty(b, s, hc, dc, dtype=p.out_dtype, device=dev), torch.empty(b, hc, s, device=dev).transpose(1, 2))

    def fwd_dlpack():
        dlpack_api.flash_attn_forward(*map(Foreign, (p.q, p.k, p.v)), causal=p.causal, out=Foreign(fwd_out[0]),
                                      lse=Foreign(fwd_out[1]), stream=torch.cuda.current_stream(dev))
        return fwd_out

    def combine_dlpack():
        dlpack_api.flash_attn_combine_dlpack(Foreign(p.op), Foreign(p.lp), out=Foreign(comb_out[0]),
                                             lse=Foreign(comb_out[1]), out_dtype=_NAME[p.out_dtype],
                                             stream=torch.cuda.current_stream(dev))
        return comb_out

    return {"flash_attn_func": partial(_fwd_torch, p.q, p.k, p.v, p.causal),
            "flash_attn_combine": partial(_combine_torch, p.op, p.lp, p.out_dtype),
            "flash_attn_forward": fwd_dlpack,
            "flash_attn_combine_dlpack": combine_dlpack}


def core_calls(p: Small, stream: int) -> dict:
    """Torch-free launches through flashgen's core (where both APIs end), into outputs allocated
    here: name -> () -> (out, lse). `stream` is a CUstream handle of p's device."""
    dev = p.q.device.index
    b, sq, h, d = p.q.shape
    _, _, s, hc, dc = p.op.shape
    fwd_out = (torch.empty(b, sq, h, d, dtype=p.q.dtype, device=p.q.device), torch.empty(b, h, sq, device=p.q.device))
    comb_out = (torch.empty(b, s, hc, dc, dtype=p.out_dtype, device=p.q.device),
                torch.empty(b, hc, s, device=p.q.device).transpose(1, 2))

    def arg(t):
        return core.TensorArg(t.data_ptr(), tuple(t.shape), tuple(t.stride()), _NAME[t.dtype], dev)

    def fwd():
        core.attention_forward(*map(arg, (p.q, p.k, p.v, *fwd_out)), d ** -0.5, p.causal, stream)
        return fwd_out

    def combine():
        attention_combine(*map(arg, (p.op, p.lp, *comb_out)), _NAME[p.out_dtype], stream)
        return comb_out

    return {"core.attention_forward": fwd, "combine.attention_combine": combine}


def assert_unchanged(what: str, device: int, ctx: int):
    now = current_context()
    assert now == ctx, f"{what} changed this thread's current CUDA context from {ctx:#x} to {now:#x}"
    cur = torch.cuda.current_device()
    assert cur == device, f"{what} changed torch's current device from cuda:{device} to cuda:{cur}"
    idx = torch.empty(1, device="cuda").device.index
    assert idx == device, f"after {what}, torch.empty(device='cuda') lands on cuda:{idx}, not cuda:{device}"


def assert_same_bits(got: dict, want: dict, where: str):
    for name, (w_out, w_lse) in want.items():
        g_out, g_lse = (t.to(w_out.device) for t in got[name])
        assert torch.equal(g_out, w_out) and torch.equal(g_lse, w_lse), (
            f"{name} {where}: result differs from the same call on cuda:{w_out.device.index} "
            f"(max|diff| out {_max_diff(g_out, w_out):.3g}, lse {_max_diff(g_lse, w_lse):.3g})")


@pytest.mark.parametrize("current,target", [(0, 1), (1, 0)], ids=["cuda0_current-tensors_on_cuda1",
                                                                   "cuda1_current-tensors_on_cuda0"])
def test_call_on_other_gpu_keeps_device_and_context(current, target):
    """With cuda:current current, each entry point on cuda:target tensors returns outputs on
    cuda:target with the bits of the same call made on cuda:current (and a forward within FA3's
    rule), and leaves torch's current device, where torch.empty(device="cuda") lands, and the
    driver's current context as they were."""
    need_gpus(2)
    with torch.cuda.device(current):
        home = small(current)
        want = {name: tuple(t.clone() for t in run()) for name, run in entry_calls(home).items()}
        torch.cuda.synchronize(current)
    away = small(target)
    runs = entry_calls(away)
    got = {}
    with torch.cuda.device(current):
        torch.empty(1, device="cuda")
        ctx = current_context()
        assert ctx == primary_context(current), "precondition: torch made cuda:current's primary context current"
        for name, run in runs.items():
            res = run()
            assert_unchanged(f"{name} on cuda:{target} tensors", current, ctx)
            assert all(t.device == torch.device("cuda", target) for t in res), \
                f"{name}: outputs on {[str(t.device) for t in res]}, inputs on cuda:{target}"
            got[name] = tuple(t.clone() for t in res)
    torch.cuda.synchronize(target)
    assert_same_bits(got, want, f"on cuda:{target} with cuda:{current} current")
    check_fwd(away.q, away.k, away.v, away.causal, *got["flash_attn_func"])


def test_many_calls_on_other_gpu_leak_no_context():
    """1000 calls (all four entries) on cuda:1 tensors with cuda:0 current: the current context is
    still cuda:0's primary one, launch._primary holds exactly the primary context of each device
    it names (one entry per device, no per-call or per-thread contexts) and those are active, and
    cuda:1's free memory did not drop by a context's worth (a leaked context costs hundreds of MiB)."""
    need_gpus(2)
    runs = list(entry_calls(small(1)).values())
    for run in runs:
        run()  # warm: kernels loaded, the allocator's blocks cached
    torch.cuda.synchronize(1)
    free_before = torch.cuda.mem_get_info(1)[0]
    with torch.cuda.device(0):
        torch.empty(1, device="cuda")
        ctx = current_context()
        for i in range(1000):
            runs[i % len(runs)]()
        assert_unchanged("1000 calls on cuda:1 tensors", 0, ctx)
    torch.cuda.synchronize(1)
    assert 1 in launch._primary, "no primary context recorded for cuda:1 after launching there"
    assert set(launch._primary) <= set(range(torch.cuda.device_count())), f"keys {sorted(launch._primary)}"
    for dev, pctx in launch._primary.items():
        assert int(pctx) == primary_context(dev), f"launch._primary[{dev}] is not cuda:{dev}'s primary context"
        _, active = _ok(cu.cuDevicePrimaryCtxGetState(_ok(cu.cuDeviceGet(dev), "cuDeviceGet")),
                        "cuDevicePrimaryCtxGetState")
        assert active, f"cuda:{dev}'s primary context is not active"
    drop = free_before - torch.cuda.mem_get_info(1)[0]
    assert drop < 256 << 20, f"cuda:1 free memory dropped by {drop >> 20} MiB over 1000 calls"


@pytest.mark.parametrize("device", [0, 1])
def test_thread_without_context_keeps_none(device):
    """A new thread (no current context) makes 500 launches on cuda:device through the core entry,
    alternating forward and combine; after every one it still has no current context (a pushed
    context left without its pop, even the primary one, would be current), and the results are the
    bits of the torch API's call. The core entry is torch-free on purpose: torch's own device guard
    binds a context to any thread that allocates on a device other than its current one."""
    need_gpus(device + 1)
    p = small(device)
    with torch.cuda.device(device):
        want = {"core.attention_forward": _fwd_torch(p.q, p.k, p.v, p.causal),
                "combine.attention_combine": _combine_torch(p.op, p.lp, p.out_dtype)}
        runs = core_calls(p, torch.cuda.current_stream(device).cuda_stream)
    torch.cuda.synchronize(device)

    def body(i, barrier):
        before = current_context()
        assert before == 0, f"precondition: a new thread has no current context, got {before:#x}"
        names, last, stuck = list(runs), {}, []
        for n in range(500):
            last[names[n % 2]] = runs[names[n % 2]]()
            if current_context() != 0:
                stuck.append(n)
        assert not stuck, (f"{len(stuck)} of 500 launches on cuda:{device} left a context current in a thread "
                           f"that had none (first: calls {stuck[:3]})")
        return last

    (got,) = in_threads(1, body)
    torch.cuda.synchronize(device)
    assert_same_bits(got, want, f"from a thread without a context on cuda:{device}")


def torch_entries_warmed(p: Small):
    """The two torch entries on p (name -> call), their solo results, and torch's allocator warmed:
    each call is made once more and its outputs freed, so blocks of exactly the outputs' sizes sit
    in the cache for the default stream. A call from another thread then reuses them, and torch
    itself makes no CUDA call there that could bind or use that thread's context."""
    runs = {"flash_attn_func": partial(_fwd_torch, p.q, p.k, p.v, p.causal),
            "flash_attn_combine": partial(_combine_torch, p.op, p.lp, p.out_dtype)}
    want = {n: tuple(t.clone() for t in run()) for n, run in runs.items()}
    for run in runs.values():
        run()
    torch.cuda.synchronize()
    return runs, want


def test_thread_without_context_torch_api():
    """(one GPU) A new thread with no current context calls flash_attn_func and flash_attn_combine
    on cuda:0 tensors; afterwards it still has no current context, and the results are the solo
    bits. The outputs reuse blocks torch's allocator already caches, and the thread first checks
    that this torch-only allocation binds no context (else the test is skipped: torch's doing)."""
    need_gpus(1)
    p = small(0)
    runs, want = torch_entries_warmed(p)

    def body(i, barrier):
        assert current_context() == 0, "precondition: a new thread has no current context"
        for out, lse in want.values():  # torch alone: same-sized outputs from the cache
            torch.empty_like(out), torch.empty(lse.shape, device=lse.device)
        if current_context() != 0:
            return None
        got = {}
        for name, run in runs.items():
            got[name] = run()
            now = current_context()
            assert now == 0, f"{name} left context {now:#x} current in a thread that had none"
        return got

    (got,) = in_threads(1, body)
    if got is None:
        pytest.skip("torch bound a context to the thread by itself (allocating the outputs)")
    torch.cuda.synchronize()
    assert_same_bits(got, want, "from a thread without a context")


def test_thread_with_other_context_keeps_it():
    """(one GPU) A thread makes a new non-primary context current (cuCtxCreate), then calls
    flash_attn_func and flash_attn_combine on cuda:0 tensors torch allocated (in the primary
    context): after each call its own context is still current, and the results are the solo bits
    (the launches ran in the primary context, where the memory lives). The context is destroyed at
    the end. The outputs reuse blocks torch's allocator caches (torch must not cudaMalloc in the
    thread's own context); torch's reserved memory is checked unchanged."""
    need_gpus(1)
    p = small(0)
    runs, want = torch_entries_warmed(p)
    reserved = torch.cuda.memory_reserved(0)

    def body(i, barrier):
        ctx = create_context(0)
        try:
            mine = int(ctx)
            assert mine != primary_context(0) and current_context() == mine, "precondition: own context current"
            got = {}
            for name, run in runs.items():
                got[name] = run()
                now = current_context()
                assert now == mine, f"{name} replaced the thread's own context {mine:#x} with {now:#x}"
            return got
        finally:
            _ok(cu.cuCtxDestroy(ctx), "cuCtxDestroy")

    (got,) = in_threads(1, body)
    torch.cuda.synchronize()
    assert torch.cuda.memory_reserved(0) == reserved, "torch allocated new memory from the thread (test setup)"
    assert_same_bits(got, want, "from a thread with its own context current")
    check_fwd(p.q, p.k, p.v, p.causal, *got["flash_attn_func"])
