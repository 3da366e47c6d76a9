"""flashgen: FlashAttention-3 kernels (forward, backward, split-KV combine) for NVIDIA Hopper,
built ahead of time as fatbins and launched through cuda-python (no C++ extension, no libtorch ABI).

Torch users: ``from flashgen import flash_attn_func`` (FA3's ``flash_attn_interface`` names;
differentiable through torch autograd), ``flash_attn_qkvpacked_func`` for packed q, k, v, and
``flash_attn_varlen_func`` for sequences of different lengths and ``flash_attn_with_kvcache`` for
decoding (both on the host side for now: lengths read on the host, flash_attn_func calls).
Split-KV partials: ``flashgen.flash_attn_combine`` (torch, FA3's name).
FP8 inputs: ``flashgen.quantize_fp8`` (torch) makes e4m3 q, k, v and their descales with FA3's
block quantization and incoherent processing; ``flashgen.QUANT_BLOCK`` rows share a block scale.
Other frameworks: ``flashgen.flash_attn_forward``, ``flashgen.flash_attn_backward`` and
``flashgen.flash_attn_combine_dlpack`` take DLPack arrays.
Torch is imported only when the torch API is first used; without torch, using it raises an
ImportError that says how to install it (``pip install flashgen[torch]``), while
``import flashgen`` and the DLPack API keep working.

Argument errors list every problem of the call, one line each; a lone problem raises
TypeError, ValueError or NotImplementedError, a mix raises ``flashgen.InputError`` (a
subclass of both ValueError and TypeError).
"""

__version__ = "0.1.0"

_LAZY = {
    "flash_attn_func": ("interface", "flash_attn_func"),
    "flash_attn_qkvpacked_func": ("interface", "flash_attn_qkvpacked_func"),
    "flash_attn_varlen_func": ("interface", "flash_attn_varlen_func"),
    "flash_attn_with_kvcache": ("kvcache", "flash_attn_with_kvcache"),
    "get_scheduler_metadata": ("kvcache", "get_scheduler_metadata"),
    "flash_attn_forward": ("dlpack_api", "flash_attn_forward"),
    "flash_attn_backward": ("dlpack_api", "flash_attn_backward"),
    "flash_attn_combine": ("interface", "flash_attn_combine"),
    "flash_attn_combine_dlpack": ("dlpack_api", "flash_attn_combine_dlpack"),
    "quantize_fp8": ("interface", "quantize_fp8"),
    "QUANT_BLOCK": ("quantize", "QUANT_BLOCK"),
    "InputError": ("_validate", "InputError"),
    "MissingVariantError": ("dispatch", "MissingVariantError"),
    "select_variant": ("dispatch", "select_variant"),
    "load_manifest": ("manifest", "load_manifest"),
}

__all__ = ["__version__", *_LAZY]


def __getattr__(name):
    if name in _LAZY:
        import importlib

        mod, attr = _LAZY[name]
        value = getattr(importlib.import_module(f".{mod}", __name__), attr)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'flashgen' has no attribute {name!r}")
