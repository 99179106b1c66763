"""Packaging for vllm-specplug.

`kernels/` sits at the top of the repository (the design card's layout) but is
installed as the sub-package `vllm_specplug.kernels`, never as a bare `kernels`.
"""
from setuptools import find_packages, setup

_packages = find_packages(include=["vllm_specplug", "vllm_specplug.*"])
_kernel_packages = ["vllm_specplug.kernels" + p[len("kernels"):]
                    for p in find_packages(include=["kernels", "kernels.*"])]

setup(
    name="vllm-specplug",
    version="0.1.0",
    description="Speculative-decoding plugin for vLLM: proposers, verification, "
    "hidden-state extraction, draft-head training and kernels.",
    python_requires=">=3.10",
    packages=_packages + _kernel_packages,
    package_dir={"vllm_specplug.kernels": "kernels"},
    install_requires=[
        "safetensors",
        "tokenizers",
        "transformers",
        "tqdm",
        "packaging",
    ],
    extras_require={
        "test": ["pytest", "hypothesis", "openai", "matplotlib"],
        "suffix": ["arctic-inference==0.3.0"],
    },
    entry_points={
        "vllm.general_plugins": ["vllm_specplug = vllm_specplug.plugin:register"],
        "console_scripts": ["vllm-specplug = vllm_specplug.cli.main:main"],
        # per-step draft lengths in a server's /metrics (integration/stat_logger.py)
        "vllm.stat_logger_plugins": [
            "vllm_specplug = vllm_specplug.integration.stat_logger:SpecplugStatLogger"],
        # Our built-ins register exactly as third-party proposers do.
        "vllm_specplug.proposers": [
            "specplug_ngram = vllm_specplug.proposers.ngram:NgramProposer",
            "specplug_suffix = vllm_specplug.proposers.suffix:SuffixProposer",
            "specplug_hybrid = vllm_specplug.proposers.hybrid:HybridProposer",
            "specplug_eagle3 = vllm_specplug.proposers.eagle3:Eagle3TreeProposer",
            "specplug_mtp = vllm_specplug.proposers.mtp:MtpTreeProposer",
        ],
    },
)
