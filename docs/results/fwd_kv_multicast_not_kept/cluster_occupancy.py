"""How many 2-CTA clusters of each built kv_multicast forward kernel the GPU runs at once
(cuOccupancyMaxActiveClusters), against the persistent grid's clusters (SMs // 2)."""
from cuda.bindings import driver as d

from flashgen import launch
from flashgen.manifest import load_manifest

sms = launch.num_sms(0)
for var in load_manifest().variants:
    if var.family != "fwd" or not var.params.get("kv_multicast"):
        continue
    k = launch.get_kernel(var, "main", 0)
    cfg = d.CUlaunchConfig()
    cfg.gridDimX, cfg.gridDimY, cfg.gridDimZ = sms - sms % 2, 1, 1  # the persistent grid
    cfg.blockDimX, cfg.blockDimY, cfg.blockDimZ = k.record.threads, 1, 1
    cfg.sharedMemBytes = k.record.smem_bytes
    cfg.attrs = list(k.launch_attrs)
    cfg.numAttrs = len(cfg.attrs)
    with launch.device_context(0):
        err, n = d.cuOccupancyMaxActiveClusters(k.function, cfg)
    print(f"{var.name}: max active 2-CTA clusters {n} ({err}); SMs {sms}")
