"""Shared pytest set-up: CPU JAX with float32 matmuls at full precision for parity tests."""

import jax

jax.config.update("jax_default_matmul_precision", "highest")
