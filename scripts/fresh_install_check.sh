#!/usr/bin/env bash
# "A fresh clone built with `pip install .` in a new venv runs flash_attn_func on the GPU."
#   git archive -o .fresh.tar HEAD      (here: the committed tree, what a clone holds)
#   bash scripts/fresh_install_check.sh [.fresh.tar] [wheel folder]
# On the GPU machine (no network): unpack into a temp folder, make a venv that sees the machine's
# torch, `pip install .` with build isolation on (the build backend compiles the default kernels;
# its build requirements come from the wheel folder, e.g. .devwheels/ made with `pip download`),
# then, from a folder that is not a checkout and with no FLASHGEN_* variables, check that the
# package's own manifest is used and that flash_attn_func matches a float32 reference.
set -euo pipefail
tarball=$(realpath "${1:-.fresh.tar}")
wheels=$(realpath "${2:-.devwheels}")
tmp=$(mktemp -d)
mkdir "$tmp/clone" && tar -xf "$tarball" -C "$tmp/clone"
python3 -m venv "$tmp/venv"
# the new venv sees the machine's torch (and its CUDA libraries) through a .pth file; python3 may
# itself be a venv, whose packages --system-site-packages would not show
torch_site=$(python3 -c "import os, torch; print(os.path.dirname(os.path.dirname(torch.__file__)))")
"$tmp/venv/bin/python" -c "import sysconfig, sys; open(sysconfig.get_paths()['purelib'] + '/_machine_torch.pth', 'w').write(sys.argv[1] + '\n')" "$torch_site"
t0=$(date +%s)
"$tmp/venv/bin/pip" install -q --no-index --find-links "$wheels" "$tmp/clone"
echo "pip install . (fresh tree, new venv, build isolation): $(( $(date +%s) - t0 )) s"
cd "$tmp"
unset FLASHGEN_ROOT FLASHGEN_BUILD_DIR FLASHGEN_KERNEL_DIR FLASHGEN_VARIANTS
"$tmp/venv/bin/flashgen" info | grep -E "^(manifest|variants)"
"$tmp/venv/bin/python" - <<'PY'
import math
import torch
import flashgen
from flashgen import flash_attn_func
from flashgen.manifest import find_manifest

path, source = find_manifest(with_source=True)
assert source == "installed package" and "/venv/" in str(path), (path, source)
assert "/venv/" in flashgen.__file__, flashgen.__file__
g = torch.Generator(device="cuda").manual_seed(0)
worst = 0.0
for dtype in (torch.bfloat16, torch.float16):
    for d, causal in ((64, False), (128, True), (256, True)):
        q = torch.randn(2, 239, 8, d, device="cuda", dtype=dtype, generator=g)
        k = torch.randn(2, 1023, 2, d, device="cuda", dtype=dtype, generator=g)
        v = torch.randn(2, 1023, 2, d, device="cuda", dtype=dtype, generator=g)
        out, lse = flash_attn_func(q, k, v, causal=causal, return_attn_probs=True)
        def ref(dt):
            qq, kk, vv = (t.to(dt).transpose(1, 2) for t in (q, k, v))
            kk, vv = kk.repeat_interleave(4, 1), vv.repeat_interleave(4, 1)
            s = qq @ kk.transpose(-1, -2) / math.sqrt(d)
            if causal:  # bottom-right aligned
                i = torch.arange(239, device="cuda")[:, None]; j = torch.arange(1023, device="cuda")[None]
                s = s.masked_fill(j > i + 1023 - 239, float("-inf"))
            return (s.softmax(-1) @ vv).transpose(1, 2)
        r32, rlow = ref(torch.float32), ref(dtype).float()
        err = (out.float() - r32).abs().max().item()
        bound = 2 * (rlow - r32).abs().max().item() + 1e-5
        print(f"{str(dtype):15s} d={d:3d} causal={causal!s:5s} max err {err:.2e} (FA3 bound {bound:.2e})")
        assert err <= bound, (dtype, d, causal, err, bound)
print(f"fresh install OK: flash_attn_func from {flashgen.__file__}, kernels from {path}")
PY
