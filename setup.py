"""layerwave: choose which target layers a speculative-decoding draft reads, train it, run it."""

import setuptools

setuptools.setup(
    name="layerwave",
    version="0.1.0",
    description=(
        "Matrix-entropy and CKA layer selection for EAGLE-3-style speculative decoding, in JAX/Flax."
    ),
    packages=setuptools.find_packages(include=["layerwave", "layerwave.*"]),
    python_requires=">=3.10",
    install_requires=[
        "jax>=0.7",
        "flax>=0.12",
        "optax>=0.2.5",
        "orbax-checkpoint>=0.11",
        "transformers>=4.50",
        "tokenizers>=0.21",
        "safetensors>=0.4",
        "gguf>=0.17",
        "huggingface_hub>=0.30",
        "jinja2>=3.1",
        "numpy>=1.26",
        "ml-collections>=1.0",
        "absl-py>=2.0",
        "tensorflow-datasets>=4.9.9",
        "array-record>=0.7",
        "matplotlib>=3.8",
        "tensorboardX>=2.6",
    ],
    extras_require={
        # torch is pinned: 2.13.0 is the CPU build this project's machines carry (see README). jax[tpu] brings
        # libtpu, with which the tests compile every stage for a TPU topology on this CPU (experiments/aot_check.py);
        # it pins jax to the version its libtpu was built with.
        "test": ["pytest>=8", "pytest-xdist>=3.5", "chex>=0.1.90", "torch==2.13.0", "nbclient>=0.10", "ipykernel>=6",
                 "jax[tpu]==0.10.2"],
    },
)
