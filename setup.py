from setuptools import find_packages, setup

setup(
    name="elastor-mcore",
    version="0.1.0",
    description="Heterogeneous layouts, partition-agnostic zarr checkpoints and automatic "
                "recovery for Megatron-Core training",
    packages=find_packages(include=["elastor_mcore", "elastor_mcore.*"]),
    python_requires=">=3.10",
    install_requires=[
        "torch>=2.6",
        "megatron-core>=0.16,<0.20",
        "tensorstore>=0.1.60",
        "pyyaml",
        "numpy",
        "psutil",
        "tokenizers>=0.21",
        "matplotlib",  # elastor demo's loss.png
    ],
    extras_require={
        "test": ["pytest", "pytest-timeout", "six"],  # six: megatron.training (Megatron-LM tests)
        "te": ["transformer-engine[pytorch]"],
        "hf": ["transformers", "safetensors"],
        "plot": ["matplotlib"],
    },
    entry_points={"console_scripts": ["elastor=elastor_mcore.cli:main"]},
)
