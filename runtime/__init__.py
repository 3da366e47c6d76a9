"""flashgen: FlashAttention-3 forward kernels for NVIDIA Hopper, built ahead of time as fatbins
and launched through cuda-python (no C++ extension, no libtorch ABI).

Torch users: ``from flashgen import flash_attn_func`` (FA3's ``flash_attn_interface`` names).
Split-KV partials: ``flashgen.flash_attn_combine`` (torch, FA3's name).
Other frameworks: ``flashgen.flash_attn_forward`` and ``flashgen.flash_attn_combine_dlpack``
take DLPack arrays.
Torch is imported only when the torch API is first used.
"""

__version__ = "0.1.0"

_LAZY = {
    "flash_attn_func": ("interface", "flash_attn_func"),
    "flash_attn_forward": ("dlpack_api", "flash_attn_forward"),
    "flash_attn_combine": ("interface", "flash_attn_combine"),
    "flash_attn_combine_dlpack": ("dlpack_api", "flash_attn_combine_dlpack"),
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
