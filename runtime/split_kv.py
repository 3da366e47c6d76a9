"""Split-KV for the non-varlen forward entries (FA3's ``num_splits``), framework-neutral.

Flash-decoding (FlashAttention-3, Shah et al., arXiv 2407.08608, §3; FA3's ``num_splits`` of
``flash_attn_func``): a call whose tiles do not fill the GPU (a decode step: few query rows, many keys)
splits each tile's keys into ``splits`` shares run as tiles of their own. Here that is the varlen
kernel over the padded batch (:class:`flashgen.core.Varlen` with no length arrays: every sequence is
seqlen_q x seqlen_k, the mask aligned as the non-varlen kernel's): split s writes its fp32 O
(normalised within the share) and LSE into a scratch workspace, and the combine kernel
(:mod:`flashgen.combine`, FA3's ``flash_attn_combine``) merges them into the call's out and lse.

Both forward entries use it: ``flashgen.interface.flash_attn_func`` (torch; it prepares once per key)
and ``flashgen.dlpack_api.flash_attn_forward`` (DLPack arrays). The caller validates the arguments,
allocates the workspace (:attr:`SplitForward.workspace_bytes`, on the launch stream) and keeps it
until :func:`launch_split_forward` has enqueued both launches. Nothing here imports torch; nothing
here is mutated after it is made.

Workspace layout (one allocation): the partial O, fp32 contiguous ``(splits, batch, seqlen_q, heads,
head_dim_v)`` at offset 0; the partial LSE, fp32 contiguous ``(splits, batch, heads, seqlen_q)``
(natural log) at :attr:`SplitForward.lse_offset` bytes. Neither needs initialising: each split's tile
writes every row of its entry, O 0 and LSE -inf for a row that sees no key of its share (fwd.cu.j2's
epilogue; an empty share runs it too), so the merge reads nothing stale.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

from . import _validate as _v
from . import combine as _combine
from . import core as _core

__all__ = ["SplitForward", "split_count", "prepare_split_forward", "launch_split_forward"]

#: Alignment of the partial LSE's offset in the workspace (bytes; the allocators give 256-byte blocks).
_LSE_ALIGN = 256


class SplitForward(NamedTuple):
    """A forward call's split-KV launches, resolved from metadata alone (:func:`prepare_split_forward`).
    Immutable: calls on any thread may share one."""

    splits: int  # shares of each tile's keys (> 1)
    launch: "_core.PreparedForward"  # the varlen kernel writing the partials (its Varlen: num_splits, split strides)
    combine: "_combine.PreparedCombine"  # the merge of the partials into out and lse
    lse_offset: int  # bytes from the workspace's start to the partial LSE
    workspace_bytes: int  # scratch device memory a launch needs (partial O, then partial LSE)


def split_count(num_splits: int, batch: int, heads: int, heads_k: int, seqlen_q: int, seqlen_k: int, device: int,
                causal: bool, window: tuple, kv_bytes_per_key: int = 0) -> int:
    """The shares each tile's keys are split into for FA3's ``num_splits`` (an int), in every split-KV path (the
    forward entries here, the varlen / kvcache kernel path: interface._varlen_kernel): 1 = unsplit; <= 0 = chosen by
    :func:`flashgen.core.varlen_num_splits` while core.SPLIT_KV_AUTO, else 1; n = n. Capped at core.MAX_SPLITS and
    at one share per 64 keys. ``seqlen_q`` / ``seqlen_k``: the call's (the longest sequence's for varlen calls);
    ``causal``, ``window``: its mask (``(left, right)``, -1 unbounded); ``kv_bytes_per_key``: (head_dim +
    head_dim_v) x element size where every sequence has ``seqlen_k`` keys (a padded batch: the decode cost model),
    0 where the lengths are not known (FA3's rule; :func:`flashgen.core.varlen_num_splits`). Kernel availability is
    not looked at here (:func:`prepare_split_forward`)."""
    if num_splits == 1:
        return 1
    if num_splits > 0:
        n = num_splits
    elif _core.SPLIT_KV_AUTO:
        n = _core.varlen_num_splits(batch, heads, heads_k, seqlen_q, seqlen_k, device,
                                    _core.mask_spec(causal, window, seqlen_q, seqlen_k), kv_bytes_per_key)
    else:
        n = 1
    return max(1, min(n, _core.MAX_SPLITS, -(-seqlen_k // 64)))


def prepare_split_forward(p: _v.Problem, inputs: tuple, causal: bool, window: tuple, softcap: float,
                          descales: bool, pack_gqa: Optional[bool], num_splits: int,
                          out_strides: Optional[tuple] = None) -> Optional[SplitForward]:
    """The :class:`SplitForward` of a forward call, or None where it runs unsplit: :func:`split_count` gives 1;
    FP8 inputs or ``descales`` (any descale given); softcap > 0 without core.VARLEN_SOFTCAP; the varlen kernel
    switched off (core.VARLEN_KERNEL); no varlen variant or no combine variant built for the key (so a call never
    fails for want of them: it runs on the plain forward's variant).

    Args:
        p: the call's validated Problem (batch, seqlen_q, seqlen_k >= 1; fp16 / bf16 to split).
        inputs: q, k, v's ``(shape, strides)`` in elements as the core takes them (TMA-readable: the caller
            checked; :func:`flashgen._validate.tma_strides`).
        causal, window, softcap: the call's mask and soft-capping (window: ``(left, right)``, -1 unbounded).
        pack_gqa: the core's PackGQA choice for the call (None = the measured rule; True is taken as None here,
            the varlen PackGQA variants being chosen by their own rule).
        num_splits: FA3's, an int (:func:`split_count`).
        out_strides: out's strides (elements, ``(batch, seqlen_q, heads, head_dim_v)``; last 1); None =
            contiguous. lse is always C-contiguous ``(batch, heads, seqlen_q)``.

    Raises what :func:`flashgen.core.prepare_forward` and :func:`flashgen.combine.prepare_combine` raise for
    arrays of this metadata (the caller checked them, so nothing in practice)."""
    if (p.dtype not in ("fp16", "bf16") or descales or not _core.VARLEN_KERNEL
            or (softcap > 0 and not _core.VARLEN_SOFTCAP)):
        return None
    n = split_count(num_splits, p.batch, p.heads, p.heads_k, p.seqlen_q, p.seqlen_k, p.device, causal, window,
                    (p.head_dim + p.head_dim_v) * _v.ELEMENT_SIZE[p.dtype])
    b, sq, sk, h, dv, dev = p.batch, p.seqlen_q, p.seqlen_k, p.heads, p.head_dim_v, p.device
    if (n == 1 or not _core.varlen_variant_built(p.dtype, p.head_dim, dv, causal, window, sq, sk, softcap)
            or not _core.variant_built("combine", {"dtype": p.out_dtype})):
        return None
    parts_shape, parts_lse_shape = (n,) + tuple(p.out_shape), (n,) + tuple(p.lse_shape)
    o_strides, l_strides = _v.contiguous_strides(parts_shape), _v.contiguous_strides(parts_lse_shape)
    o_bytes = 4 * n * b * sq * h * dv
    lse_offset = -(-o_bytes // _LSE_ALIGN) * _LSE_ALIGN
    (qs, qst), (ks, kst), (vs, vst) = inputs
    prep = _core.prepare_forward(
        _core.TensorArg(0, qs, qst, p.dtype, dev), _core.TensorArg(0, ks, kst, p.dtype, dev),
        _core.TensorArg(0, vs, vst, p.dtype, dev),
        _core.TensorArg(0, tuple(p.out_shape), _v.tma_strides(p.out_shape, o_strides[1:]), "fp32", dev), causal,
        window_size=window, softcap=softcap, pack_gqa=None if pack_gqa else pack_gqa,
        varlen=_core.Varlen(0, 0, 0, 0, b, sq, sk, num_splits=n, o_stride_split=o_strides[0],
                            lse_stride_split=l_strides[0]))
    # the merge, as flash_attn_combine's: partials (splits, batch, seqlen_q, heads, ...), the LSEs (batch, seqlen_q,
    # heads) transpose views of the contiguous (batch, heads, seqlen_q) buffers
    merge = _combine.prepare_combine(
        _core.TensorArg(0, parts_shape, o_strides, "fp32", dev),
        _core.TensorArg(0, (n, b, sq, h), (l_strides[0], h * sq, 1, sq), "fp32", dev),
        _core.TensorArg(0, tuple(p.out_shape), out_strides or _v.contiguous_strides(p.out_shape), p.out_dtype, dev),
        _core.TensorArg(0, (b, sq, h), (h * sq, 1, sq), "fp32", dev), p.out_dtype)
    return SplitForward(n, prep, merge, lse_offset, lse_offset + 4 * n * b * h * sq)


def launch_split_forward(s: SplitForward, q: int, k: int, v: int, workspace: int, out: int, lse: int,
                         softmax_scale: float, softcap: float, stream: int, sink: int = 0) -> None:
    """Enqueue a :class:`SplitForward`'s two launches on ``stream``: the varlen kernel writes the partials into
    ``workspace`` (``s.workspace_bytes`` of device memory, 256-byte aligned), then the combine kernel merges
    them into ``out`` and ``lse`` (every row of both). Addresses are device pointers of arrays of the prepared
    metadata; q, k, v 16-byte aligned (TMA: the caller checks, as for the unsplit launch). ``sink``: the
    learnable sink's address or 0 (the kernel adds it in split 0 only). CudaError if a launch fails."""
    _core.launch_forward(s.launch, q, k, v, workspace, workspace + s.lse_offset, float(softmax_scale),
                         float(softcap), stream, sink, varlen=_NO_VARLEN_ARRAYS)
    _combine.launch_combine(s.combine, workspace, workspace + s.lse_offset, out, lse, stream)


_NO_VARLEN_ARRAYS = (0,) * len(_core._VARLEN_PER_CALL)  # a split call's core.Varlen addresses: no length arrays
