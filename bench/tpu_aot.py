"""Ahead-of-time TPU v6e compilation on a machine without a TPU.

Needs the separate venv .venv-tpu (jax[tpu]==0.10.2, which brings libtpu);
run with JAX_PLATFORMS=cpu so jax's own default backend stays the CPU:

    JAX_PLATFORMS=cpu .venv-tpu/bin/python bench/tpu_aot.py

Arguments must be abstract: jax.ShapeDtypeStruct(shape, dtype,
sharding=NamedSharding(mesh, P(...))); nothing can be placed on or run on the
topology's devices. All numbers from compile_report are per chip (one SPMD
partition), not summed over the mesh.

Pitfall: XLA's cost_analysis counts the body of a while loop (and so of
lax.scan / fori_loop) once, whatever the trip count. For a per-step roofline
of a scanned model, unroll the scan, multiply the body yourself, or bound the
bytes below by argument_bytes (weights + cache read once per step).
Pallas (Mosaic) kernels compile only inside shard_map and add no flops/bytes
to cost_analysis unless pallas_call is given a cost_estimate.
"""
import os

# Without these libtpu prints INVALID_ARGUMENT noise about TPU_WORKER_HOSTNAMES
# and the accelerator type (harmless). They only describe this host; the
# compiled topology is the one named in v6e_mesh.
os.environ.setdefault("TPU_ACCELERATOR_TYPE", "v6e-4")
os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")

import jax
import numpy as np
from jax.experimental import topologies
from jax.sharding import Mesh

HBM_BYTES_PER_CHIP = 32 * 10**9  # v6e spec sheet: 32 GB HBM per chip


def v6e_mesh(topology="v6e:2x2", tp=4):
    """Mesh ("data", "model") = (n_chips // tp, tp) over an AOT v6e topology."""
    devs = topologies.get_topology_desc(topology_name=topology, platform="tpu").devices
    assert len(devs) % tp == 0, f"{len(devs)} chips not divisible by tp={tp}"
    return Mesh(np.array(devs).reshape(len(devs) // tp, tp), ("data", "model"))


def compile_report(jitted_fn, *abstract_args, **abstract_kwargs):
    """Lower and compile for the TPU topology; per-chip memory and cost figures.

    total_bytes (arguments + outputs + temps + code - aliased) is the HBM
    footprint; peak_bytes can be larger as it also counts copies that XLA
    prefetches into on-chip VMEM (seen for small weights).
    """
    return report_of(jitted_fn.lower(*abstract_args, **abstract_kwargs).compile())


def report_of(compiled):
    """compile_report's figures for an already compiled executable."""
    ma = compiled.memory_analysis()
    cost = compiled.cost_analysis()
    if isinstance(cost, (list, tuple)):  # older jax returned one dict per module
        cost = cost[0]
    rep = {
        "argument_bytes": ma.argument_size_in_bytes,
        "output_bytes": ma.output_size_in_bytes,
        "temp_bytes": ma.temp_size_in_bytes,
        "generated_code_bytes": ma.generated_code_size_in_bytes,
        "alias_bytes": ma.alias_size_in_bytes,
        "peak_bytes": getattr(ma, "peak_memory_in_bytes", None),
        "flops": float(cost.get("flops", 0.0)),
        "transcendentals": float(cost.get("transcendentals", 0.0)),
        "bytes_accessed": float(cost.get("bytes accessed", 0.0)),
        "xla_optimal_seconds": cost.get("optimal_seconds"),
    }
    # Donated inputs that are aliased to outputs are held once, not twice.
    rep["total_bytes"] = (rep["argument_bytes"] + rep["output_bytes"] + rep["temp_bytes"]
                          + rep["generated_code_bytes"] - rep["alias_bytes"])
    rep["hbm_fraction"] = rep["total_bytes"] / HBM_BYTES_PER_CHIP
    return rep


def roofline_ms(cost, tflops=918.0, hbm_tb_s=1.6):
    """Per-chip roofline time in ms: max(flops / peak, bytes / bandwidth).

    `cost` is a compile_report dict or a raw cost_analysis dict. Defaults are
    the TPU v6e (Trillium) per-chip spec: 918 TFLOP/s dense bf16 peak (int8 is
    1836 TOP/s) and 1638 GB/s HBM bandwidth, rounded down here to 1.6 TB/s
    (XLA's own "optimal_seconds" uses about 1.64 TB/s). With per-chip numbers
    from an SPMD compile this is the step time of the whole mesh, ignoring ICI
    collectives and the loop-counting pitfall in the module docstring.
    """
    flops = cost.get("flops", 0.0)
    nbytes = cost.get("bytes_accessed", cost.get("bytes accessed", 0.0))
    return 1e3 * max(flops / (tflops * 1e12), nbytes / (hbm_tb_s * 1e12))


if __name__ == "__main__":
    import time

    import jax.numpy as jnp
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    mesh = v6e_mesh()
    x_s, w_s = NamedSharding(mesh, P("data", None)), NamedSharding(mesh, P(None, "model"))
    o_s = NamedSharding(mesh, P("data", "model"))
    x = jax.ShapeDtypeStruct((256, 4096), jnp.bfloat16, sharding=x_s)
    w = jax.ShapeDtypeStruct((4096, 8192), jnp.bfloat16, sharding=w_s)
    f = jax.jit(lambda a, b: jnp.dot(a, b, preferred_element_type=jnp.float32).astype(a.dtype),
                in_shardings=(x_s, w_s), out_shardings=o_s)
    t0 = time.perf_counter()
    rep = compile_report(f, x, w)
    print(f"default backend {jax.default_backend()}; mesh {dict(mesh.shape)} on "
          f"{mesh.devices.flat[0].device_kind}; compiled in {time.perf_counter() - t0:.2f}s")
    for k, v in rep.items():
        print(f"  {k:22s} {v}")
    print(f"  {'roofline_ms':22s} {roofline_ms(rep):.4f}")
    expect = 2 * 256 * 4096 * 8192 / 4  # one chip's quarter of the matmul
    assert abs(rep["flops"] / expect - 1) < 0.01, (rep["flops"], expect)
