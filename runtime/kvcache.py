"""FA3's ``flash_attn_with_kvcache`` (decoding with a KV cache): the append and the checks on the host.

The call appends the new keys / values to the cache in place (rotated by the rotary embedding
when given), then runs each batch entry's attention over its cache rows with
:func:`flashgen.flash_attn_func`. The per-entry lengths (``cache_seqlens``, ``cache_leftpad``,
``cache_batch_idx``, ``cu_seqlens_q``, ``cu_seqlens_k_new``, ``rotary_seqlens``) are read on the
host, a synchronisation when they are GPU tensors. The rotary embedding of q and the append of every
entry's new tokens are one op each over all entries (an index_put into the cache). Neighbouring entries
with the same lengths and consecutive cache rows share one call (a view of the cache); a paged cache is
gathered into one contiguous copy per entry. Under torch.compile the read of the lengths is a graph break
(``fullgraph=True`` refuses the call). With the varlen kernel (flashgen.core.VARLEN_KERNEL, on unless
``FLASHGEN_VARLEN_KERNEL=0``), a call in fp16 / bf16 without attention_chunk (nor softcap while
flashgen.core.VARLEN_SOFTCAP is off) is one launch instead,
which reads each entry's total length (``seqused_k``), cache row, left padding or pages itself
(interface._varlen_kernel; pages of a multiple of 8 rows, without cache_leftpad). Under CUDA-graph capture
such a call (a padded q, new k / v of (batch, seqlen_new, ...)) reads no length on the host at all
(:func:`_step_on_device`), so a decode step can be captured and replayed for new cache_seqlens; with
cache_seqlens an int or None (one length for all entries) it is one flash_attn_func call on the cache's first
rows, with or without the varlen kernel. Eager calls take the same path while flashgen.core.VARLEN_NO_HOST_READ
is on (the default; ``FLASHGEN_VARLEN_NO_HOST_READ=0`` turns it off) and every length tensor is on q's device: no
synchronisation, the lengths checked on the GPU; a call that path refuses reads them on the host as above.

Semantics (FA3's hopper/flash_attn_interface.py and test_flash_attn.py::test_flash_attn_kvcache):

* entry b reads cache row ``cache_batch_idx[b]`` (default b) of ``k_cache`` / ``v_cache``
  ``(batch_cache, seqlen_cache, heads_k, d)``, or, with ``page_table`` ``(batch, pages)``, the pages
  ``page_table[b]`` of ``(num_blocks, page_size, heads_k, d)`` caches in order;
* new ``k`` / ``v`` (``(batch, seqlen_new, heads_k, d)``, or ``(total_new, heads_k, d)`` with
  ``cu_seqlens_k_new``) are written at positions ``[cache_seqlens[b], cache_seqlens[b] + seqlen_new_b)``;
* entry b attends to the cache positions ``[cache_leftpad[b], cache_seqlens[b] + seqlen_new_b)``
  (all of the cache when cache_seqlens is None), bottom-right aligned causal / window masks on them;
* rotary (``rotary_cos`` / ``rotary_sin`` ``(seqlen_ro, rotary_dim / 2)``, new k / v required):
  the first rotary_dim dims of the new keys at positions ``r_b + i`` and of q at ``r_b + i``
  (causal or local) or ``r_b`` (otherwise), ``r_b = rotary_seqlens[b]`` or ``cache_seqlens[b]``;
  GPT-NeoX halves, or interleaved pairs with ``rotary_interleaved`` (FA3's default); computed in
  float32 and rounded once.
"""

from __future__ import annotations

import math
from typing import NamedTuple, Optional

import torch

from . import _validate as _v
from . import core as _core
from . import launch as _launch
from . import varlen_prep as _varlen_prep
from .generator.families.varlen_prep import kvcache_messages
from .interface import (_FWD_CALL_CACHE_MAX, _attend, _capturing, _check_fwd, _current_stream, _device_of,
                        _host_ints, _on_q_device, _out_dtype, _splits_arg, _varlen_kernel, _varlen_kernel_serves,
                        _varlen_prep_on)

