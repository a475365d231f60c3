import os

# Tests run on the CPU with float32 matmuls at full precision, so HF parity is a float32 comparison.
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")
