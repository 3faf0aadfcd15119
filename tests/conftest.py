"""Shared pytest set-up: CPU JAX with float32 matmuls at full precision for parity tests."""

import os

# XLA:CPU's eigvalsh calls OpenBLAS, whose per-core spinning threads slow it 10-40x when the cores are
# shared (CI runners, parallel jobs); one thread is no slower on an idle machine.
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import jax  # pylint: disable=g-import-not-at-top

jax.config.update("jax_default_matmul_precision", "highest")
