"""XLA:CPU float32 product rates at decode shapes ([B, 896] x [4864, 896]^T, and a fused [2F, D] gate+up),
under the XLA_FLAGS given in the environment. Run once per flag set, e.g.:

    for f in "" --xla_cpu_use_xnnpack=true --xla_cpu_use_onednn=true; do XLA_FLAGS="$f" python bench/matmul_cpu.py; done
"""
import time, jax, jax.numpy as jnp, os
def t(f, *a, n=10):
    f(*a).block_until_ready()
    s=time.perf_counter()
    for _ in range(n): r=f(*a)
    r.block_until_ready()
    return (time.perf_counter()-s)/n*1e3
D,F=896,4864
res=[]
for B in [1,32,64]:
    x=jnp.ones((B,D)); w=jnp.ones((F,D)); w2=jnp.ones((2*F,D))
    a=t(jax.jit(lambda x,w: jnp.einsum('bd,fd->bf',x,w)), x,w)
    b=t(jax.jit(lambda x,w: jnp.einsum('bd,fd->bf',x,w)), x,w2)
    res.append(f"B={B}: {a:.2f}ms ({2*B*D*F/a/1e6:.0f} GF/s) fused2F {b:.2f}ms ({4*B*D*F/b/1e6:.0f} GF/s)")
print(os.environ.get("XLA_FLAGS"), " | ".join(res))
