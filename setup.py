from setuptools import find_packages, setup

setup(
    name="elastor-mcore",
    version="0.1.0",
    description="Heterogeneous layouts, partition-agnostic zarr checkpoints and automatic "
                "recovery for Megatron-Core training",
    license="Apache-2.0",
    license_files=["LICENSE"],
    # The recipes, hardware profiles and layouts stay at the top of the repository and
    # ship inside the package as elastor_mcore/recipes/ (config/shipped.py finds them in
    # either place), so `elastor demo` and `--recipe llama3-8b` work from a wheel.
    packages=find_packages(include=["elastor_mcore", "elastor_mcore.*"])
    + ["elastor_mcore.recipes"],
    package_dir={"elastor_mcore.recipes": "recipes"},
    package_data={"elastor_mcore.recipes": ["*.yaml", "hardware/*.yaml", "layouts/*.yaml"]},
    python_requires=">=3.10",
    install_requires=[
        "torch>=2.6",
        # Tested: 0.16.1 (Python 3.11) and 0.19.2 (Python 3.12, the only wheels >= 0.17);
        # version differences are decided in elastor_mcore/compat/mcore.py.
        "megatron-core>=0.16,<0.20",
        "tensorstore>=0.1.60",
        "google-crc32c>=1.5",  # checkpoint loads: crc32c checked in place (fast_read)
        "pyyaml",
        "numpy",
        "psutil",
        "tokenizers>=0.21",
        "matplotlib",  # elastor demo's loss.png
    ],
    extras_require={
        "test": [
            "pytest", "pytest-timeout", "pytest-xdist",
            # Megatron-LM's training code (the real pretrain_gpt.py tests) imports six and
            # triton, both of which come with CUDA torch but not with the CPU wheel.
            "six", "triton; platform_system == 'Linux' and platform_machine == 'x86_64'",
            "moto[server]>=5",  # a real S3 server on 127.0.0.1 for the s3:// checkpoint tests
        ],
        "te": ["transformer-engine[pytorch]"],
        "hf": ["transformers", "safetensors"],
        "plot": ["matplotlib"],
    },
    entry_points={"console_scripts": ["elastor=elastor_mcore.cli:main"]},
)
