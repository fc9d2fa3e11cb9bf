"""pagedtree: an LLM inference engine with tree speculative decoding built in."""

from setuptools import find_packages, setup

setup(
    name="pagedtree",
    version="0.1.0",
    description="LLM inference engine with paged KV cache and tree speculative decoding",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    python_requires=">=3.10",
    packages=find_packages(include=["pagedtree", "pagedtree.*"]),
    install_requires=[
        # torch is pinned by scripts/setup.sh (a CPU build from local disk here);
        # an unpinned torch would pull a multi-GB CUDA build on a CPU machine.
        "torch>=2.5",
        "triton>=3.0,<3.8",  # 3.7.1 is what the kernels are tested with (see scripts/setup.sh)
        "transformers>=5.0,<6",  # configs, tokenizers (it brings `tokenizers`), GGUF conversion
        "sentencepiece",  # not imported by pagedtree: transformers needs it for SentencePiece tokenizers (Llama 2, Mistral)
        "safetensors",
        "gguf>=0.10",  # reading GGUF blocks (pagedtree/loading/gguf_weights.py); transformers converts .gguf files through it
        "numpy",
        "numba>=0.60",  # the CPU kernels: attention and element-wise ops (pagedtree/kernels/cpu_*.py), seeded noise
        "tqdm",
        "onnxruntime>=1.22",  # the q4/q8 formats: MatMulNBits (MLAS) kernels (pagedtree/worker/models/block_quant.py)
        "onnx",  # builds the one-node graphs those kernels run in
        # ggml-python (llama.cpp's ggml, the "ggml" weight format) is installed by
        # scripts/setup.sh, built for the machine's CPU (pagedtree/worker/models/ggml_matmul.py);
        # without it that format is refused with the command that installs it.
        "xgrammar>=0.2.8,<0.3",  # structured outputs: grammar compiler, token masks, matcher rollback (pagedtree/structured/)
        "jsonschema>=4.18",  # schemas checked against JSON Schema's meta-schema before they compile (structured/schema_check.py)
        "aiohttp",
        "uvloop",
        "prometheus-client",
        "huggingface-hub",
        "accelerate",  # not imported by pagedtree: transformers refuses to read a GGUF file without it
    ],
    extras_require={"bench": ["matplotlib"], "test": ["scipy", "pytest", "hypothesis", "openai"]},  # + text-generation --no-deps: scripts/setup.sh
    entry_points={"console_scripts": ["pagedtree=pagedtree.entrypoints.cli:main"]},
)