__all__ = ["flash_attn_with_kvcache", "get_scheduler_metadata", "apply_rotary"]


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor,
                 interleaved: bool) -> torch.Tensor:
    """x ``(..., seqlen, heads, d)`` with its first ``rotary_dim = 2 * cos.shape[1]`` dims rotated at
    ``positions`` (int64, x's seqlen shape, broadcast over heads): ``x_r cos + rotate(x_r) sin``
    with ``rotate(a, b) = (-b, a)`` over the two halves of x_r (GPT-NeoX) or over its even / odd
    pairs (``interleaved``), as FA3's ``apply_rotary_emb``; in float32, rounded to x's dtype once."""
    rd = 2 * cos.shape[1]
    c = cos.float()[positions].unsqueeze(-2)  # (..., seqlen, 1, rd / 2)
    s = sin.float()[positions].unsqueeze(-2)
    xr = x[..., :rd].float()
    if interleaved:
        x1, x2 = xr[..., 0::2], xr[..., 1::2]
        rot = torch.stack((x1 * c - x2 * s, x1 * s + x2 * c), dim=-1).flatten(-2)
    else:
        x1, x2 = xr[..., :rd // 2], xr[..., rd // 2:]
        rot = torch.cat((x1 * c - x2 * s, x1 * s + x2 * c), dim=-1)
    return torch.cat((rot.to(x.dtype), x[..., rd:]), dim=-1)


def _check_new_kv(k, v, batch: int, cache_seqlens) -> None:
    """ValueError unless new k / v (None, or padded ``(batch, seqlen_new, heads_k, ...)`` alike) come with the
    cache_seqlens that place them."""
    if k is None:
        return
    if k.dim() != 4 or v.dim() != 4 or k.shape[0] != batch or k.shape[:3] != v.shape[:3]:
        raise ValueError(f"flashgen: k and v must be (batch = {batch}, seqlen_new, heads_k, ...) with the same first "
                         f"three dims, got {tuple(k.shape)} and {tuple(v.shape)}")
    if cache_seqlens is None:
        raise ValueError("flashgen: cache_seqlens is needed to append k / v (where the new tokens go)")


def _check_rotary(cos: torch.Tensor, sin: torch.Tensor, head_dim: int) -> None:
    """ValueError unless rotary_cos / rotary_sin are ``(seqlen_ro, rotary_dim / 2)`` alike, rotary_dim a multiple of
    16 up to ``head_dim``."""
    rd = 2 * cos.shape[-1]
    if cos.shape != sin.shape or cos.dim() != 2 or rd % 16 or rd > head_dim:
        raise ValueError(f"flashgen: rotary_cos / rotary_sin must be (seqlen_ro, rotary_dim / 2) alike, rotary_dim a "
                         f"multiple of 16 up to head_dim {head_dim}; got {tuple(cos.shape)} and {tuple(sin.shape)}")


def _capacity(k_cache, page_table, cache_batch_idx, batch: int, on=None) -> int:
    """Each entry's cache positions: k_cache's rows, or with ``page_table`` its pages' rows. ValueError unless the
    page table is an int32 ``(batch, pages)`` tensor (on device ``on`` where given) without cache_batch_idx."""
    if page_table is None:
        return k_cache.shape[1]
    if (not isinstance(page_table, torch.Tensor) or page_table.dim() != 2 or page_table.shape[0] != batch
            or page_table.dtype != torch.int32 or (on is not None and page_table.device != on)):
        where = "" if on is None else " on q's device"
        raise ValueError(f"flashgen: page_table must be an int32 (batch, pages) = ({batch}, pages) tensor{where}")
    if cache_batch_idx is not None:
        raise ValueError("flashgen: cache_batch_idx with page_table: the page table already names each entry's pages")
    return page_table.shape[1] * k_cache.shape[1]


def _ints(name, t, batch: int, device, default=None) -> list:
    """A per-entry int argument as a host list of ``batch`` ints: None -> ``default``; an int -> that
    int for every entry; a 1-D int32 tensor (on q's GPU or the CPU) of ``batch`` entries."""
    if t is None:
        return None if default is None else [default] * batch
    if _v._is_int(t):
        return [int(t)] * batch
    vals = _host_ints(name, t, device)
    if len(vals) != batch:
        raise ValueError(f"flashgen: {name} must have batch = {batch} entries, got {len(vals)}")
    return vals


def flash_attn_with_kvcache(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k: Optional[torch.Tensor] = None,
    v: Optional[torch.Tensor] = None,
    qv: Optional[torch.Tensor] = None,
    rotary_cos: Optional[torch.Tensor] = None,
    rotary_sin: Optional[torch.Tensor] = None,
    cache_seqlens=None,
    cache_batch_idx: Optional[torch.Tensor] = None,
    cache_leftpad: Optional[torch.Tensor] = None,
    page_table: Optional[torch.Tensor] = None,
    cu_seqlens_q: Optional[torch.Tensor] = None,
    cu_seqlens_k_new: Optional[torch.Tensor] = None,
    max_seqlen_q: Optional[int] = None,
    rotary_seqlens: Optional[torch.Tensor] = None,
    q_descale: Optional[torch.Tensor] = None,
    k_descale: Optional[torch.Tensor] = None,
    v_descale: Optional[torch.Tensor] = None,
    softmax_scale: Optional[float] = None,
    causal: bool = False,
    window_size: tuple = (-1, -1),
    attention_chunk: int = 0,
    softcap: float = 0.0,
    rotary_interleaved: bool = True,
    scheduler_metadata=None,
    num_splits: int = 0,
    pack_gqa: Optional[bool] = None,
    sm_margin: int = 0,
    return_softmax_lse: bool = False,
):
    """FA3's ``flash_attn_with_kvcache``: append k / v to the KV cache in place (with the rotary
    embedding), then attention of q over each entry's cache rows; forward only, as FA3's. The
    semantics are FA3's (module docstring); how it runs is the module docstring's too (lengths read
    on the host, then :func:`flashgen.flash_attn_func` calls).

    Args:
        q: ``(batch, seqlen_q, heads, head_dim)``, or ``(total_q, heads, head_dim)`` with
            ``cu_seqlens_q`` (int32 ``(batch + 1,)``) and ``max_seqlen_q``.
        k_cache, v_cache: ``(batch_cache, seqlen_cache, heads_k, head_dim[_v])``, or with
            ``page_table`` (int32 ``(batch, pages)``) ``(num_blocks, page_size, heads_k, ...)``;
            q's dtype (float16, bfloat16, float8_e4m3fn). Written in place when k, v are given.
        k, v: None, or the new keys / values ``(batch, seqlen_new, heads_k, ...)`` or, with
            ``cu_seqlens_k_new``, ``(total_new, heads_k, ...)``.
        cache_seqlens: None (every cache row full), an int, or int32 ``(batch,)``: the cached
            tokens of each entry before the append. cache_batch_idx: int32 ``(batch,)`` cache rows
            (default 0..batch-1). cache_leftpad: int32 ``(batch,)``, the first cache position used.
        rotary_cos, rotary_sin: ``(seqlen_ro, rotary_dim / 2)``, rotary_dim a multiple of 16 up to
            head_dim; need k and v. rotary_seqlens: int32 ``(batch,)`` positions instead of
            cache_seqlens. rotary_interleaved: pairs (True, FA3's default) or halves.
        q_descale, k_descale, v_descale: FP8: None or float32 ``(batch, heads_k)``.
        softmax_scale, causal, window_size, attention_chunk, softcap, pack_gqa: as
            :func:`flashgen.flash_attn_func`.
        num_splits: FA3's split-KV count (flash-decoding) where the varlen kernel runs the call: 0 (default)
            chosen by core.varlen_num_splits (FA3's heuristic: splits when the tiles do not fill the GPU, and for a
            decode step then at least one per 32 blocks of 128 cache positions, core.DECODE_SPLIT_BLOCKS; a call
            without cache_seqlens, cache_leftpad or page_table, every cache full, by the decode cost model,
            core.SPLIT_MODEL; none with FLASHGEN_SPLIT_KV_AUTO=0: core.SPLIT_KV_AUTO), 1 none, n that many;
            the partials are merged by :func:`flashgen.flash_attn_combine`. The composed path ignores it.
        qv: not implemented (NotImplementedError). scheduler_metadata, sm_margin: accepted and ignored.
        return_softmax_lse: also return lse, float32 ``(batch, heads, seqlen_q)`` (``(heads,
            total_q)`` with cu_seqlens_q).

    Returns:
        out ``(batch, seqlen_q, heads, head_dim_v)`` (``(total_q, ...)`` with cu_seqlens_q), q's
        dtype (bfloat16 for FP8), and lse with return_softmax_lse.

    Raises:
        TypeError / ValueError naming the argument (ranks, shapes, dtypes, the per-entry lengths
        against the cache's capacity and rotary_cos's rows, rotary without new keys, what
        :func:`flashgen.flash_attn_func` checks of q against the caches, cache_batch_idx naming a row twice
        when k / v are appended, page_table naming a page outside the caches among those an entry uses,
        ...; without a host read, under capture or with core.VARLEN_NO_HOST_READ, the lengths' values are
        checked on the GPU instead: a device-side assert naming the argument); NotImplementedError
        for qv: all before the cache is written. An error of the attention itself afterwards (a
        missing variant) leaves the appended tokens in the cache.
    """
    if qv is not None:
        raise NotImplementedError("flashgen: qv (absorbed MLA) is not supported yet; pass qv=None")
    for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"flashgen: {name} must be a torch.Tensor, got {type(t).__name__}")
    _v.raise_problems(_v.softmax_scale_problems(softmax_scale))  # (before anything is appended)
    if (k is None) != (v is None):
        raise ValueError("flashgen: k and v (the new keys and values) must be given together")
    if rotary_cos is not None and (k is None or rotary_sin is None):
        raise ValueError("flashgen: rotary_cos / rotary_sin need each other and the new k / v to rotate")
    if k_cache.dim() != 4 or v_cache.dim() != 4 or k_cache.shape[:3] != v_cache.shape[:3]:
        raise ValueError(f"flashgen: k_cache and v_cache must be 4-D with the same first three dims, got "
                         f"{tuple(k_cache.shape)} and {tuple(v_cache.shape)}")
    capturing = _capturing(q)
    if cu_seqlens_q is None and cu_seqlens_k_new is None and (capturing or (
            _core.VARLEN_NO_HOST_READ and not torch.compiler.is_compiling()
            and _on_q_device(q, (cache_seqlens, rotary_seqlens, cache_batch_idx, cache_leftpad, page_table)))):
        # no read of a length on the host: under capture always, eagerly with core.VARLEN_NO_HOST_READ and the
        # lengths on q's device (a call _step_on_device refuses, before it writes anything, then takes the host path)
        try:
            out, lse = _step_on_device(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens,
                                       rotary_seqlens, (q_descale, k_descale, v_descale), softmax_scale, causal,
                                       window_size, attention_chunk, softcap, rotary_interleaved, pack_gqa,
                                       cache_batch_idx, cache_leftpad, page_table, num_splits)
        except NotImplementedError:
            if capturing:
                raise
        else:
            return (out, lse) if return_softmax_lse else out
    device = _device_of(q)[1]
    varlen_q = cu_seqlens_q is not None
    if q.dim() != (3 if varlen_q else 4):
        want = ("3-D (total_q, heads, head_dim) with cu_seqlens_q" if varlen_q
                else "4-D (batch, seqlen_q, heads, head_dim)")
        raise ValueError(f"flashgen: q must be {want}, got {q.dim()}-D shape {tuple(q.shape)}")
    if varlen_q:
        cu_q = _host_ints("cu_seqlens_q", cu_seqlens_q, device)
        batch = len(cu_q) - 1
        _v.raise_problems(_v.varlen_problems(q.shape[0], q.shape[0], cu_q, cu_q, max_seqlen_q, max_seqlen_q))
        q_rows = [(cu_q[b], cu_q[b + 1]) for b in range(batch)]
    else:
        batch = q.shape[0]
        q_rows = [(0, q.shape[1])] * batch
    paged = page_table is not None
    capacity = _capacity(k_cache, page_table, cache_batch_idx, batch)
    lens = _ints("cache_seqlens", cache_seqlens, batch, device, default=capacity)
    if cu_seqlens_k_new is None:
        _check_new_kv(k, v, batch, cache_seqlens)
    elif k is not None and cache_seqlens is None:
        raise ValueError("flashgen: cache_seqlens is needed to append k / v (where the new tokens go)")
    leftpad = _ints("cache_leftpad", cache_leftpad, batch, device, default=0)
    rows = _ints("cache_batch_idx", cache_batch_idx, batch, device) or list(range(batch))
    if k is not None:
        if cu_seqlens_k_new is not None:
            cu_new = _host_ints("cu_seqlens_k_new", cu_seqlens_k_new, device)
            if len(cu_new) != batch + 1 or k.dim() != 3 or v.dim() != 3:
                raise ValueError(f"flashgen: with cu_seqlens_k_new ({batch + 1} offsets) k and v must be 3-D "
                                 "(total_new, heads_k, head_dim)")
            _v.raise_problems(_v.offset_problems("cu_seqlens_k_new", cu_new, k.shape[0], "the new k and v"))
            new = [(cu_new[b], cu_new[b + 1]) for b in range(batch)]
        else:
            new = [(0, k.shape[1])] * batch
    else:
        new = [(0, 0)] * batch
    total = [lens[b] + new[b][1] - new[b][0] for b in range(batch)]
    for b in range(batch):
        if not 0 <= lens[b] or total[b] > capacity:
            raise ValueError(f"flashgen: entry {b}: cache_seqlens {lens[b]} + {total[b] - lens[b]} new tokens must fit "
                             f"the cache's {capacity} positions")
        if not 0 <= leftpad[b] <= total[b]:
            raise ValueError(f"flashgen: cache_leftpad[{b}] = {leftpad[b]} must be between 0 and the entry's "
                             f"{total[b]} tokens")
        if not paged and not 0 <= rows[b] < k_cache.shape[0]:
            raise ValueError(f"flashgen: cache_batch_idx[{b}] = {rows[b]} is not a row of k_cache "
                             f"({k_cache.shape[0]} rows)")
    if paged:  # the pages each entry uses (up to its last token's) must be blocks of the caches (one read)
        used = torch.arange(page_table.shape[1], device=page_table.device)[None] < torch.tensor(
            [-(-t // k_cache.shape[1]) for t in total], device=page_table.device)[:, None]
        bad = used & ((page_table < 0) | (page_table >= k_cache.shape[0]))
        if bool(bad.any()):
            b, j = (int(x) for x in bad.nonzero()[0])
            raise ValueError(f"flashgen: page_table[{b}] names page {int(page_table[b, j])}, not a block of k_cache "
                             f"({k_cache.shape[0]} blocks), among the pages entry {b}'s {total[b]} tokens use")
    rope = None
    if rotary_cos is not None:
        _check_rotary(rotary_cos, rotary_sin, q.shape[-1])
        starts = _ints("rotary_seqlens", rotary_seqlens, batch, device) or lens
        rope = (rotary_cos, rotary_sin, starts)

    each = causal or any(x is not None and x >= 0 for x in window_size)  # FA3: q's rows rotated each at its position
    if rope is not None:
        for b in range(batch):
            last = rope[2][b] + max(new[b][1] - new[b][0], q_rows[b][1] - q_rows[b][0] if each else 1) - 1
            if rope[2][b] < 0 or last >= rope[0].shape[0]:
                raise ValueError(f"flashgen: entry {b}: rotary positions up to {last} are past rotary_cos's "
                                 f"{rope[0].shape[0]} rows")
    if batch:  # q against the caches, the window, softcap and the descales, before the cache is written
        first = slice(q_rows[0][0], q_rows[0][1]) if varlen_q else 0
        cache0 = k_cache[:1, :0] if not paged else k_cache[:0].flatten(0, 1)[None]
        vcache0 = v_cache[:1, :0] if not paged else v_cache[:0].flatten(0, 1)[None]
        problem = _check_fwd(q[first][None], cache0, vcache0, *_v.window_pair(window_size), float(softcap), None,
                             *(None if d is None else d[:1] for d in (q_descale, k_descale, v_descale)))

    if k is not None and not paged and len(set(rows)) < batch:
        raise ValueError("flashgen: cache_batch_idx must name distinct cache rows when k / v are appended "
                         f"(got {rows[:16]})")

    def ints_on(values: list, device) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int64, device=device)

    if batch == 0:  # nothing to append or attend
        out = q.new_zeros(q.shape[:-1] + (v_cache.shape[3],), dtype=_out_dtype(q))
        lse = q.new_full((q.shape[1], q.shape[0]) if varlen_q else (0, q.shape[2], q.shape[1]), -math.inf,
                         dtype=torch.float32)
        return (out, lse) if return_softmax_lse else out
    # 1. q rotated (each row at its position, or at the entry's start), in one op over all entries; q's rows
    # past the last entry (varlen) as they are
    q_len = [r1 - r0 for r0, r1 in q_rows]
    if rope is not None:
        start = rope[2]
        pos = ints_on([start[b] + (i if each else 0) for b in range(batch) for i in range(q_len[b])], rope[0].device)
        end = q_rows[-1][1]
        if varlen_q:
            q = torch.cat([apply_rotary(q[:end], rope[0], rope[1], pos, rotary_interleaved), q[end:]])
        else:
            q = apply_rotary(q, rope[0], rope[1], pos.view(batch, q.shape[1]), rotary_interleaved)
    # 2. the new keys / values into the cache (rotated first), in place: one scatter for every entry's tokens
    # (k's rows in entry order: (batch, seqlen_new) flattened, or cu_seqlens_k_new's from 0)
    n_new = [r1 - r0 for r0, r1 in new]
    if k is not None and any(n_new):
        ent = [b for b in range(batch) for _ in range(n_new[b])]
        at = [lens[b] + i for b in range(batch) for i in range(n_new[b])]
        kk = k.flatten(0, 1) if cu_seqlens_k_new is None else k[:len(ent)]
        vv = v.flatten(0, 1) if cu_seqlens_k_new is None else v[:len(ent)]
        if rope is not None:
            kk = apply_rotary(kk, rope[0], rope[1],
                              ints_on([rope[2][b] + i for b in range(batch) for i in range(n_new[b])], rope[0].device),
                              rotary_interleaved)
        if paged:
            ps = k_cache.shape[1]
            pages = page_table.long()[ints_on(ent, page_table.device), ints_on([p // ps for p in at], page_table.device)]
            idx = (pages.to(k_cache.device), ints_on([p % ps for p in at], k_cache.device))
        else:
            idx = (ints_on([rows[b] for b in ent], k_cache.device), ints_on(at, k_cache.device))
        k_cache[idx] = kk.to(k_cache.dtype)
        v_cache[idx] = vv.to(v_cache.dtype)
    # 3. attention. With the varlen kernel (interface._varlen_kernel_serves) it is one launch: entry b reads its
    # cache row (cache_batch_idx's, or b) or its pages from its left padding up to its total length (seqused_k).
    # The kernel's page boxes need pages of a multiple of 8 rows and no left padding (core.Varlen).
    max_k = max(t - p for t, p in zip(total, leftpad))
    if ((not paged or (k_cache.shape[1] % 8 == 0 and not any(leftpad)))
            and _varlen_kernel_serves(q, k_cache, v_cache, None, (q_descale, k_descale, v_descale), attention_chunk,
                                      max(q_len), max_k, softcap=softcap)):
        whole = paged or cache_batch_idx is not None  # k / v's batch dim: pages or cache rows, not the entries
        res = _varlen_kernel(q, k_cache if whole else k_cache[:batch], v_cache if whole else v_cache[:batch],
                             (cu_seqlens_q if varlen_q else None, None, None, total), batch, max(q_len), max_k,
                             softmax_scale, causal, window_size, softcap, None,
                             fill=varlen_q and q_rows[-1][1] < q.shape[0], problem=problem,
                             cache=(None if cache_batch_idx is None else rows, leftpad if any(leftpad) else None,
                                    page_table if paged else None), num_splits=_splits_arg(num_splits))
        if res is not None:
            return res if return_softmax_lse else res[0]
    # Else runs of neighbouring entries with equal lengths and consecutive cache rows share one call
    # (unpaged); a paged entry's rows are gathered.
    out_parts, lse_parts = [], []
    b = 0
    while b < batch:
        m = 1
        if not paged and not varlen_q:
            while (b + m < batch and (leftpad[b + m], total[b + m]) == (leftpad[b], total[b])
                   and rows[b + m] == rows[b] + m):
                m += 1
        if paged:
            n_pages = -(-total[b] // k_cache.shape[1])
            pages = page_table[b, :n_pages].long()
            kc = k_cache[pages].flatten(0, 1)[leftpad[b]:total[b]][None]
            vc = v_cache[pages].flatten(0, 1)[leftpad[b]:total[b]][None]
        else:
            kc = k_cache[rows[b]:rows[b] + m, leftpad[b]:total[b]]
            vc = v_cache[rows[b]:rows[b] + m, leftpad[b]:total[b]]
        qb = q[q_rows[b][0]:q_rows[b][1]][None] if varlen_q else q[b:b + m]  # (runs only with a padded q)
        ds = tuple(None if d is None else d[b:b + m] for d in (q_descale, k_descale, v_descale))
        o, lse = _attend(qb, kc, vc, softmax_scale, causal, window_size, softcap, None, ds, pack_gqa, False, True,
                         attention_chunk)
        out_parts.append(o)
        lse_parts.append(lse)
        b += m
    if varlen_q:  # one part per entry (batch >= 1 here), then q's rows past the last entry: out 0, lse -inf
        outs, lses = [o[0] for o in out_parts], [part[0] for part in lse_parts]
        rest = q.shape[0] - q_rows[-1][1]
        if rest:
            outs.append(outs[0].new_zeros((rest,) + tuple(outs[0].shape[1:])))
            lses.append(lses[0].new_full((lses[0].shape[0], rest), -math.inf))
        out = torch.cat(outs, dim=0)
        lse = torch.cat(lses, dim=1)
    else:
        out = torch.cat(out_parts, dim=0) if len(out_parts) > 1 else out_parts[0]
        lse = torch.cat(lse_parts, dim=0) if len(lse_parts) > 1 else lse_parts[0]
    return (out, lse) if return_softmax_lse else out


def _append_with_torch(lens, rows, pads, page_table, k, v, k_cache, v_cache, capacity: int):
    """The kvcache kernel's work (:func:`_kvcache_prep_launch`) as torch ops, without a host read: the cache
    arguments checked (torch._assert_async, the kernel's messages), k / v appended at positions lens[b] + i of entry
    b's cache row or pages; returns the int32 key counts lens + n."""
    messages = kvcache_messages()
    batch, n = lens.shape[0], 0 if k is None else k.shape[1]
    total = lens + n
    torch._assert_async(((lens >= 0) & (total <= capacity)).all(), messages[0])
    if rows is not None:
        ok = ((rows >= 0) & (rows < k_cache.shape[0])).all()
        if n:  # an append names each cache row once
            ordered = rows.sort().values
            ok = ok & (ordered[1:] != ordered[:-1]).all()
        torch._assert_async(ok, messages[1])
    if pads is not None:
        torch._assert_async(((pads >= 0) & (pads <= total)).all(), messages[2])
    paged = page_table is not None
    if paged:  # the pages an entry uses (up to its last token's) name blocks of the caches
        used = torch.arange(page_table.shape[1], device=lens.device)[None] * k_cache.shape[1] < total[:, None]
        named = torch.where(used, page_table, 0)
        torch._assert_async(((named >= 0) & (named < k_cache.shape[0])).all(), messages[3])
    if n:
        pos = lens.long()[:, None] + torch.arange(n, device=k_cache.device)
        if paged:
            ps = k_cache.shape[1]
            entry = torch.arange(batch, device=k_cache.device)[:, None].expand(batch, n)
            idx = (page_table.long()[entry, pos // ps], pos % ps)
        else:
            entry = torch.arange(batch, device=k_cache.device) if rows is None else rows.long()
            idx = (entry[:, None].expand(batch, n), pos)
        k_cache[idx] = k.to(k_cache.dtype)
        v_cache[idx] = v.to(v_cache.dtype)
    return total.to(torch.int32)


def _aligned16(t: torch.Tensor) -> bool:
    """Whether the kvcache kernel's 16-byte copies can address ``t`` (4-D, last dim contiguous): its address, its
    first three byte strides and one head's row a multiple of 16 bytes."""
    es = t.element_size()
    return (t.stride(-1) == 1 and t.data_ptr() % 16 == 0 and t.shape[-1] * es % 16 == 0
            and all(s * es % 16 == 0 for s in t.stride()[:3]))


def _kvcache_prep_serves(k_cache, v_cache, k, v, page_table, rows) -> bool:
    """Whether the varlen_prep variant's kvcache kernel takes this step's checks and append (core.VARLEN_PREP_KERNEL,
    its variant built, 16-byte aligned caches and new rows, a page table with contiguous rows, at most
    KVCACHE_MAX_ROWS cache rows where an append must name distinct ones)."""
    if not _varlen_prep_on():
        return False
    n = 0 if k is None else k.shape[1]
    if rows is not None and n and k_cache.shape[0] > _varlen_prep.KVCACHE_MAX_ROWS:
        return False
    if page_table is not None and page_table.shape[1] > 1 and page_table.stride(1) != 1:
        return False
    return all(_aligned16(t) for t in ((k_cache, v_cache, k, v) if n else (k_cache, v_cache)))


_COS_DTYPES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}  # the kvcache kernel's rotary_cos_dtype


class _Rope(NamedTuple):
    """A step's rotary for the kvcache kernel: q (batch, seqlen_q, heads, d) and the q_rot it writes (contiguous,
    q's shape); cos / sin contiguous 16-byte aligned (seqlen_ro, rotary_dim / 2); starts int32 (batch,)
    rotary_seqlens or None (cache_seqlens); interleaved pairs or halves; each: q's row i at start + i."""
    q: torch.Tensor
    q_rot: torch.Tensor
    cos: torch.Tensor
    sin: torch.Tensor
    starts: Optional[torch.Tensor]
    interleaved: bool
    each: bool


def _rotary_in_kernel(q, k, k_cache, cos, sin) -> bool:
    """Whether the kvcache kernel rotates this step's q and new keys (its launch already serving the step):
    core.KVCACHE_ROTARY_KERNEL, q, the new k and the cache of one 16-bit dtype, q 16-byte aligned, contiguous cos /
    sin of one dtype among fp32 / fp16 / bf16 on q's device, 16-byte aligned (the kernel's vector loads)."""
    return (_core.KVCACHE_ROTARY_KERNEL and q.dtype in (torch.float16, torch.bfloat16)
            and q.dtype == k_cache.dtype == k.dtype and _aligned16(q) and cos.dtype == sin.dtype
            and cos.dtype in _COS_DTYPES and cos.device == q.device and sin.device == q.device
            and cos.is_contiguous() and sin.is_contiguous() and cos.data_ptr() % 16 == 0 and sin.data_ptr() % 16 == 0)


def _kvcache_prep_launch(lens, seqlen_const: int, rows, pads, page_table, total, k, v, k_cache, v_cache,
                         capacity: int, device: int, rope: Optional[_Rope] = None) -> None:
    """One launch of the kvcache kernel (:func:`flashgen.varlen_prep.kvcache_prepare`) on the current stream:
    ``lens`` int32 (batch,) cache_seqlens or None (every entry at ``seqlen_const``); ``rows`` / ``pads`` int32
    (batch,) cache_batch_idx / cache_leftpad or None; ``page_table`` int32 (batch, pages) or None; ``total`` the
    int32 (batch,) seqused_k it writes; new ``k`` / ``v`` (batch, n, heads_k, d) in the caches' dtype, or None;
    ``rope`` (:class:`_Rope`) or None: the new keys rotated as they are appended, q rotated into rope.q_rot."""
    es = k_cache.element_size()
    ints = [None if t is None else t.contiguous() for t in (lens, rows, pads)]  # (referenced until enqueued)
    ptr = lambda t: 0 if t is None else t.data_ptr()  # noqa: E731
    strides = lambda t: (0, 0, 0) if t is None else tuple(s * es for s in t.stride()[:3])  # noqa: E731
    rotary = None
    if rope is not None:
        starts = None if rope.starts is None else rope.starts.contiguous()
        rotary = _varlen_prep.KvcacheRotary(
            rope.q.data_ptr(), rope.q_rot.data_ptr(), strides(rope.q), rope.q.shape[-1] * es, rope.q.shape[1],
            rope.q.shape[2], rope.cos.data_ptr(), rope.sin.data_ptr(), _COS_DTYPES[rope.cos.dtype], ptr(starts),
            2 * rope.cos.shape[1], rope.cos.shape[0], bool(rope.interleaved), k_cache.dtype == torch.bfloat16,
            bool(rope.each))
    n = 0 if k is None else k.shape[1]
    lens_a, rows_a, pads_a, table_a, k_a, v_a = (ptr(t) for t in (*ints, page_table, k, v))
    kc_a, vc_a, total_a = k_cache.data_ptr(), v_cache.data_ptr(), total.data_ptr()
    addresses = _varlen_prep.kvcache_addresses(lens_a, rows_a, pads_a, table_a, total_a, k_a, v_a, n, kc_a, vc_a,
                                               rotary)
    sizes = dict(seqlen_const=seqlen_const, page_table_stride=0 if page_table is None else page_table.stride(0),
                 k_new_strides=strides(k), v_new_strides=strides(v), n_new=n, k_cache_strides=strides(k_cache),
                 v_cache_strides=strides(v_cache), k_row_bytes=k_cache.shape[-1] * es,
                 v_row_bytes=v_cache.shape[-1] * es, batch=total.shape[0], heads_k=k_cache.shape[2], capacity=capacity,
                 cache_blocks=k_cache.shape[0], page_size=k_cache.shape[1] if page_table is not None else 0,
                 device=device)
    # The launch is prepared once per step metadata (varlen_prep.prepare_kvcache: its checks, grid and params): the
    # key is every argument but the addresses, of which it holds whether each is given and 16-byte aligned (what the
    # checks read of them); the addresses are each call's.
    key = (tuple(sizes.values()), None if rotary is None else rotary._replace(q=0, q_rot=0, cos=0, sin=0,
                                                                               rotary_seqlens=0),
           tuple((a != 0, a % 16 == 0) for a in addresses))
    prep = _prep_launches.get(key)
    if prep is None:
        prep = _launch.cache_put(_prep_launches, key, _varlen_prep.prepare_kvcache(
            cache_seqlens=lens_a, cache_batch_idx=rows_a, cache_leftpad=pads_a, page_table=table_a, seqused_k=total_a,
            k_new=k_a, v_new=v_a, k_cache=kc_a, v_cache=vc_a, rotary=rotary, **sizes), _FWD_CALL_CACHE_MAX)
    _launch.launch_prepared(prep, (), addresses, _current_stream(device))


_prep_launches: dict = {}  # _kvcache_prep_launch's key -> varlen_prep.prepare_kvcache's PreparedLaunch (immutable)


def _step_checked(q, k_cache, v_cache, window_size, softcap, descales: tuple) -> _v.Problem:
    """:func:`_check_fwd` of a step's q, caches, window, softcap and descales (q's first entry against the caches'
    first row, no key: the lengths are checked on the GPU). A decode loop's repeated step skips it (its Problem is kept
    in the step's :class:`_StepFacts`). Raises what :func:`_check_fwd` raises."""
    return _check_fwd(q[:1], k_cache[:1, :0], v_cache[:1, :0], *_v.window_pair(window_size), float(softcap), None,
                      *(None if d is None else d[:1] for d in descales))


class _StepFacts(NamedTuple):
    """What :func:`_step_on_device` found of a step's metadata (:func:`_step_key`), once its checks passed: kept so
    that a decode loop's next steps skip the checks and the choices. Immutable."""

    capacity: int  # each entry's cache positions
    problem: _v.Problem  # _step_checked's
    prep: bool  # the kvcache kernel checks and appends (_kvcache_prep_serves)
    rope_in_kernel: bool  # ... and rotates (_rotary_in_kernel)


_step_facts: dict = {}  # _step_key -> _StepFacts


def _arg_meta(t):
    """A step argument's part of :func:`_step_key`: a tensor's shape, strides, dtype, device, requires_grad and
    whether its address is 16-byte aligned; None; "int" for an int (its value is checked per call, not kept: a loop
    passing the growing length as an int keeps one key); anything else: no key (False)."""
    if t is None:
        return None
    if isinstance(t, torch.Tensor):
        return t.shape, t.stride(), t.dtype, t.device, t.requires_grad, t.data_ptr() % 16 == 0
    return "int" if _v._is_int(t) else False


def _step_key(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, rotary_seqlens, descales: tuple,
              causal: bool, window_size, attention_chunk, softcap, cache_batch_idx, cache_leftpad, page_table):
    """The metadata that :func:`_step_on_device`'s checks and choices read (each tensor's :func:`_arg_meta`, the
    mask, softcap, attention_chunk, grad mode and the switches core.VARLEN_KERNEL, VARLEN_PREP_KERNEL,
    VARLEN_SOFTCAP, KVCACHE_ROTARY_KERNEL), or None where an argument is of no kind a key can hold (the checks then
    run and raise as they do)."""
    metas = tuple(_arg_meta(t) for t in (q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens,
                                           rotary_seqlens, cache_batch_idx, cache_leftpad, page_table, *descales))
    if False in metas or not isinstance(window_size, (tuple, list)) or not _v._is_int(attention_chunk):
        return None
    try:
        return (metas, bool(causal), tuple(window_size), int(attention_chunk), float(softcap),
                torch.is_grad_enabled(), _core.VARLEN_KERNEL, _core.VARLEN_PREP_KERNEL, _core.VARLEN_SOFTCAP,
                _core.KVCACHE_ROTARY_KERNEL)
    except (TypeError, ValueError):
        return None


def _step_on_device(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, rotary_seqlens, descales: tuple,
                    softmax_scale, causal: bool, window_size, attention_chunk: int, softcap: float,
                    rotary_interleaved: bool, pack_gqa=None, cache_batch_idx=None, cache_leftpad=None,
                    page_table=None, num_splits: int = 0) -> tuple:
    """:func:`flash_attn_with_kvcache` without reading a length on the host, for CUDA-graph capture (where the
    host path cannot read GPU tensors): a padded q ``(batch, seqlen_q, heads, d)``, new k / v ``(batch, seqlen_new,
    heads_k, d)`` or None; ``cache_seqlens`` an int or None (every entry at that length, or the cache full) or an
    int32 ``(batch,)`` tensor on q's device, and ``rotary_seqlens``, ``cache_batch_idx``, ``cache_leftpad`` likewise
    (tensors); ``page_table`` None or int32 ``(batch, pages)`` on q's device.

    q's rotary and the append are tensor ops on the GPU (positions ``cache_seqlens[b] + i``, in entry b's cache
    row or pages). Then, with one length for every entry and a plain cache (no batch_idx, leftpad or page
    table), one :func:`flashgen.flash_attn_func` call on the cache's first rows (any dtype and variant that call
    serves); otherwise one launch of the varlen kernel with ``seqused_k = cache_seqlens + seqlen_new``, the
    cache's capacity as max_seqlen_k and the cache arguments as they are. Shapes and host-known lengths are
    checked on the host, tensors' values on the GPU (lengths, cache rows, left padding and the used pages' numbers
    out of range, or a cache row named twice by an append, are an error of the stream, not a write to other rows).
    On that varlen path the checks, the append and seqused_k are one launch of the varlen_prep variant's kvcache
    kernel (:func:`_kvcache_prep_launch`, where :func:`_kvcache_prep_serves`: core.VARLEN_PREP_KERNEL, 16-byte
    aligned rows), else torch ops (:func:`_append_with_torch`: ``torch._assert_async`` and index_put), with the
    same messages. NotImplementedError, before anything is written, where the varlen
    kernel is needed and does not serve the call (switched off, FP8, attention_chunk, softcap while
    core.VARLEN_SOFTCAP is off, no variant built, pages of a size not a multiple of 8 or with cache_leftpad).
    Returns ``(out, lse)``."""
    batch, sq = q.shape[0], q.shape[1]
    n = 0 if k is None else k.shape[1]
    paged = page_table is not None
    key = _step_key(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, rotary_seqlens, descales,
                    causal, window_size, attention_chunk, softcap, cache_batch_idx, cache_leftpad, page_table)
    facts = _step_facts.get(key) if key is not None else None  # (a hit: the checks below passed for this metadata)
    if facts is None:
        capacity = _capacity(k_cache, page_table, cache_batch_idx, batch, on=q.device)
        if not paged and cache_batch_idx is None and k_cache.shape[0] < batch:
            raise ValueError(f"flashgen: k_cache has {k_cache.shape[0]} rows, fewer than q's batch {batch}")
        _check_new_kv(k, v, batch, cache_seqlens)
    else:
        capacity = facts.capacity

    def lengths(name, t, default):
        if t is None:
            return torch.full((batch,), default, dtype=torch.int32, device=q.device)
        if _v._is_int(t):
            return torch.full((batch,), int(t), dtype=torch.int32, device=q.device)
        if not isinstance(t, torch.Tensor) or t.dtype != torch.int32 or tuple(t.shape) != (batch,) \
                or t.device != q.device:
            raise ValueError(f"flashgen: {name} must be an int32 ({batch},) tensor on q's device without a host read "
                             "(CUDA-graph capture, or core.VARLEN_NO_HOST_READ: FLASHGEN_VARLEN_NO_HOST_READ=0 reads "
                             "the lengths on the host), got "
                             f"{t.dtype if isinstance(t, torch.Tensor) else type(t).__name__}")
        return t

    plain = cache_batch_idx is None and cache_leftpad is None and not paged
    uniform = plain and (cache_seqlens is None or _v._is_int(cache_seqlens))  # one length, known on the host
    if uniform:
        length = capacity if cache_seqlens is None else int(cache_seqlens)
        if not 0 <= length <= capacity - n:
            raise ValueError(f"flashgen: cache_seqlens {length} + {n} new tokens must fit the cache's {capacity} "
                             "positions")
    rows = None if cache_batch_idx is None else lengths("cache_batch_idx", cache_batch_idx, 0)
    pads = None if cache_leftpad is None else lengths("cache_leftpad", cache_leftpad, 0)
    # (cache_seqlens as a tensor: the call's own; an int or None without a tensor made of it on the prep kernel's
    # path, which takes it as a constant)
    lens = None if cache_seqlens is None or _v._is_int(cache_seqlens) else lengths("cache_seqlens", cache_seqlens,
                                                                                   capacity)
    problem = facts.problem if facts is not None else _step_checked(q, k_cache, v_cache, window_size, softcap, descales)
    if facts is None and not uniform and not (
            (not paged or (k_cache.shape[1] % 8 == 0 and pads is None))
            and _varlen_kernel_serves(q, k_cache, v_cache, None, descales, attention_chunk, sq, capacity, on_device=True,
                                      softcap=softcap)
            and _core.varlen_variant_built(problem.dtype, q.shape[-1], v_cache.shape[-1], causal, window_size, sq,
                                           capacity, float(softcap))):
        raise NotImplementedError("flashgen: flash_attn_with_kvcache under CUDA-graph capture with a tensor of "
                                  "cache_seqlens, cache_batch_idx, cache_leftpad or a page table runs on the varlen "
                                  "kernel alone (FLASHGEN_VARLEN_KERNEL=1; fp16 / bf16 without descales or "
                                  "attention_chunk, softcap unless FLASHGEN_VARLEN_SOFTCAP=0, a varlen variant "
                                  "built; pages of a multiple of 8 rows, "
                                  "without cache_leftpad); otherwise it reads the lengths on the host, outside a "
                                  "capture")
    prep = facts.prep if facts is not None else not uniform and _kvcache_prep_serves(k_cache, v_cache, k, v,
                                                                                      page_table, rows)
    rope = None  # (the kvcache kernel's rotary)
    in_kernel = False
    if rotary_cos is not None:
        if facts is None:
            _check_rotary(rotary_cos, rotary_sin, q.shape[-1])
        each = causal or any(x is not None and x >= 0 for x in window_size)
        starts = None if rotary_seqlens is None else lengths("rotary_seqlens", rotary_seqlens, 0)
        # (the kernel's tables: copies where a view is strided; the torch ops index any layout)
        cos, sin = (rotary_cos.contiguous(), rotary_sin.contiguous()) if prep else (rotary_cos, rotary_sin)
        in_kernel = facts.rope_in_kernel if facts is not None else prep and _rotary_in_kernel(q, k, k_cache, cos, sin)
        if in_kernel:
            rope = _Rope(q, torch.empty(q.shape, dtype=q.dtype, device=q.device), cos, sin, starts,
                         rotary_interleaved, each)
        else:  # torch ops: the positions checked (the kernel's message), then both rotations
            start = (starts if starts is not None else lens if lens is not None
                     else lengths("cache_seqlens", cache_seqlens, capacity))
            start = start.long().to(rotary_cos.device)[:, None]
            rows_ro = max(n, sq if each else 1)  # the positions start, ..., start + rows_ro - 1
            torch._assert_async(((start >= 0) & (start + rows_ro <= rotary_cos.shape[0])).all(),
                                kvcache_messages()[4])
            steps = torch.arange(sq, device=rotary_cos.device) if each else torch.zeros(sq, dtype=torch.long,
                                                                                          device=rotary_cos.device)
            q = apply_rotary(q, rotary_cos, rotary_sin, start + steps, rotary_interleaved)
            if n:
                k = apply_rotary(k, rotary_cos, rotary_sin, start + torch.arange(n, device=rotary_cos.device),
                                 rotary_interleaved)
    if facts is None and key is not None:  # (every check above passed: a later step of this metadata skips them)
        _launch.cache_put(_step_facts, key, _StepFacts(capacity, problem, prep, in_kernel), _FWD_CALL_CACHE_MAX)
    if uniform:  # the append a slice, the attention one call on the cache's first length + n rows
        if n:
            k_cache[:batch, length:length + n] = k.to(k_cache.dtype)
            v_cache[:batch, length:length + n] = v.to(v_cache.dtype)
        return _attend(q, k_cache[:batch, :length + n], v_cache[:batch, :length + n], softmax_scale, causal,
                       window_size, softcap, None, descales, pack_gqa, False, True, attention_chunk)
    # The values cannot be read here, so they are checked on the GPU: an error of the stream (a device-side
    # assert), not a write to the wrong rows (a negative position would wrap around in the append). One launch of
    # the varlen_prep variant's kvcache kernel checks, appends and writes the key counts where it serves the call;
    # else torch ops do the same (the same messages: kvcache_messages()).
    if prep:
        if n and k.dtype != k_cache.dtype:
            k, v = k.to(k_cache.dtype), v.to(v_cache.dtype)
        total = torch.empty(batch, dtype=torch.int32, device=q.device)
        const = capacity if cache_seqlens is None else 0 if lens is not None else int(cache_seqlens)
        _kvcache_prep_launch(lens, const, rows, pads, page_table, total, k if n else None, v if n else None,
                             k_cache, v_cache, capacity, _device_of(q)[1], rope)
        if rope is not None:
            q = rope.q_rot
    else:
        if lens is None:
            lens = lengths("cache_seqlens", cache_seqlens, capacity)
        total = _append_with_torch(lens, rows, pads, page_table, k, v, k_cache, v_cache, capacity)
    whole = paged or rows is not None  # k / v's batch dim: pages or cache rows, not the entries
    res = _varlen_kernel(q, k_cache if whole else k_cache[:batch], v_cache if whole else v_cache[:batch],
                         (None, None, None, total), batch, sq, capacity, softmax_scale, causal,
                         window_size, softcap, None, fill=False, problem=problem, cache=(rows, pads, page_table),
                         num_splits=_splits_arg(num_splits))
    if res is None:  # (varlen_variant_built said yes: a manifest changed between the two reads)
        raise NotImplementedError("flashgen: no varlen variant serves this flash_attn_with_kvcache call, which a "
                                  "CUDA-graph capture needs (the composed path reads the lengths on the host)")
    return res


def get_scheduler_metadata(batch_size, max_seqlen_q, max_seqlen_k, num_heads_q, num_heads_kv, headdim,
                           cache_seqlens=None, qkv_dtype=None, headdim_v=None, cu_seqlens_q=None,
                           cu_seqlens_k_new=None, cache_leftpad=None, page_size=None, max_seqlen_k_new=0,
                           causal=False, window_size=(-1, -1), attention_chunk=0, has_softcap=False, num_splits=0,
                           pack_gqa=None, sm_margin=0):
    """FA3's ``get_scheduler_metadata``, with FA3's arguments: FA3 precomputes its decode scheduler
    (split counts per entry) so that a captured CUDA graph can replay a kvcache call. flashgen's
    :func:`flash_attn_with_kvcache` takes no precomputed schedule (it reads the lengths on the host),
    so there is nothing to compute: returns None, which ``scheduler_metadata=`` accepts (as it
    accepts any value and ignores it). Raises nothing."""
    return None
