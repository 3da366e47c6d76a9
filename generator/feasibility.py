"""What a variant costs on the GPU, and whether it can exist at all.

:func:`fwd_resources` is the single source of the derived numbers: the template receives them as
Jinja variables and the manifest records them. :func:`fwd_problems` lists the reasons a point is
infeasible (checked before anything is rendered or compiled).

Rules (sm_90a, our forward kernel's layout):

- head_dim in {64, 96, 128, 192, 256}; head_dim_v == head_dim for now.
- block_n a multiple of 16 in [16, 256]: it is the N of the S = Q K^T WGMMA (N multiple of 8,
  at most 256) and the PV GEMM steps k16 over it.
- consumer_wgs in {2, 3} and block_m == 64 * consumer_wgs (each consumer warpgroup owns 64 rows).
- stages in 1..4.
- Dynamic shared memory (P = head_dim rounded up to 64, E = 2 bytes):
  Q block_m*P*E + K stages*block_n*P*E + V stages*block_n*Pv*E + 1024 (mbarriers) + 1024
  (alignment slack) must be <= 227 KB = 232448 bytes; O's staging buffer block_m*Pv*E is added
  when it still fits (separate_o), else O is staged in Q's buffer.
- Registers (setmaxnreg): 2 consumer WGs get 240 regs/thread, 3 get 160 (producer 24 / 32).
  With 3 consumer WGs: head_dim_padded <= 128 and block_n <= 128. For both, the fp32 S accumulator
  (block_n/2), O accumulator (head_dim_v_padded/2) and packed P (block_n/4) registers per thread
  must leave 32 for addresses and softmax state: block_n/2 + head_dim_v_padded/2 + block_n/4 <=
  consumer_regs - 32 (208 with 2 consumer WGs, 128 with 3: hd64 at block_n 128 fits, hd96 does
  not -- it spilled when tried).
"""
from __future__ import annotations

SMEM_LIMIT = 232448  # 227 KB: the sm_90 per-block opt-in maximum of dynamic shared memory
HEAD_DIMS = (64, 96, 128, 192, 256)
DTYPES = ("bf16", "fp16")
DTYPE_BYTES = {"bf16": 2, "fp16": 2}
CONSUMER_WGS = (2, 3)
STAGES = (1, 2, 3, 4)
BARRIER_BYTES = 1024
ALIGN_SLACK_BYTES = 1024
REG_SPLIT = {2: (24, 240), 3: (32, 160)}  # consumer_wgs -> (producer_regs, consumer_regs)
ACC_REG_HEADROOM = 32


def _pad64(x: int) -> int:
    return -(-int(x) // 64) * 64


def fwd_resources(params: dict) -> dict:
    """Derived launch/resource numbers of a forward variant.

    Returns ``dict(threads, smem_bytes, producer_regs, consumer_regs, head_dim_padded,
    head_dim_v_padded, separate_o)``. Assumes the params passed the type checks (ints where ints belong)."""
    wgs = int(params["consumer_wgs"])
    e = DTYPE_BYTES.get(params["dtype"], 2)
    p = _pad64(params["head_dim"])
    pv = _pad64(params.get("head_dim_v", params["head_dim"]))
    bm, bn, st = int(params["block_m"]), int(params["block_n"]), int(params["stages"])
    smem = bm * p * e + st * bn * p * e + st * bn * pv * e + BARRIER_BYTES + ALIGN_SLACK_BYTES
    # O gets its own staging buffer when it fits (Q is then released after the tile's last S GEMM
    # and the next tile's Q load overlaps the epilogue); otherwise it is staged in Q's buffer.
    o_bytes = bm * pv * e
    separate_o = smem + o_bytes <= SMEM_LIMIT
    if separate_o:
        smem += o_bytes
    producer_regs, consumer_regs = REG_SPLIT.get(wgs, (24, 240))
    return dict(
        threads=128 * (wgs + 1),
        smem_bytes=smem,
        producer_regs=producer_regs,
        consumer_regs=consumer_regs,
        head_dim_padded=p,
        head_dim_v_padded=pv,
        separate_o=separate_o,
    )


def fwd_problems(params: dict) -> list[tuple[str, object, str]]:
    """Every reason this forward point cannot be built: ``[(key, value, what is allowed)]``.

    Empty list = feasible. Value-range problems of single keys come first; the combined checks
    (block_m vs consumer_wgs, shared memory, registers) run only when the keys they use are sane."""
    out: list[tuple[str, object, str]] = []
    hd, hdv = params["head_dim"], params.get("head_dim_v", params["head_dim"])
    bm, bn, wgs, st = params["block_m"], params["block_n"], params["consumer_wgs"], params["stages"]
    if params["dtype"] not in DTYPES:
        out.append(("dtype", params["dtype"], f"one of {', '.join(DTYPES)}"))
    if hd not in HEAD_DIMS:
        out.append(("head_dim", hd, f"one of {', '.join(map(str, HEAD_DIMS))}"))
    if hdv != hd:
        out.append(("head_dim_v", hdv, f"equal to head_dim ({hd}) for now"))
    if not (isinstance(bn, int) and 16 <= bn <= 256 and bn % 16 == 0):
        out.append(("block_n", bn, "a multiple of 16 in [16, 256] (WGMMA N <= 256; the PV GEMM steps k16 over block_n)"))
    if wgs not in CONSUMER_WGS:
        out.append(("consumer_wgs", wgs, "2 or 3"))
    elif bm != 64 * wgs:
        out.append(("block_m", bm, f"64 * consumer_wgs = {64 * wgs} (consumer_wgs is {wgs})"))
    if st not in STAGES:
        out.append(("stages", st, "1..4"))
    if out:
        return out
    r = fwd_resources(params)
    n_before = 0
    if r["smem_bytes"] > SMEM_LIMIT:
        out.append((
            "smem_bytes", r["smem_bytes"],
            f"at most {SMEM_LIMIT} (227 KB); Q {bm}x{r['head_dim_padded']} + {st} stages x K/V "
            f"{bn}x{r['head_dim_padded']} x 2 bytes + 2048: lower block_n or stages",
        ))
    n_before = len(out)
    if wgs == 3:
        if r["head_dim_padded"] > 128:
            out.append(("head_dim", hd, "<= 128 with 3 consumer warpgroups (160 registers/thread); use consumer_wgs 2"))
        if bn > 128:
            out.append(("block_n", bn, "<= 128 with 3 consumer warpgroups (160 registers/thread)"))
    if len(out) == n_before:
        need = bn // 2 + r["head_dim_v_padded"] // 2 + bn // 4
        limit = r["consumer_regs"] - ACC_REG_HEADROOM
        if need > limit:
            out.append((
                "block_n", bn,
                f"small enough that the accumulators fit: block_n/2 + head_dim_v_padded/2 + block_n/4 = {need} "
                f"registers > {limit} ({r['consumer_regs']} per consumer thread with {wgs} consumer warpgroups, "
                f"minus {ACC_REG_HEADROOM} headroom); lower block_n"
                + (" or use consumer_wgs 2" if wgs == 3 else ""),
            ))
    return out
