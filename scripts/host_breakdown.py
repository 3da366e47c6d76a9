"""Where flash_attn_func's host time per call goes (issue 11's < 20 us goal), on a GPU machine.

Times, on bench.measure_overhead's small problem (q, k, v (1, 128, 1, 128) bf16), the whole call and
each step of its eager fast path on its own (bench.host_us: best of 5 alternated runs of 2000 back-to-back
repetitions; microseconds per repetition), so the steps that cost can be told from the ones that do not
(scripts/overhead_profile.py gives cProfile's view of the same calls):

    python3 scripts/host_breakdown.py [--causal]

The steps are re-done outside the call (the same functions on the same objects), so their sum is only
close to the whole; the launch steps enqueue real kernels.
"""
import argparse
import ctypes
import sys

import torch


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--causal", action="store_true")
    a = ap.parse_args()
    from flashgen import bench, core, interface, launch

    causal = a.causal
    q, k, v = (torch.randn(1, 128, 1, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    interface.flash_attn_func(q, k, v, causal=causal)
    dev = interface._device_of

    def cache_key():  # flash_attn_func's key of this call (timed below as a step)
        return (q.shape, q.stride(), q.dtype, dev(q), k.shape, k.stride(), k.dtype, dev(k), v.shape, v.stride(),
                v.dtype, dev(v), causal, -1, -1, False, None, None)

    key = cache_key()
    call = interface._fwd_calls.get(key)
    assert call is not None, "the cache key of this script is not flash_attn_func's"
    prep = call.launch
    out = q.new_empty(size=call.out_shape, dtype=call.out_dtype)
    lse = q.new_empty(size=call.lse_shape, dtype=torch.float32)
    stream = interface._current_stream(0)
    ptrs = (q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr(), lse.data_ptr())
    mq, mk, mv, mo = prep.maps
    maps = tuple(launch.tensor_map_at(m, p) for m, p in zip(prep.maps, ptrs[:4]))
    values = (ptrs[4], ptrs[3], 0, 0, 0, 0, 0.1, 0.1, 0.0)
    lp = prep.launch

    def argblock():  # the kernel's argument block, packed as launch_forward packs it (timed below as a step)
        b = lp.block_type()
        lp.pack_block(b, 0, *lp.arrange((*[m.getPtr() for m in maps], ctypes.addressof(b) + lp.head, *values,
                                         *lp.chunks)))
        return b

    block = argblock()
    d = launch._driver()
    kern = lp.kernel
    rec = kern.record
    hstream = launch._streams.get(stream) or launch._stream(stream)
    sdpa = torch.nn.functional.scaled_dot_product_attention

    steps = [
        ("flash_attn_func (whole call)", lambda: interface.flash_attn_func(q, k, v, causal=causal)),
        ("  cache key (shapes, strides, dtypes, devices)", cache_key),
        ("  _fwd_calls.get(key)", lambda: interface._fwd_calls.get(key)),
        ("  capability check", lambda: interface._check_device_capability(0)),
        ("  new_empty x 2 (out; lse only with return_attn_probs)", lambda: (q.new_empty(size=call.out_shape, dtype=call.out_dtype),
                                                q.new_empty(size=call.lse_shape, dtype=torch.float32))),
        ("  data_ptr x 5", lambda: (q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr(), lse.data_ptr())),
        ("  current stream", lambda: interface._current_stream(0)),
        ("  core.launch_forward (all below)",
         lambda: core.launch_forward(prep, *ptrs, 0.1, 0.0, stream)),
        ("    softmax_constants", lambda: core.softmax_constants(0.1, 0.0)),
        ("    tensor_map_at x 4", lambda: (launch.tensor_map_at(mq, ptrs[0]), launch.tensor_map_at(mk, ptrs[1]),
                                           launch.tensor_map_at(mv, ptrs[2]), launch.tensor_map_at(mo, ptrs[3]))),
        ("    argument block (ctypes + getPtr x 4 + pack)", argblock),
        ("    _launch_argv (context check, causal: tile counter, launch)",
         lambda: launch._launch_argv(kern, lp.grid, block, stream, lp.counter, block)),
        ("      cuCtxGetCurrent", lambda: d.cuCtxGetCurrent()),
        ("      cuLaunchKernel alone",
         lambda: d.cuLaunchKernel(kern.function, *lp.grid, rec.threads, 1, 1, rec.smem_bytes, hstream,
                                  ctypes.addressof(block), 0)),
        ("sdpa (BSHD views per call)",
         lambda: sdpa(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=causal)),
    ]
    print(f"# {torch.cuda.get_device_name()}: host us per call, causal={causal}, variant {call.launch.plan.variant.name}")
    print("| step | us |")
    print("|---|---|")
    for name, us in bench.host_us(steps).items():
        print(f"| {name} | {us:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
