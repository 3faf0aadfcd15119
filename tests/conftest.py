"""Shared pytest set-up: CPU JAX with float32 matmuls at full precision for parity tests."""

import layerwave  # pylint: disable=unused-import  # first: it sets OPENBLAS_NUM_THREADS before jax loads

import jax  # pylint: disable=g-import-not-at-top

jax.config.update("jax_default_matmul_precision", "highest")
